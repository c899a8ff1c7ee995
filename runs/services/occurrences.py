"""The status of a scheduled task's occurrence, and the one notification its owner gets.

An occurrence follows its run: `runs.services.runs.run_transition` calls
`occurrence_follow_run` in the transaction that moves the run, so the two never disagree. A
task never waits on a person who is not there: a run that needs an answer ends
NEEDS_CLARIFICATION, the occurrence `needs_owner`, and the owner is told once by email.

Lock order, as everywhere: the run's row, then the occurrence's.
"""

from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from runs.choices import OCCURRENCE_TERMINAL, OCCURRENCE_TRANSITIONS, OccurrenceStatus, RunStatus
from runs.errors import InvalidOccurrenceTransition
from runs.models import Run, TaskOccurrence

# The reason code of a run its occurrence's deadline ended.
DEADLINE_PASSED = "DEADLINE_PASSED"

OCCURRENCE_STATUS_OF_RUN: dict[str, OccurrenceStatus] = {
    RunStatus.QUEUED: OccurrenceStatus.RUNNING,
    RunStatus.RUNNING: OccurrenceStatus.RUNNING,
    RunStatus.WAITING_APPROVAL: OccurrenceStatus.WAITING_APPROVAL,
    RunStatus.COMPLETED: OccurrenceStatus.COMPLETED,
    RunStatus.NEEDS_CLARIFICATION: OccurrenceStatus.NEEDS_OWNER,
    RunStatus.REFUSED: OccurrenceStatus.REFUSED,
    RunStatus.PARTIAL: OccurrenceStatus.FAILED,
    RunStatus.FAILED_RETRYABLE: OccurrenceStatus.FAILED,
    RunStatus.FAILED_FINAL: OccurrenceStatus.FAILED,
    RunStatus.BUDGET_EXHAUSTED: OccurrenceStatus.FAILED,
    RunStatus.CANCELLED: OccurrenceStatus.CANCELLED,
}


def occurrence_transition(
    *, occurrence: TaskOccurrence, status: OccurrenceStatus, detail: str = ""
) -> TaskOccurrence:
    """Move a locked occurrence to `status`. The same status again is a no-op; a terminal
    status is never overwritten. Reaching `needs_owner` tells the owner after commit."""
    if occurrence.status == status:
        return occurrence
    if status not in OCCURRENCE_TRANSITIONS[occurrence.status]:
        raise InvalidOccurrenceTransition(
            f"A {occurrence.status} occurrence cannot become {status}.",
            details={"from": occurrence.status, "to": status},
        )
    occurrence.status = status
    update_fields = ["status", "updated_at"]
    if detail:
        occurrence.detail = detail
        update_fields.append("detail")
    if status in OCCURRENCE_TERMINAL:
        occurrence.finished_at = timezone.now()
        update_fields.append("finished_at")
    occurrence.save(update_fields=update_fields)
    if status == OccurrenceStatus.NEEDS_OWNER:
        occurrence_id = occurrence.pk
        transaction.on_commit(
            lambda: occurrence_owner_notify(occurrence_id=occurrence_id), robust=True
        )
    return occurrence


def occurrence_follow_run(*, run: Run, occurrence: TaskOccurrence | None = None) -> None:
    """Give the occurrence of a locked task run the status its run has now. A run ended by
    the occurrence's deadline makes it `deadline_passed`."""
    if occurrence is None:
        occurrence = TaskOccurrence.objects.select_for_update().filter(run=run).first()
        if occurrence is None:
            return
    status = OCCURRENCE_STATUS_OF_RUN[run.status]
    if run.status == RunStatus.CANCELLED and run.reason_code == DEADLINE_PASSED:
        status = OccurrenceStatus.DEADLINE_PASSED
    occurrence_transition(occurrence=occurrence, status=status, detail=run.reason_code)


def _notification(occurrence: TaskOccurrence) -> dict[str, Any]:
    """What the owner reads: which task and slot, why, and the run's question; never the
    draft, the directory's answer or anything the run read."""
    task = occurrence.task
    run = occurrence.run
    question = (run.result.get("question") if run else "") or "No question was recorded."
    return {
        "subject": f"Scheduled task {task.name!r} needs you",
        "message": (
            f"The scheduled task {task.name!r} of {task.tenant.name} could not finish its "
            f"occurrence of {occurrence.slot:%Y-%m-%d %H:%M} UTC on its own, and nothing was "
            "sent.\n\n"
            f"Reason: {occurrence.detail or 'unknown'}\n"
            f"Question: {question}\n\n"
            "Change the task (its project or recipient) in the admin, or ask for it yourself "
            "in a new message.\n"
            f"Run: {run.pk if run else 'none'}\n"
        ),
    }


def occurrence_owner_notify(*, occurrence_id: Any) -> bool:
    """Email the owner of a `needs_owner` occurrence, once: the row is locked while the mail
    goes out and the sending is recorded in the same transaction, so a second caller finds it
    recorded. A mail server that refuses leaves it unrecorded for the next sweep. Returns
    whether a mail was sent."""
    with transaction.atomic():
        occurrence = (
            TaskOccurrence.objects.select_for_update(of=("self",))
            .select_related("task__tenant", "owner", "run")
            .filter(pk=occurrence_id)
            .first()
        )
        if (
            occurrence is None
            or occurrence.status != OccurrenceStatus.NEEDS_OWNER
            or occurrence.owner_notified_at is not None
            or not occurrence.owner.email
        ):
            return False
        send_mail(
            **_notification(occurrence),
            from_email=settings.DEFAULT_FROM_EMAIL,
            recipient_list=[occurrence.owner.email],
            fail_silently=False,
        )
        occurrence.owner_notified_at = timezone.now()
        occurrence.save(update_fields=["owner_notified_at", "updated_at"])
    return True
