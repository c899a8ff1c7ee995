"""Thin Celery tasks of the data plane: load by id, call the loop, own the retry policy."""

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from celery import shared_task
from celery.signals import before_task_publish
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F, Q
from django.utils import timezone

from config.celery import task_send
from config.queries import PreparedQuery
from runs.choices import RunStatus
from runs.loop import HOST_NODES, ModelTemporarilyUnavailable, model_error_output, run_execute
from runs.models import Run
from runs.services import attachments, memory
from runs.services.runs import (
    cancel_request_take_in,
    cancel_requests_take_in,
    run_finish,
    waiting_runs_end_without_standing,
)
from runs.services.schedules import FIRE_TASK
from runs.tools import limits

logger = logging.getLogger(__name__)

MODEL_RETRIES = 4
MODEL_RETRY_AFTER_MAX_S = 300
# The run's limits, when a step may advance it: queued or running, and not resting at a host
# node (its action's to advance, `approvals.tasks`).
_RUN_LIMITS = PreparedQuery(
    lambda run_id: (
        Run.objects.filter(pk=run_id, status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
        # (with the key: a node of NULL, in SQL, would exclude every run without one)
        .exclude(state__has_key="node", state__node__in=HOST_NODES)
        .order_by()
        .values(
            "tenant_id",
            "tenant__max_concurrent_runs",
            "tenant__sandbox_of_id",
            "tenant__sandbox_of__max_concurrent_runs",
            "capability__budgets__max_seconds",
        )[:1]
    ),
    run_id=UUID,
)


@dataclass(frozen=True)
class _Slot:
    """A slot of a tenant's concurrent runs (`limits.tenant_run_slot_take`)."""

    tenant_id: int
    cap: int
    seconds: int


def _slot(run: dict) -> _Slot | None:
    """The slot the run (its `_RUN_LIMITS`) advances in, None when its tenant has no cap. An
    evaluation sandbox's runs take slots of the tenant it is a sandbox of: they call that
    tenant's models and tools, as they spend its quota (`quotas.payer_id`), and a sandbox has
    no cap of its own. Eager (the embedded default) runs each task inline in its request:
    nothing to queue."""
    parent_id = run["tenant__sandbox_of_id"]
    cap = (
        run["tenant__sandbox_of__max_concurrent_runs"]
        if parent_id
        else run["tenant__max_concurrent_runs"]
    )
    if cap is None or settings.CELERY_TASK_ALWAYS_EAGER:
        return None
    seconds = run["capability__budgets__max_seconds"] or settings.RUN_LEASE_SECONDS
    return _Slot(tenant_id=parent_id or run["tenant_id"], cap=cap, seconds=seconds)


def _slot_take(slot: _Slot, run_id: str) -> bool:
    taken = limits.tenant_run_slot_take(
        tenant_id=slot.tenant_id, cap=slot.cap, run_id=run_id, seconds=slot.seconds
    )
    if not taken:
        logger.info("run %s waits: its tenant has %s runs advancing", run_id, slot.cap)
    return taken


def _backoff(retries: int) -> float:
    """Exponential backoff with full jitter, at most a minute."""
    return random.uniform(0, min(60, 2 ** (retries + 1)))


def _model_wait(retries: int, retry_after: float | None) -> float:
    """The backoff, or longer when the provider asked for a longer wait (at most
    MODEL_RETRY_AFTER_MAX_S: a longer one would hold the run for nothing)."""
    backoff = _backoff(retries)
    if retry_after is None:
        return backoff
    return max(backoff, min(retry_after, MODEL_RETRY_AFTER_MAX_S))


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=MODEL_RETRIES)
def run_advance(self, *, run_id: str) -> None:
    """Advance a run until it pauses or ends. Safe to deliver twice: each step locks the run
    and skips work already checkpointed. A run whose tenant has as many runs advancing as its
    `max_concurrent_runs` waits its turn: the task comes back a little later. A late copy of
    the task, for a run that ended or waits for people, is done with at once: it takes no
    slot and never comes back to wait for one."""
    run = _RUN_LIMITS.first(run_id=run_id)
    if run is None:
        return
    slot = _slot(run)
    if slot is None:
        _advance(self, run_id)
        return
    if not _slot_take(slot, run_id):
        countdown = _turn_wait()
        _lease_through(run_id, countdown)
        task_send(run_advance, run_id=run_id, countdown=countdown)
        return
    try:
        _advance(self, run_id)
    finally:
        limits.tenant_run_slot_release(tenant_id=slot.tenant_id, run_id=run_id)


class RunWaitsItsTurn(Exception):
    """The run's tenant has as many runs advancing as its cap: ask again in `seconds`."""

    def __init__(self, *, run_id: str, seconds: float) -> None:
        super().__init__(f"run {run_id} waits for its tenant's turn")
        self.seconds = seconds


def run_execute_in_turn(*, run_id: str) -> None:
    """Advance the run to its pause or end here, in a slot of its tenant's concurrent runs as
    its task takes one (`run_advance`): an eval run drives its cases' runs in its own task.
    Raises RunWaitsItsTurn, the run not advanced, when no slot is free."""
    run = _RUN_LIMITS.first(run_id=run_id)
    if run is None:
        return
    slot = _slot(run)
    if slot is None:
        run_execute(run_id=run_id)
        return
    if not _slot_take(slot, run_id):
        raise RunWaitsItsTurn(run_id=run_id, seconds=_turn_wait())
    try:
        run_execute(run_id=run_id)
    finally:
        limits.tenant_run_slot_release(tenant_id=slot.tenant_id, run_id=run_id)


def _turn_wait() -> float:
    """How long a run over its tenant's cap waits before it asks again (jittered)."""
    return random.uniform(0.5, 2.0)


def _end(run: Run, *, status: RunStatus, reason_code: str, output: dict | None = None) -> None:
    """End a locked active run whose step could not go on; a cancel requested meanwhile (it
    waits beside the run while a step holds it) ends it as the user asked instead."""
    cancel_request_take_in(run)
    if run.cancel_requested_at is not None:
        run_finish(run=run, status=RunStatus.CANCELLED, reason_code=run.cancel_reason)
    else:
        run_finish(run=run, status=status, reason_code=reason_code, output=output)


# Deliveries of a run's task that may fail in a row (raise, or die with their worker, rather
# than save a step) before the run ends FAILED_FINAL: a bug in a step, or a step that gets its
# worker killed (out of memory), would otherwise have the task given back and sent forever.
STEP_FAILURES_MAX = 5
# A run its task may advance: active, and not resting at a host node (`_RUN_LIMITS`).
_ADVANCEABLE = Q(status__in=[RunStatus.QUEUED, RunStatus.RUNNING]) & ~Q(
    state__has_key="node", state__node__in=HOST_NODES
)


def _delivery_count(run_id: str) -> bool:
    """Count this delivery against its run before it takes a step, committed on its own: a
    delivery whose worker dies mid-step leaves it counted (a step that saves starts the count
    again, or counts the step its delivery takes next, `runs.loop._save`). Returns whether
    the delivery may advance the run; one that finds STEP_FAILURES_MAX steps in a row failed
    before it ends the run instead."""
    if Run.objects.filter(_ADVANCEABLE, pk=run_id, attempts__lt=STEP_FAILURES_MAX).update(
        attempts=F("attempts") + 1
    ):
        return True
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(_ADVANCEABLE, pk=run_id).first()
        if run is not None:
            _failures_end(run)
    return False


def _step_failed(run_id: str) -> None:
    """Count a delivery whose step raised as failed: `_delivery_count`, or the step saved
    before it, counted it, unless another delivery's step saved meanwhile started the count
    again. The run ends at STEP_FAILURES_MAX in a row."""
    try:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(_ADVANCEABLE, pk=run_id).first()
            if run is None:
                return
            if run.attempts == 0:
                run.attempts = 1
                run.save(update_fields=["attempts", "updated_at"])
            _failures_end(run)
    except DatabaseError:
        logger.warning("run %s: its failed step could not be counted", run_id)


def _failures_end(run: Run) -> None:
    """End the locked run if STEP_FAILURES_MAX deliveries in a row failed."""
    if run.attempts >= STEP_FAILURES_MAX:
        logger.error("run %s ends: %s steps in a row failed", run.pk, run.attempts)
        _end(run, status=RunStatus.FAILED_FINAL, reason_code="STEP_FAILED")


def _lease_through(run_id: str, seconds: float) -> None:
    """Hold the run's lease through a wait before its task comes back, and a lease after it:
    the sweep sends a run whose lease lapsed again, which would ask the model before the wait
    a provider asked for is over, or add a copy of a task that waits for its tenant's turn
    at every sweep. Written when the lease would lapse within the wait and half a lease (a
    run waiting its turn writes it about once a lease); a run another worker holds keeps the
    lease that worker set."""
    lease = settings.RUN_LEASE_SECONDS
    until = timezone.now() + timedelta(seconds=seconds + lease)
    with transaction.atomic():
        run = (
            Run.objects.select_for_update(skip_locked=True)
            .filter(pk=run_id, status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
            .filter(
                Q(lease_expires_at__isnull=True)
                | Q(lease_expires_at__lt=until - timedelta(seconds=lease / 2))
            )
            .first()
        )
        if run is not None:
            run.lease_expires_at = until
            run.save(update_fields=["lease_expires_at"])


def _advance(task, run_id: str) -> None:
    """Advance the run for at most RUN_TASK_SECONDS, then hand it to a new task (its last step
    renewed its lease, so the sweep sends no copy meanwhile): a run of many slow steps would
    otherwise meet the task's soft time limit mid-step, its step's work lost (a model turn
    paid for and asked again) and the run left for the sweep. Eager (the embedded default)
    runs it to its pause or end."""
    if not _delivery_count(run_id):
        return
    seconds = None if settings.CELERY_TASK_ALWAYS_EAGER else settings.RUN_TASK_SECONDS
    try:
        more = run_execute(run_id=run_id, seconds=seconds)
    except ModelTemporarilyUnavailable as error:
        # Not a failed step: the provider's, whose retries the task bounds (MODEL_RETRIES).
        Run.objects.filter(pk=run_id, attempts__gt=0).update(attempts=F("attempts") - 1)
        countdown = model_unavailable_wait(error, retries=task.request.retries)
        if countdown is None:
            return
        raise task.retry(countdown=countdown, exc=error) from error
    except Exception:
        _step_failed(run_id)
        raise
    if more:
        task_send(run_advance, run_id=run_id)


def model_unavailable_wait(error: ModelTemporarilyUnavailable, *, retries: int) -> float | None:
    """How long the task that met `error` after `retries` retries waits before it advances
    the run again, the run's lease held through the wait; None once it retried MODEL_RETRIES
    times: the run then ended FAILED_RETRYABLE (MODEL_UNAVAILABLE)."""
    if retries >= MODEL_RETRIES:
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=error.run_id)
            if run.status == RunStatus.RUNNING:
                _end(
                    run,
                    status=RunStatus.FAILED_RETRYABLE,
                    reason_code="MODEL_UNAVAILABLE",
                    output=model_error_output(error.error),
                )
        return None
    countdown = _model_wait(retries, error.error.retry_after)
    _lease_through(error.run_id, countdown)
    return countdown


@shared_task(acks_late=True)
def runs_sweep() -> int:
    """Re-enqueue active runs whose lease lapsed: their worker died or their task was lost.
    A run whose row is locked has a step in flight on a live worker (PostgreSQL ends a dead
    client's transaction and its locks), however long that step takes: it is skipped, not
    sent a duplicate that would only wait for the lock. A run resting at a host node (its
    action sending or settling) is its action's to advance (`approvals.tasks`), never a
    step's: it is not sent. Then the cancel requests no step took in are taken in
    (`cancel_requests_take_in`), and the runs waiting for people whose requester may no
    longer start runs, or whose agent an admin switched off, end
    (`waiting_runs_end_without_standing`). Returns how many runs were sent
    again; a run sent holds a new lease (`_sweep_leases_renew`), one the broker did not take
    stays stale, for the next sweep."""
    now = timezone.now()
    with transaction.atomic():
        stale = (
            Run.objects.select_for_update(skip_locked=True)
            .filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
            .filter(
                Q(lease_expires_at__lt=now)
                | Q(
                    lease_expires_at__isnull=True,
                    created_at__lt=now - timedelta(seconds=settings.RUN_LEASE_SECONDS),
                )
            )
            # (with the key: a node of NULL, in SQL, would exclude every run without one)
            .exclude(state__has_key="node", state__node__in=HOST_NODES)
        )
        run_ids = [str(run_id) for run_id in stale.values_list("pk", flat=True)[:500]]
    sent = [run_id for run_id in run_ids if task_send(run_advance, run_id=run_id)]
    _sweep_leases_renew(sent)
    cancel_requests_take_in()
    waiting_runs_end_without_standing()
    return len(sent)


def _sweep_leases_renew(run_ids: list[str]) -> None:
    """Renew the lease of the runs the sweep sent again: a queue backed up longer than a lease
    would otherwise get another copy of each one's task at every sweep. Once the new lease
    lapses too (the task was lost again, or its worker died), the sweep sends it again. A run
    another worker holds, or whose step renewed its lease past this one, keeps its lease."""
    until = timezone.now() + timedelta(seconds=settings.RUN_LEASE_SECONDS)
    with transaction.atomic():
        renewed = (
            Run.objects.select_for_update(skip_locked=True)
            .filter(pk__in=run_ids, status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
            .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=until))
            .values_list("pk", flat=True)
        )
        Run.objects.filter(pk__in=list(renewed)).update(lease_expires_at=until)


@shared_task
def memories_expire() -> int:
    """Remove memory items past their TTL."""
    return memory.memories_expire()


@shared_task(acks_late=True)
def attachment_orphans_remove() -> int:
    """Remove the stored attachment files no row names, once past their grace period. Safe to
    deliver twice: a file already removed is not counted again."""
    return attachments.attachment_orphans_remove()


@before_task_publish.connect(sender=FIRE_TASK)
def _fire_sent_at(*, body, **kwargs) -> None:
    """Stamp a firing with the moment it is sent (in the beat): its slot is the one it was
    sent in, however late a backlog or a redelivery brings it to a worker."""
    _args, task_kwargs, _embed = body
    task_kwargs.setdefault("sent_at", timezone.now().isoformat())


def _moment(value: str | None) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value) if value else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        if value:
            logger.warning("scheduled_task_fire: sent_at %r is not a time; firing for now", value)
        return None
    return moment


@shared_task(acks_late=True, reject_on_worker_lost=True)
def scheduled_task_fire(*, task_id: str, sent_at: str | None = None) -> str | None:
    """Fire a scheduled task for the slot it was sent in (the beat sends this; `sent_at`, set
    as it is published). Safe to deliver twice, late, and to send from two beats: the slot's
    occurrence is created once. Returns the occurrence's id when this delivery created it."""
    # The scheduler starts runs through the ingress, which enqueues run_advance from here.
    from runs.services.scheduler import scheduled_task_fire as fire

    occurrence = fire(task_id=task_id, sent_at=_moment(sent_at))
    return str(occurrence.pk) if occurrence else None


@shared_task(acks_late=True)
def scheduled_tasks_sweep() -> dict[str, int]:
    """End occurrences past their deadline, restart starts a dead worker left, and send owner
    notifications still owed."""
    from runs.services.scheduler import occurrences_sweep

    return occurrences_sweep()
