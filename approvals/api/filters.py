import django_filters

from approvals.choices import ActionStatus, HandoffStatus
from approvals.models import BusinessAction, Handoff
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


class HandoffFilter(FilterSet):
    """`status=open` is the requests still waiting for someone."""

    status = django_filters.ChoiceFilter(choices=HandoffStatus.choices)

    class Meta:
        model = Handoff
        fields = ["status"]
