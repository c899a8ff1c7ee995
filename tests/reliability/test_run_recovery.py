"""Crash recovery with a real worker: a SIGKILLed worker's run keeps its lease, the broker does
not give the task back (its visibility timeout is far away), the sweeper re-enqueues the run
once the lease lapses and a new worker finishes it from its checkpoint."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from config.celery import app
from registry.models import Tenant
from runs.choices import TERMINAL_STATUSES, RunStatus
from runs.loop import run_advance_step, run_execute
from runs.models import Run, RunEvent, Source, ToolCall
from runs.services.ingress import message_ingest
from runs.services.runs import run_cancel
from runs.tasks import STEP_FAILURES_MAX, runs_sweep
from tests.celery_worker import (
    EXAMPLE_EVENTS,
    EXAMPLE_MESSAGE,
    alice_client,
    event_seqs,
    event_types,
    example_post,
    example_search_publish,
    example_seed,
    gated_example_publish,
    queue_purge,
    queued_run_ids,
    run_status,
    wait_until,
)
from tests.reliability.gated_tool import GATE_ENV, calls_file

pytestmark = pytest.mark.django_db(transaction=True)

LEASE_SECONDS = 3
WAIT_SECONDS = 30
KILLING_HANDLER = "tests.reliability.gated_tool.killing_project_search"


def _row_unlocked(run_id: str) -> bool:
    """Whether the run's row lock is free (PostgreSQL ends a dead client's transaction)."""
    with transaction.atomic():
        return Run.objects.select_for_update(skip_locked=True).filter(pk=run_id).exists()


def test_a_sigkilled_worker_s_run_is_swept_and_finished_by_another_worker(
    start_worker, tmp_path, settings
):
    settings.RUN_LEASE_SECONDS = LEASE_SECONDS
    example_seed()
    gated_example_publish()
    gate = tmp_path / "gate"
    gate.touch()
    environment = {GATE_ENV: str(gate), "RUN_LEASE_SECONDS": str(LEASE_SECONDS)}
    first = start_worker(pool="solo", environment=environment)
    run_id = example_post(alice_client()).json()["run_id"]
    wait_until(
        lambda: calls_file(gate).exists(),
        seconds=WAIT_SECONDS,
        what="project_search to be in flight",
        worker=first,
    )

    first.kill()

    wait_until(lambda: _row_unlocked(run_id), seconds=10, what="the dead worker's lock to go")
    crashed = Run.objects.get(pk=run_id)
    assert crashed.status == RunStatus.RUNNING
    assert crashed.lease_expires_at is not None
    assert crashed.state["phase"] == "tools"
    # The step in flight committed nothing: the model's call is checkpointed, its result not.
    assert event_types(run_id) == EXAMPLE_EVENTS[:13]
    assert list(ToolCall.objects.filter(run_id=run_id).values_list("call_id", flat=True)) == [
        "host-recipient"
    ]

    gate.unlink()
    second = start_worker(pool="solo", environment=environment)
    wait_until(
        lambda: timezone.now() > Run.objects.get(pk=run_id).lease_expires_at,
        seconds=LEASE_SECONDS + 5,
        what="the lease to lapse",
    )
    # The broker keeps the lost delivery unacknowledged until its visibility timeout: the new
    # worker received nothing, and the run did not move.
    assert second.tasks_received() == 0
    assert event_types(run_id) == EXAMPLE_EVENTS[:13]

    assert runs_sweep() == 1

    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=WAIT_SECONDS,
        what="the swept run to wait for approval",
        worker=second,
    )
    # the worker logs the task's success just after its last commit
    wait_until(lambda: second.tasks_succeeded() == 1, seconds=10, what="the task's success")
    # The read tool ran again (once per worker); its call, result and evidence exist once.
    assert len(calls_file(gate).read_text().splitlines()) == 2
    assert event_types(run_id) == EXAMPLE_EVENTS
    assert event_seqs(run_id) == list(range(1, len(EXAMPLE_EVENTS) + 1))
    assert sorted(ToolCall.objects.filter(run_id=run_id).values_list("call_id", "status")) == [
        ("host-recipient", ToolCall.Status.COMPLETED),
        ("offline-1", ToolCall.Status.COMPLETED),
    ]
    references = list(Source.objects.filter(run_id=run_id).values_list("reference", flat=True))
    assert len(references) == len(set(references))
    run = Run.objects.get(pk=run_id)
    assert run.tool_call_count == 2
    assert run.result["status"] == RunStatus.WAITING_APPROVAL
    assert runs_sweep() == 0


def test_the_sweeper_leaves_a_run_whose_step_is_still_in_flight(start_worker, tmp_path, settings):
    """A step longer than the lease (a slow tool) is not a dead worker: its run's row is still
    locked, so the sweeper does not send a duplicate that would only wait for that lock."""
    settings.RUN_LEASE_SECONDS = 1
    example_seed()
    gated_example_publish()
    gate = tmp_path / "gate"
    gate.touch()
    worker = start_worker(pool="solo", environment={GATE_ENV: str(gate), "RUN_LEASE_SECONDS": "1"})
    run_id = example_post(alice_client()).json()["run_id"]
    wait_until(
        lambda: calls_file(gate).exists(),
        seconds=WAIT_SECONDS,
        what="project_search to be in flight",
        worker=worker,
    )
    wait_until(
        lambda: timezone.now() > Run.objects.get(pk=run_id).lease_expires_at,
        seconds=5,
        what="the lease to lapse",
    )

    assert runs_sweep() == 0

    assert queued_run_ids() == []
    gate.unlink()
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=WAIT_SECONDS,
        what="the run to wait for approval",
        worker=worker,
    )
    assert worker.tasks_received() == 1
    assert event_types(run_id) == EXAMPLE_EVENTS


def _start(alice, acme) -> Run:
    """A run of the running example, accepted by ingress (its first delivery is dropped)."""
    run = message_ingest(
        actor=alice,
        tenant=acme,
        idempotency_key=f"sweep-{Run.objects.count()}",
        channel="api",
        parts=EXAMPLE_MESSAGE["parts"],
        metadata=EXAMPLE_MESSAGE["metadata"],
    ).run
    return run


def _age(run: Run, **changes) -> None:
    """Move a run's clock fields into the past (test arrangement only)."""
    Run.objects.filter(pk=run.pk).update(**changes)


def test_the_sweeper_re_enqueues_exactly_the_stale_active_runs(start_worker, settings):
    settings.RUN_LEASE_SECONDS = 60
    example_seed()
    alice = get_user_model().objects.get(username="alice")
    acme = Tenant.objects.get(slug="acme")
    now = timezone.now()
    long_ago = now - timedelta(seconds=61)

    lapsed_running = _start(alice, acme)
    run_advance_step(run_id=str(lapsed_running.pk))
    _age(lapsed_running, lease_expires_at=now - timedelta(seconds=1))
    leased_running = _start(alice, acme)
    run_advance_step(run_id=str(leased_running.pk))
    old_queued = _start(alice, acme)
    _age(old_queued, created_at=long_ago)
    new_queued = _start(alice, acme)
    waiting = _start(alice, acme)
    run_execute(run_id=str(waiting.pk))
    _age(waiting, created_at=long_ago, lease_expires_at=long_ago)
    cancelled = _start(alice, acme)
    run_cancel(run=cancelled, actor=alice)
    _age(cancelled, created_at=long_ago)
    queue_purge()
    before = {run.pk: (run.status, run.last_event_seq) for run in Run.objects.all()}
    assert before[lapsed_running.pk][0] == before[leased_running.pk][0] == RunStatus.RUNNING
    assert before[old_queued.pk][0] == before[new_queued.pk][0] == RunStatus.QUEUED
    assert before[waiting.pk][0] == RunStatus.WAITING_APPROVAL
    assert before[cancelled.pk][0] == RunStatus.CANCELLED

    assert runs_sweep() == 2

    assert sorted(queued_run_ids()) == sorted([str(lapsed_running.pk), str(old_queued.pk)])
    worker = start_worker(pool="solo")
    for run in (lapsed_running, old_queued):
        wait_until(
            lambda run=run: run_status(run.pk) == RunStatus.WAITING_APPROVAL,
            seconds=WAIT_SECONDS,
            what="a swept run to wait for approval",
            worker=worker,
        )
    wait_until(lambda: worker.tasks_succeeded() == 2, seconds=10, what="both tasks", worker=worker)
    after = {run.pk: (run.status, run.last_event_seq) for run in Run.objects.all()}
    for untouched in (leased_running, new_queued, waiting, cancelled):
        assert after[untouched.pk] == before[untouched.pk]
    assert queued_run_ids() == []
    assert worker.tasks_received() == 2
    assert RunEvent.objects.filter(run=old_queued, type="approval.required").count() == 1


def test_beat_installs_the_sweeper_in_the_database_schedule(settings):
    DatabaseScheduler(app=app)

    task = PeriodicTask.objects.get(name="runs-sweep")
    assert task.task == "runs.tasks.runs_sweep"
    assert task.enabled
    assert (task.interval.every, task.interval.period) == (30, IntervalSchedule.SECONDS)
    assert settings.CELERY_BEAT_SCHEDULER == "django_celery_beat.schedulers:DatabaseScheduler"
    assert "runs.tasks.runs_sweep" in app.tasks


def test_a_run_whose_step_kills_its_worker_each_time_ends_instead_of_being_redelivered_forever(
    start_worker, tmp_path
):
    """A pool process killed mid-step (the out-of-memory killer) has its task given back to
    the queue at once (`reject_on_worker_lost`): a delivery that dies so is counted like a
    step that raises, and the run ends once its tool's step died STEP_FAILURES_MAX times in a
    row, rather than calling its tool again and again."""
    example_seed()
    # (slots enough for the calls whose process died holding one, and no retry within a step)
    example_search_publish(
        adapter_config={"handler": KILLING_HANDLER}, concurrency_cap=256, retry_policy={}
    )
    gate = tmp_path / "gate"
    gate.touch()
    worker = start_worker(pool="prefork", concurrency=1, environment={GATE_ENV: str(gate)})
    run_id = example_post(alice_client()).json()["run_id"]

    def calls() -> int:
        return len(calls_file(gate).read_text().splitlines()) if calls_file(gate).exists() else 0

    wait_until(
        lambda: run_status(run_id) in TERMINAL_STATUSES or calls() > 2 * STEP_FAILURES_MAX,
        seconds=2 * WAIT_SECONDS,
        what="the run to end or its tool to be called again and again",
        worker=worker,
    )

    run = Run.objects.get(pk=run_id)
    assert (run.status, run.reason_code) == (RunStatus.FAILED_FINAL, "STEP_FAILED")
    # the tool ran STEP_FAILURES_MAX times: the first delivery saved the steps before the
    # tool's, which counts no failure, then died in the tool's like the others
    assert calls() == STEP_FAILURES_MAX
    assert event_types(run_id) == [*EXAMPLE_EVENTS[:13], "run.finished"]
    assert event_seqs(run_id) == list(range(1, 15))
