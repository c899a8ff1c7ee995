"""Thin Celery tasks of Business Actions: load by id, call the service."""

from celery import shared_task

from approvals import services


@shared_task(acks_late=True, reject_on_worker_lost=True)
def action_resume(*, action_id: str) -> None:
    """Re-validate an approved action and execute it once. Safe to deliver twice: an action
    already executing is settled by its idempotency key, never executed again."""
    services.action_execute(action_id=action_id)


@shared_task(acks_late=True)
def action_reconcile(*, action_id: str, attempt: int | None = None) -> str:
    """Make reconciliation `attempt` of an action whose outcome is unknown. The schedule is
    kept on the action, not in the broker: an attempt that leaves the outcome unknown writes
    when the next one is due and sends it, with its number, after commit; `actions_sweep`
    sends again an attempt overdue because its message was lost. So this task owns no
    retries: an attempt the database failed is not counted and stays due for the sweep, and
    a second delivery of an attempt already made does nothing (`services.action_reconcile`)."""
    return services.action_reconcile(action_id=action_id, attempt=attempt)


@shared_task(acks_late=True)
def actions_sweep() -> dict[str, int]:
    """Expire approvals past their TTL, invalidate the waiting ones whose MCP send tool
    changed on its server, resume approved or executing actions whose task was lost (the
    resume is idempotent) and send again the reconciliations of unknown actions that are
    overdue (an attempt is made once)."""
    return {
        "expired": services.actions_expire(),
        "invalidated": services.actions_invalidate_drifted(),
        "resumed": services.actions_resume_stalled(),
        "reconciled": services.actions_reconcile_overdue(),
    }
