import django_filters

from approvals import selectors
from approvals.choices import ActionStatus, HandoffStatus
from approvals.models import BusinessAction, Handoff
from config.api import FilterSet

PENDING = "pending"


class ApprovalFilter(FilterSet):
    """`status=pending` is the actions the approval queue lists as pending
    (`selectors.pending`); any other value is an action status."""

    status = django_filters.ChoiceFilter(
        choices=[(PENDING, "Pending"), *ActionStatus.choices], method="filter_status"
    )

    class Meta:
        model = BusinessAction
        fields = ["status"]

    def filter_status(self, queryset, name: str, value: str):
        return selectors.pending(queryset) if value == PENDING else queryset.filter(status=value)


class HandoffFilter(FilterSet):
    """`status=open` is the requests still waiting for someone."""

    status = django_filters.ChoiceFilter(choices=HandoffStatus.choices)

    class Meta:
        model = Handoff
        fields = ["status"]
