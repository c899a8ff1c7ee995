import django_filters

from runs.choices import RunStatus
from runs.models import Run


class RunFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=RunStatus.choices)
    session = django_filters.UUIDFilter(field_name="session_id")
    skill = django_filters.CharFilter(method="filter_skill", help_text="name or name@version")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Run
        fields = ["status", "session", "skill", "created_after", "created_before"]

    def filter_skill(self, queryset, name: str, value: str):
        if "@" in value:
            return queryset.filter(skill=value)
        return queryset.filter(skill__startswith=f"{value}@")
