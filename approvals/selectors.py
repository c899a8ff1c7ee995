"""Reads of Business Actions with the approver's scope applied in one place."""

from collections import defaultdict

from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.db.models import (
    BooleanField,
    Case,
    ExpressionWrapper,
    IntegerField,
    Q,
    QuerySet,
    Value,
    When,
)
from django.utils import timezone

from approvals.choices import ActionStatus, HandoffStatus
from approvals.models import BusinessAction, Handoff
from registry.choices import ROLE_ACTIONS, Action
from registry.models import Membership, Tenant
from registry.selectors import tenants_where_user_can
from runs.choices import RunStatus


def _where_user_decides(
    rows: QuerySet, *, user: AbstractBaseUser, tenant: Tenant | None
) -> QuerySet:
    """`rows` of the tenants where `user` may decide approvals (of `tenant` only, if given).
    Nobody decides in an evaluation sandbox: its actions and requests are only observed."""
    tenants = tenants_where_user_can(user=user, action=Action.APPROVAL_DECIDE)
    rows = rows.filter(tenant__in=tenants.filter(sandbox_of__isnull=True))
    return rows if tenant is None else rows.filter(tenant=tenant)


def _pending() -> Q:
    """Actions still waiting for a decision that can be given: on a run that still waits for
    it, before the approval expires. The sweep ends an expired one within a minute, or never
    without a beat; until then it is no longer pending, as `services.approval_decide` refuses
    to decide it."""
    return Q(
        status=ActionStatus.WAITING_APPROVAL,
        run__status=RunStatus.WAITING_APPROVAL,
        expires_at__gt=timezone.now(),
    )


def _queue(actions: QuerySet[BusinessAction]) -> QuerySet[BusinessAction]:
    """Pending ones first (`is_pending`), oldest first among them (the id breaks ties, so
    that a page never repeats or skips one), with what a page or the API shows."""
    return (
        actions.select_related(
            "tenant", "requester", "run", "skill_version__skill", "decision__approver"
        )
        .annotate(is_pending=ExpressionWrapper(_pending(), output_field=BooleanField()))
        .order_by("-is_pending", "created_at", "pk")
    )


def actions_visible(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[BusinessAction]:
    """The actions in the tenants where `user` may decide approvals (one tenant if given),
    whichever roles their policies name; anything else is "not found"."""
    return _queue(_where_user_decides(BusinessAction.objects.all(), user=user, tenant=tenant))


def _names_approver_role(role: str, field: str = "policy__approver_roles") -> Q:
    """Actions whose frozen policy names `role` among its approver roles. PostgreSQL asks the
    JSON array itself; SQLite (the embedded default) has no JSON containment, so the quoted
    role is looked for in the array's text (role names are plain lower-case words)."""
    if connection.vendor == "postgresql":
        return Q(**{f"{field}__contains": [role]})
    return Q(**{f"{field}__icontains": f'"{role}"'})


def actions_for_approver(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[BusinessAction]:
    """The actions `user` may decide (one tenant's if given), as `services.approval_decide`
    checks it: in a tenant where they may decide approvals, under a policy that names one of
    their roles there as an approver role. The queue lists these."""
    actions = actions_visible(user=user, tenant=tenant).exclude(
        Q(requester_id=user.pk) & Q(policy__allow_self_approval=False)
    )
    return actions.filter(_decidable(user, tenant, "policy__approver_roles"))


def _decidable(user: AbstractBaseUser, tenant: Tenant | None, field: str) -> Q:
    """Rows whose approver roles (`field`) name a role `user` holds in the row's tenant."""
    if user.is_superuser:
        return Q()
    roles_by_tenant: dict[int, set[str]] = defaultdict(set)
    memberships = Membership.objects.filter(user_id=user.pk, tenant__is_active=True)
    if tenant is not None:
        memberships = memberships.filter(tenant=tenant)
    for tenant_id, role in memberships.order_by().values_list("tenant_id", "role"):
        roles_by_tenant[tenant_id].add(role)
    decidable = Q(pk__in=[])
    for tenant_id, roles in roles_by_tenant.items():
        if not any(Action.APPROVAL_DECIDE in ROLE_ACTIONS[role] for role in roles):
            continue
        named = Q(pk__in=[])
        for role in sorted(roles):
            named |= _names_approver_role(role, field)
        decidable |= Q(tenant_id=tenant_id) & named
    return decidable


def actions_of_tenant(*, tenant: Tenant) -> QuerySet[BusinessAction]:
    """Every action of `tenant`, for a command whose service tells who may run it: a person
    of the tenant without the right is refused, never told the action does not exist."""
    return _queue(BusinessAction.objects.filter(tenant=tenant))


def pending(actions: QuerySet[BusinessAction]) -> QuerySet[BusinessAction]:
    """The actions still waiting for a decision that can be given (`_pending`)."""
    return actions.filter(_pending())


def handoffs_for_person(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[Handoff]:
    """The handoffs in the tenants where `user` may decide approvals (one tenant if given),
    open ones of waiting runs first, oldest first among them."""
    handoffs = _where_user_decides(Handoff.objects.all(), user=user, tenant=tenant)
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
        .order_by("waiting", "created_at", "pk")
    )


def handoffs_for_handler(
    *, user: AbstractBaseUser, tenant: Tenant | None = None
) -> QuerySet[Handoff]:
    """The handoffs `user` may handle, as `services.handoff_resolve` checks it; the human
    queue lists these."""
    return (
        handoffs_for_person(user=user, tenant=tenant)
        .exclude(requester_id=user.pk)
        .filter(_decidable(user, tenant, "run__capability__approval_policy__approver_roles"))
    )
