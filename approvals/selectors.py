"""Reads of Business Actions with the approver's scope applied in one place."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Case, IntegerField, QuerySet, Value, When

from approvals.choices import ActionStatus, HandoffStatus
from approvals.models import BusinessAction, Handoff
from registry.choices import Action
from registry.models import Tenant
from registry.selectors import tenants_where_user_can
from runs.choices import RunStatus


def actions_for_approver(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[BusinessAction]:
    """The actions in the tenants where `user` may decide approvals (one tenant if given),
    waiting ones first, oldest first among them; anything else is "not found"."""
    actions = BusinessAction.objects.all()
    if not user.is_superuser:
        actions = actions.filter(
            tenant__in=tenants_where_user_can(user=user, action=Action.APPROVAL_DECIDE)
        )
    if tenant is not None:
        actions = actions.filter(tenant=tenant)
    return (
        actions.select_related("tenant", "requester", "run", "skill_version__skill", "decision")
        .annotate(
            waiting=Case(
                When(status=ActionStatus.WAITING_APPROVAL, then=Value(0)),
                default=Value(1),
                output_field=IntegerField(),
            )
        )
        .order_by("waiting", "created_at")
    )


def pending(actions: QuerySet[BusinessAction]) -> QuerySet[BusinessAction]:
    """The actions still waiting for a decision on a run that still waits for it."""
    return actions.filter(
        status=ActionStatus.WAITING_APPROVAL, run__status=RunStatus.WAITING_APPROVAL
    )


def handoffs_for_person(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[Handoff]:
    """The handoffs in the tenants where `user` may decide approvals (one tenant if given),
    open ones of waiting runs first, oldest first among them."""
    handoffs = Handoff.objects.all()
    if not user.is_superuser:
        handoffs = handoffs.filter(
            tenant__in=tenants_where_user_can(user=user, action=Action.APPROVAL_DECIDE)
        )
    if tenant is not None:
        handoffs = handoffs.filter(tenant=tenant)
    return (
        handoffs.select_related("tenant", "requester", "run", "resolved_by")
        .annotate(
            waiting=Case(
                When(
                    status=HandoffStatus.OPEN,
                    run__status=RunStatus.WAITING_APPROVAL,
                    then=Value(0),
                ),
                default=Value(1),
                output_field=IntegerField(),
            )
        )
        .order_by("waiting", "created_at")
    )
