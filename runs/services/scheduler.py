"""What the beat drives: a scheduled task fires, its occurrence starts a governed run, and
the sweep recovers starts whose worker died and ends occurrences past their deadline.

Exactly once, by three keys: (task, slot) is unique, so of two beats (or two deliveries)
firing for one slot only the first creates the occurrence and the other does nothing; a start
holds a lease with an attempt counter, so a second worker finds the occurrence taken while
the lease runs; and every attempt posts the same message under the Idempotency-Key
`task <task id> <slot>`, so a retried start finds the run the first one made (with spaces,
which no API client's key holds: no client can claim it first).

The run goes through `message_ingest` on the task channel, as the owner, like any message:
same capability resolution, same loop, same Business Action and approval before anything is
sent. Once an occurrence has a run, every path locks the run's row first; the occurrence and
the action of a run are locked only under it.
"""

import logging
import os
import smtplib
import socket
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from config.errors import ApplicationError
from runs.choices import ACTIVE_STATUSES, OCCURRENCE_ACTIVE, Channel, OccurrenceStatus
from runs.models import Run, ScheduledTask, TaskOccurrence
from runs.services.ingress import message_ingest
from runs.services.occurrences import (
    DEADLINE_PASSED,
    occurrence_follow_run,
    occurrence_owner_notify,
    occurrence_transition,
)
from runs.services.runs import run_cancel_locked
from runs.services.schedules import schedule_slot, scheduled_task_refused_pause

logger = logging.getLogger(__name__)

# Occurrences one sweep handles per kind of work, at most.
SWEEP_BATCH = 100


def _lease_owner() -> str:
    """Who holds a lease: host and process, and a token of this claim."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid4().hex[:8]}"


def _lease_until(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.SCHEDULED_TASK_LEASE_SECONDS)


def _message(task: ScheduledTask, *, occurrence_id: Any, slot: datetime) -> dict[str, Any]:
    """The message every attempt of the occurrence posts: the task's goal, and metadata only
    the server writes (the agent, the project, the recipient record, which task and slot).
    The run's agent is the task's, by its key (`agent_config_id`): by name, a start after the
    agent was renamed (a start again, after a worker died) would take whichever agent has
    the name now."""
    metadata: dict[str, Any] = {
        "agent": task.agent_config.name,
        "task": {
            "id": str(task.pk),
            "name": task.name,
            "occurrence_id": str(occurrence_id),
            "slot": slot.isoformat(),
        },
    }
    if task.project_id:
        metadata["project_id"] = task.project_id
    if task.recipient_record_id:
        metadata["recipient_record_id"] = task.recipient_record_id
    return {
        "parts": [{"type": "text", "text": task.goal}],
        "metadata": metadata,
        "agent_config_id": task.agent_config_id,
    }


def scheduled_task_fire(
    *, task_id: Any, now: datetime | None = None, sent_at: datetime | None = None
) -> TaskOccurrence | None:
    """Fire an enabled task for the slot of `sent_at` (when the beat sent the firing), or of
    `now`: create its occurrence with the first attempt's lease, then start it. The deadline
    counts from when the beat sent it: a firing delivered after its deadline (a backlog, the
    workers down) is recorded `deadline_passed` and starts nothing. Returns None when the
    task is paused or gone, or, logged as a warning, when this slot's occurrence exists
    already."""
    now = now or timezone.now()
    task = (
        ScheduledTask.objects.select_related("agent_config")
        .filter(pk=task_id, is_enabled=True)
        .first()
    )
    if task is None:
        return None
    fired_at = sent_at or now
    slot = schedule_slot(task, fired_at)
    deadline_at = fired_at + timedelta(seconds=task.deadline_seconds)
    lease_owner = _lease_owner()
    if deadline_at <= now:
        start = {
            "status": OccurrenceStatus.DEADLINE_PASSED,
            "detail": DEADLINE_PASSED,
            "finished_at": now,
        }
    else:
        start = {"attempts": 1, "lease_owner": lease_owner, "lease_expires_at": _lease_until(now)}
    occurrence_id = uuid4()
    try:
        with transaction.atomic():
            occurrence = TaskOccurrence.objects.create(
                id=occurrence_id,
                task=task,
                slot=slot,
                owner_id=task.owner_id,
                message=_message(task, occurrence_id=occurrence_id, slot=slot),
                deadline_at=deadline_at,
                **start,
            )
    except IntegrityError:
        # A second beat or a redelivery, or a firing after the schedule changed into a slot
        # an occurrence under the earlier schedule used: told, as it starts nothing.
        logger.warning(
            "Scheduled task %s (%s) fired for slot %s, which has an occurrence already; "
            "this firing starts nothing.",
            task.name,
            task.pk,
            slot.isoformat(),
        )
        return None
    if occurrence.status == OccurrenceStatus.DEADLINE_PASSED:
        return occurrence
    return occurrence_start(occurrence_id=occurrence_id, lease_owner=lease_owner)


def occurrence_start(*, occurrence_id: Any, lease_owner: str) -> TaskOccurrence | None:
    """Start the run of a pending occurrence whose lease `lease_owner` holds, and link it. A
    claim that was taken over, or an occurrence that moved on, does nothing. A refusal of the
    ingress (the owner may no longer start runs, the agent is gone) fails the occurrence and
    pauses the task, which every later firing would fail alike; any other error leaves it
    pending for the sweep to retry when the lease lapses."""
    with transaction.atomic():
        occurrence = (
            TaskOccurrence.objects.select_for_update(of=("self",))
            .select_related("task__tenant", "owner")
            .filter(pk=occurrence_id)
            .first()
        )
        if (
            occurrence is None
            or occurrence.status != OccurrenceStatus.PENDING
            or occurrence.lease_owner != lease_owner
        ):
            return None
        try:
            ingested = message_ingest(
                actor=occurrence.owner,
                tenant=occurrence.task.tenant,
                idempotency_key=occurrence.idempotency_key,
                channel=Channel.TASK,
                parts=occurrence.message["parts"],
                metadata=occurrence.message["metadata"],
                agent_config_id=occurrence.message["agent_config_id"],
            )
        except ApplicationError as error:
            refusal = f"{error.code}: {error.message}"
            scheduled_task_refused_pause(task=occurrence.task, refusal=refusal)
            return occurrence_transition(
                occurrence=occurrence, status=OccurrenceStatus.FAILED, detail=refusal
            )
        occurrence.run = ingested.run
        occurrence.save(update_fields=["run", "updated_at"])
        occurrence_follow_run(run=ingested.run, occurrence=occurrence)
    return occurrence


def _occurrence_claim(*, occurrence_id: Any, now: datetime) -> str | None:
    """Take the lapsed lease of a pending occurrence for one more attempt, or fail it when
    its attempts are spent. A row another worker holds is skipped. Returns the new lease
    owner, or None when there is nothing to start.

    The sweep read its clock when it began, and a long one comes to this occurrence later:
    the deadline and the new lease are taken from the clock now, if it is later, so no run
    starts past its deadline, nor holds a lease that lapsed as it was taken."""
    now = max(now, timezone.now())
    with transaction.atomic():
        occurrence = (
            TaskOccurrence.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("task")
            .filter(
                pk=occurrence_id,
                status=OccurrenceStatus.PENDING,
                lease_expires_at__lt=now,
                deadline_at__gt=now,
            )
            .first()
        )
        if occurrence is None:
            return None
        if occurrence.attempts >= occurrence.task.max_attempts:
            occurrence_transition(
                occurrence=occurrence,
                status=OccurrenceStatus.FAILED,
                detail=f"MAX_ATTEMPTS: {occurrence.attempts} starts did not finish.",
            )
            return None
        occurrence.attempts += 1
        occurrence.lease_owner = _lease_owner()
        occurrence.lease_expires_at = _lease_until(now)
        occurrence.save(update_fields=["attempts", "lease_owner", "lease_expires_at", "updated_at"])
        return occurrence.lease_owner


def occurrence_deadline_end(*, occurrence_id: Any, now: datetime | None = None) -> bool:
    """End an occurrence past its deadline. Without a run it ends `deadline_passed`; a queued
    or waiting run is cancelled at once with reason DEADLINE_PASSED, its action or its request
    left to people withdrawn (an approval or a handling that comes later does nothing); a
    running one stops at its next step with that reason, and the occurrence follows it. An
    action already executing was approved in time and is left to finish. Returns whether this
    call ended or stopped anything."""
    now = now or timezone.now()
    linked = TaskOccurrence.objects.filter(pk=occurrence_id).values("run_id").first()
    if linked is None:
        return False
    run_id = linked["run_id"]
    with transaction.atomic():
        # A run a step holds now is left to the next sweep (the approval and the resume
        # check the deadline too): waiting for the step would stall the whole sweep.
        run = (
            Run.objects.select_for_update(of=("self",), skip_locked=True)
            .select_related("tenant", "actor")
            .filter(pk=run_id)
            .first()
            if run_id
            else None
        )
        if run_id and run is None:
            return False
        occurrence = TaskOccurrence.objects.select_for_update().get(pk=occurrence_id)
        if (
            occurrence.status not in OCCURRENCE_ACTIVE
            or occurrence.deadline_at > now
            or occurrence.run_id != run_id
        ):
            return False
        if run is None:
            occurrence_transition(
                occurrence=occurrence,
                status=OccurrenceStatus.DEADLINE_PASSED,
                detail=DEADLINE_PASSED,
            )
            return True
        if run.status not in ACTIVE_STATUSES or run.cancel_requested_at is not None:
            return False
        run_cancel_locked(run, reason=DEADLINE_PASSED)
    return True


def occurrences_sweep(*, now: datetime | None = None) -> dict[str, int]:
    """The beat's recovery pass: end what is past its deadline, start again what a dead
    worker left pending (or fail it after `max_attempts`), and send the owner notifications
    a failed mail server left unsent. Returns how many of each it handled."""
    now = now or timezone.now()
    counts = {"deadline_passed": 0, "restarted": 0, "notified": 0}
    # Not those whose run is stopping already (it ends at its next step, the occurrence with
    # it): they would fill every batch and starve the occurrences behind them.
    overdue = (
        TaskOccurrence.objects.filter(status__in=OCCURRENCE_ACTIVE, deadline_at__lte=now)
        .exclude(run__cancel_requested_at__isnull=False)
        .order_by("deadline_at")
        .values_list("pk", flat=True)[:SWEEP_BATCH]
    )
    for occurrence_id in list(overdue):
        counts["deadline_passed"] += occurrence_deadline_end(occurrence_id=occurrence_id, now=now)
    lapsed = TaskOccurrence.objects.filter(
        status=OccurrenceStatus.PENDING, lease_expires_at__lt=now, deadline_at__gt=now
    ).values_list("pk", flat=True)[:SWEEP_BATCH]
    for occurrence_id in list(lapsed):
        lease_owner = _occurrence_claim(occurrence_id=occurrence_id, now=now)
        if lease_owner is not None:
            occurrence_start(occurrence_id=occurrence_id, lease_owner=lease_owner)
            counts["restarted"] += 1
    unnotified = (
        TaskOccurrence.objects.filter(
            status=OccurrenceStatus.NEEDS_OWNER, owner_notified_at__isnull=True
        )
        .exclude(owner__email="")
        .values_list("pk", flat=True)[:SWEEP_BATCH]
    )
    for occurrence_id in list(unnotified):
        try:
            counts["notified"] += occurrence_owner_notify(occurrence_id=occurrence_id)
        except (smtplib.SMTPException, OSError):
            logger.warning(
                "The owner of occurrence %s could not be emailed; the next sweep tries again.",
                occurrence_id,
                exc_info=True,
            )
    return counts
