"""End to end through a real Celery worker process: the API accepts the running example, the
worker advances it to WAITING_APPROVAL; a second delivery of the same task changes nothing."""

import pytest
from django.db import connection

from runs.choices import RunStatus
from runs.models import Run, RunEvent, ToolCall
from runs.tasks import run_advance
from runs.tools import threads
from tests.celery_worker import (
    EXAMPLE_EVENTS,
    alice_client,
    event_seqs,
    event_types,
    example_post,
    example_seed,
    gated_example_publish,
    queue_purge,
    run_status,
    wait_until,
)
from tests.reliability.gated_tool import GATE_ENV, calls_file

pytestmark = pytest.mark.django_db(transaction=True)

FINISH_SECONDS = 30


def test_the_running_example_reaches_waiting_approval_through_the_worker(start_worker):
    example_seed()
    client = alice_client()
    worker = start_worker(pool="prefork", concurrency=2)

    response = example_post(client, key="e2e-running-example")
    retried = example_post(client, key="e2e-running-example")

    assert response.status_code == 202, response.content
    assert retried.status_code == 200
    run_id = response.json()["run_id"]
    assert retried.json()["run_id"] == run_id
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=FINISH_SECONDS,
        what="the run to wait for approval",
        worker=worker,
    )
    run = Run.objects.get(pk=run_id)
    assert event_types(run_id) == EXAMPLE_EVENTS
    assert event_seqs(run_id) == list(range(1, len(EXAMPLE_EVENTS) + 1))
    assert run.last_event_seq == len(EXAMPLE_EVENTS)
    assert sorted(ToolCall.objects.filter(run=run).values_list("call_id", "name", "status")) == [
        ("host-recipient", "directory_lookup", ToolCall.Status.COMPLETED),
        ("offline-1", "project_search", ToolCall.Status.COMPLETED),
    ]
    assert run.state["node"] == "approval"
    assert run.state["recipient"]["corporate_email"] == "li.wei@acme.example"
    assert run.result["status"] == RunStatus.WAITING_APPROVAL
    assert run.result["output"]["subject"].startswith("Weekly status: Project Apollo")
    assert run.lease_expires_at is not None
    assert Run.objects.count() == 1
    wait_until(lambda: worker.tasks_succeeded() == 1, seconds=10, what="the task's success")


def _waiting_on_a_row_lock() -> int:
    """Backends of this test database blocked on a lock (the second delivery, here)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def test_a_second_delivery_of_run_advance_repeats_no_tool_call(start_worker, tmp_path):
    """Two deliveries of the same run_advance on two worker processes at once: the second
    waits for the run's row lock while the first is inside a tool call, then finds each step
    done. One set of tool calls, one approval request, one gap-free event log."""
    example_seed()
    gated_example_publish()
    client = alice_client()
    gate = tmp_path / "gate"
    gate.touch()
    worker = start_worker(pool="prefork", concurrency=2, environment={GATE_ENV: str(gate)})

    run_id = example_post(client).json()["run_id"]
    wait_until(
        lambda: calls_file(gate).exists(),
        seconds=FINISH_SECONDS,
        what="the project_search call to be in flight",
        worker=worker,
    )
    run_advance.delay(run_id=run_id)
    wait_until(
        lambda: _waiting_on_a_row_lock() == 1,
        seconds=FINISH_SECONDS,
        what="the second delivery to wait for the run's lock",
        worker=worker,
    )
    assert run_status(run_id) == RunStatus.RUNNING
    gate.unlink()
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL and worker.tasks_succeeded() == 2,
        seconds=FINISH_SECONDS,
        what="both deliveries to finish",
        worker=worker,
    )
    run_advance.delay(run_id=run_id)
    wait_until(
        lambda: worker.tasks_succeeded() == 3,
        seconds=FINISH_SECONDS,
        what="a late third delivery to finish",
        worker=worker,
    )

    assert event_types(run_id) == EXAMPLE_EVENTS
    assert event_seqs(run_id) == list(range(1, len(EXAMPLE_EVENTS) + 1))
    assert RunEvent.objects.filter(run_id=run_id, type="approval.required").count() == 1
    assert sorted(ToolCall.objects.filter(run_id=run_id).values_list("call_id", "status")) == [
        ("host-recipient", ToolCall.Status.COMPLETED),
        ("offline-1", ToolCall.Status.COMPLETED),
    ]
    assert len(calls_file(gate).read_text().splitlines()) == 1
    assert run_status(run_id) == RunStatus.WAITING_APPROVAL


def _other_backends() -> set[int]:
    """Backends connected to this test database, other than the test's own."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        return {pid for (pid,) in cursor.fetchall()}


def test_a_worker_keeps_its_database_connection_from_one_task_to_the_next(start_worker):
    # this process's own tool threads, kept from earlier tests, hold connections of their own,
    # and earlier tests may have left tasks on the queue
    threads.stop()
    queue_purge()
    example_seed()
    client = alice_client()
    worker = start_worker()

    def waits_for_approval(response) -> None:
        assert response.status_code == 202, response.content
        run_id = response.json()["run_id"]
        wait_until(
            lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
            seconds=FINISH_SECONDS,
            what="the run to wait for approval",
            worker=worker,
        )

    waits_for_approval(example_post(client))
    after_first = _other_backends()
    for _ in range(3):
        waits_for_approval(example_post(client))

    # the task's connection, and its tool handler thread's (`runs.tools.threads`)
    assert len(after_first) == 2
    assert _other_backends() == after_first
    wait_until(lambda: worker.tasks_succeeded() == 4, seconds=10, what="the tasks' success")
