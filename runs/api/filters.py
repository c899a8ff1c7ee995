import django_filters

from runs.choices import RunStatus
from runs.models import Run


class RunFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=RunStatus.choices)
    session = django_filters.UUIDFilter(field_name="session_id")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Run
        fields = ["status", "session", "created_after", "created_before"]
