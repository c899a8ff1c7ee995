"""The lifecycle of a Business Action (DESIGN.md): a side effect from proposal to a verified
terminal state. Statuses move only along `ACTION_TRANSITIONS`, through `approvals.services`."""

from django.db import models


class ActionStatus(models.TextChoices):
    PROPOSED = "proposed"
    FROZEN = "frozen"
    WAITING_APPROVAL = "waiting_approval"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    INVALIDATED = "invalidated"
    EXECUTING = "executing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


ACTION_TRANSITIONS: dict[str, frozenset[str]] = {
    ActionStatus.PROPOSED: frozenset({ActionStatus.FROZEN}),
    ActionStatus.FROZEN: frozenset({ActionStatus.WAITING_APPROVAL}),
    ActionStatus.WAITING_APPROVAL: frozenset(
        {
            ActionStatus.APPROVED,
            ActionStatus.REJECTED,
            ActionStatus.EXPIRED,
            ActionStatus.INVALIDATED,
        }
    ),
    ActionStatus.APPROVED: frozenset({ActionStatus.EXECUTING, ActionStatus.INVALIDATED}),
    ActionStatus.EXECUTING: frozenset(
        {ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.UNKNOWN}
    ),
    # Reconciliation settles an unknown outcome by the idempotency key, or finds that the
    # action never reached the system and executes it.
    ActionStatus.UNKNOWN: frozenset(
        {ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.EXECUTING}
    ),
    ActionStatus.REJECTED: frozenset(),
    ActionStatus.EXPIRED: frozenset(),
    ActionStatus.INVALIDATED: frozenset(),
    ActionStatus.SUCCEEDED: frozenset(),
    ActionStatus.FAILED: frozenset(),
}

DECIDABLE_STATUSES = frozenset({ActionStatus.WAITING_APPROVAL})
# An action whose execution started: it did something in the world, or may have, unless
# its send never reached the tool (refused by a gate, turned away by a limit), which leaves
# it failed with no `executed_at`.
EXECUTED_STATUSES = frozenset(
    {ActionStatus.EXECUTING, ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.UNKNOWN}
)


class Decision(models.TextChoices):
    APPROVE = "approve", "Approve"
    REJECT = "reject", "Reject"


class HandoffStatus(models.TextChoices):
    """A request the route left to people: open until someone handles or declines it, or
    withdrawn when its run ends first (cancelled, past its deadline): nobody may act on it
    then."""

    OPEN = "open"
    HANDLED = "handled"
    DECLINED = "declined"
    WITHDRAWN = "withdrawn"
