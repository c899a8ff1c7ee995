"""Thin Celery tasks of Business Actions: load by id, call the service, own the retries."""

from celery import shared_task
from django.db import OperationalError

from approvals import services
from approvals.choices import ActionStatus

RECONCILE_RETRIES = 8


@shared_task(acks_late=True, reject_on_worker_lost=True)
def action_resume(*, action_id: str) -> None:
    """Re-validate an approved action and execute it once. Safe to deliver twice: an action
    already executing is settled by its idempotency key, never executed again."""
    services.action_execute(action_id=action_id)


@shared_task(bind=True, acks_late=True, max_retries=RECONCILE_RETRIES)
def action_reconcile(self, *, action_id: str) -> str:
    """Settle an unknown outcome by the idempotency key; while it stays unknown, or the
    database failed the attempt (a dropped connection, a deadlock), ask again later with
    backoff (the action stays `unknown` for a person after the last attempt). No sweep
    sends an unknown action's reconciliation again: a failed attempt that ended the task
    would leave it unknown for good."""
    countdown = min(3600, 30 * 2**self.request.retries)
    try:
        status = services.action_reconcile(action_id=action_id)
    except OperationalError as error:
        raise self.retry(countdown=countdown, exc=error) from error
    if status == ActionStatus.UNKNOWN and self.request.retries < self.max_retries:
        raise self.retry(countdown=countdown)
    return status


@shared_task(acks_late=True)
def actions_sweep() -> dict[str, int]:
    """Expire approvals past their TTL and resume approved or executing actions whose task
    was lost (the resume is idempotent)."""
    return {
        "expired": services.actions_expire(),
        "resumed": services.actions_resume_stalled(),
    }
