import django_filters

from approvals.choices import ActionStatus
from approvals.models import BusinessAction
from config.api import FilterSet

PENDING = "pending"


class ApprovalFilter(FilterSet):
    """`status=pending` is the waiting ones; any other value is an action status."""

    status = django_filters.ChoiceFilter(
        choices=[(PENDING, "Pending"), *ActionStatus.choices], method="filter_status"
    )

    class Meta:
        model = BusinessAction
        fields = ["status"]

    def filter_status(self, queryset, name: str, value: str):
        return queryset.filter(status=ActionStatus.WAITING_APPROVAL if value == PENDING else value)
