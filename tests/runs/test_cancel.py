"""A cancel never waits for a step: while a step holds the run (a model call may take long),
the request is kept beside the run and the call returns; the step's boundary ends the run,
or the sweep does for a run that paused meanwhile."""

import threading
import time
from contextlib import nullcontext

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from approvals.models import BusinessAction
from registry.demo import DEMO_PASSWORD
from registry.services.tenancy import api_token_issue
from runs.errors import InvalidRunTransition
from runs.loop import run_advance_step, run_execute
from runs.models import CancelRequest, Run
from runs.services.runs import run_cancel
from runs.tasks import runs_sweep
from tests.runs.conftest import demo_run, event_types, events_of, step_in_thread

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_cancel_during_a_model_call_returns_before_it_and_the_step_boundary_ends_the_run(
    demo, held_planner
):
    # given a run whose first step's model call waits until it is let go
    run = demo_run(demo, project_id="apollo")
    stepping = step_in_thread(run)
    assert held_planner.asked.wait(timeout=20)

    # when alice cancels it while the model is being asked
    cancelled = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
    held_planner.let_go.set()
    stepping.join(timeout=30)

    # then the cancel returned before the step let go of the run: it says it was asked for
    assert held_planner.in_time == [True], "the cancel waited for the step"
    assert cancelled.status == "QUEUED"
    assert cancelled.cancel_requested_at is not None
    # the step ended as it would have; the next boundary ends the run, asking no model again
    assert run_advance_step(run_id=str(run.pk)) is False
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert run.cancel_requested_at is not None
    assert len(held_planner.requests) == 1
    assert event_types(run)[-2:] == ["model.responded", "run.finished"]
    assert not CancelRequest.objects.filter(run=run).exists()


def test_a_cancel_kept_beside_a_run_that_paused_for_approval_is_taken_in_by_the_sweep(demo):
    # given the running example waiting for approval, and a cancel kept beside it while its
    # last step held it
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    CancelRequest.objects.create(run=run, reason="CANCELLED_BY_USER")

    asked_at = CancelRequest.objects.get(run=run).requested_at

    # when the sweep runs
    runs_sweep()

    # then the run ends cancelled, as of when it was asked, and its action leaves the queue
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert run.cancel_requested_at == asked_at
    action = BusinessAction.objects.get(run=run)
    assert action.status == "invalidated"
    assert events_of(run, "approval.invalidated") == [
        {"action_id": str(action.pk), "reasons": ["CANCELLED_BY_USER"]}
    ]
    assert not CancelRequest.objects.exists()


def test_a_cancel_kept_beside_a_run_that_finished_meanwhile_changes_nothing(demo):
    # given a run cancelled while a second request waited beside it
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
    CancelRequest.objects.create(run=run, reason="CANCELLED_BY_USER")
    events = event_types(run)

    # when the sweep runs
    runs_sweep()

    # then the request is gone and the run is as it was
    assert not CancelRequest.objects.exists()
    assert event_types(run) == events


class Holder:
    """Another transaction holding a run's row (FOR UPDATE, as an approval decision does, or
    FOR NO KEY UPDATE, as a step does) until it is let go."""

    def __init__(self, run: Run, *, no_key: bool = False) -> None:
        self.held, self.let_go = threading.Event(), threading.Event()
        self.backend_pid: int | None = None
        self.waited = False
        self._watcher: threading.Thread | None = None
        self._thread = threading.Thread(target=self._hold, args=(run, no_key))

    def _hold(self, run: Run, no_key: bool) -> None:
        try:
            with transaction.atomic():
                Run.objects.select_for_update(no_key=no_key).get(pk=run.pk)
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    (self.backend_pid,) = cursor.fetchone()
                self.held.set()
                self.let_go.wait(timeout=20)
        finally:
            connection.close()

    def __enter__(self) -> "Holder":
        self._thread.start()
        assert self.held.wait(timeout=20)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.let_go.set()
        self._thread.join(timeout=30)
        if self._watcher is not None:
            self._watcher.join(timeout=30)

    def let_go_once_waited_for(self) -> None:
        """Let go, from a thread of its own, as soon as another transaction waits for this one
        (`waited` then says so), or after about 10 s."""

        def watch() -> None:
            try:
                with connection.cursor() as cursor:
                    for _ in range(2000):
                        cursor.execute(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE %s = ANY(pg_blocking_pids(pid))",
                            [self.backend_pid],
                        )
                        if cursor.fetchone()[0]:
                            self.waited = True
                            break
                        time.sleep(0.005)
            finally:
                self.let_go.set()
                connection.close()

        self._watcher = threading.Thread(target=watch)
        self._watcher.start()


def _lock_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return cursor.fetchone()[0]


def _set_lock_timeout(value: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [value])


def test_a_cancel_waits_for_a_short_writer_and_ends_the_waiting_run_at_once(demo, settings):
    # given the running example waiting for approval, and another transaction (an approval
    # being decided, say) holding its row when alice cancels, letting go once she waits
    settings.RUN_CANCEL_LOCK_WAIT_MS = 10_000
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))

    with Holder(run) as holder:
        holder.let_go_once_waited_for()

        # when alice cancels, in a transaction with a lock timeout of its own
        with transaction.atomic():
            _set_lock_timeout("7s")
            cancelled = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
            lock_timeout = _lock_timeout()

    # then the cancel waited for the writer rather than leaving a request for the sweep
    assert holder.waited, "the cancel never waited for the writer"
    assert (cancelled.status, cancelled.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert BusinessAction.objects.get(run=run).status == "invalidated"
    assert not CancelRequest.objects.exists()
    # and only that lock was bounded: the transaction's own timeout is back
    assert lock_timeout == "7s"


@pytest.mark.parametrize("wait_ms", [50, 0])
def test_a_cancel_gives_up_after_the_lock_wait_and_keeps_the_request_beside_the_run(
    demo, settings, wait_ms
):
    # given a run between its steps that another transaction holds, as a step does, for
    # longer than the wait (0: no wait at all)
    settings.RUN_CANCEL_LOCK_WAIT_MS = wait_ms
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk)) is True

    # when alice cancels, in a transaction with a lock timeout of its own
    with Holder(run, no_key=True), transaction.atomic():
        _set_lock_timeout("7s")
        cancelled = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
        lock_timeout = _lock_timeout()

    # then the request waits beside the run, and the transaction's own timeout is kept
    assert cancelled.status == "RUNNING"
    assert cancelled.cancel_requested_at is not None
    assert CancelRequest.objects.filter(run=run).exists()
    assert lock_timeout == "7s"


def test_cancelling_a_finished_run_whose_row_is_held_is_refused_as_when_it_is_free(demo, settings):
    # given a refused run (a project alice may not see)
    settings.RUN_CANCEL_LOCK_WAIT_MS = 0
    run = demo_run(demo, project_id="nope-project")
    run_execute(run_id=str(run.pk))
    run = Run.objects.get(pk=run.pk)
    assert run.status == "REFUSED"

    # when it is cancelled while another transaction holds its row, and when none does
    holder = Holder(run, no_key=True)
    with holder, pytest.raises(InvalidRunTransition):
        run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
    with pytest.raises(InvalidRunTransition):
        run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)

    # then no cancel request is left beside it
    assert not CancelRequest.objects.filter(run=run).exists()


def _cancelled_event(username: str | None) -> list[dict]:
    return [{"status": "CANCELLED", "reason_code": "CANCELLED_BY_USER", "cancelled_by": username}]


def test_a_cancel_that_takes_the_run_at_once_records_who_asked(demo):
    # given alice's run waiting for approval
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))

    # when the platform admin cancels it, its row free
    cancelled = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.admin)

    # then the run records the admin, not its requester, and its last event names them
    run.refresh_from_db()
    assert (run.status, run.cancelled_by) == ("CANCELLED", demo.admin)
    assert cancelled.cancelled_by == demo.admin
    assert events_of(run, "run.finished") == _cancelled_event("admin")


def test_a_cancel_kept_beside_a_running_run_records_who_asked_when_the_next_step_takes_it_in(
    demo, settings
):
    # given alice's run between its steps
    settings.RUN_CANCEL_LOCK_WAIT_MS = 0
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk)) is True

    # when the platform admin cancels it while a step holds it
    with Holder(run, no_key=True):
        cancelled = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.admin)

    # then the request kept beside it, and the answer, name the admin
    assert cancelled.cancelled_by == demo.admin
    assert CancelRequest.objects.get(run=run).requested_by == demo.admin
    # and the next step boundary carries it onto the run and into its last event
    assert run_advance_step(run_id=str(run.pk)) is False
    run.refresh_from_db()
    assert (run.status, run.cancelled_by) == ("CANCELLED", demo.admin)
    assert events_of(run, "run.finished") == _cancelled_event("admin")


def test_a_cancel_kept_beside_a_paused_run_records_who_asked_when_the_sweep_takes_it_in(
    demo, settings
):
    # given alice's run waiting for approval, cancelled by the platform admin while another
    # transaction held its row
    settings.RUN_CANCEL_LOCK_WAIT_MS = 0
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    with Holder(run) as holder:
        # the request kept beside the run commits once the holder lets go
        holder.let_go_once_waited_for()
        run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.admin)
    assert CancelRequest.objects.get(run=run).requested_by == demo.admin

    # when the sweep runs
    runs_sweep()

    # then the run ends cancelled by the admin, and its last event names them
    run.refresh_from_db()
    assert (run.status, run.cancelled_by) == ("CANCELLED", demo.admin)
    assert events_of(run, "run.finished") == _cancelled_event("admin")
    assert not CancelRequest.objects.exists()


@pytest.mark.parametrize("row_held", [True, False], ids=["row-held", "row-free"])
def test_a_second_cancel_by_someone_else_leaves_who_asked_first(demo, settings, row_held):
    # given alice's run between its steps, and her cancel kept beside it while a step held it
    settings.RUN_CANCEL_LOCK_WAIT_MS = 0
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk)) is True
    with Holder(run, no_key=True):
        run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
    asked_at = CancelRequest.objects.get(run=run).requested_at

    # when the platform admin cancels it too, while a step holds it again or once it is free
    with Holder(run, no_key=True) if row_held else nullcontext():
        again = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.admin)

    # then the answer, and the run once its next step ends it, name alice, as of when she asked
    assert again.cancelled_by == demo.alice
    assert run_advance_step(run_id=str(run.pk)) is False
    run.refresh_from_db()
    assert (run.status, run.cancelled_by, run.cancel_requested_at) == (
        "CANCELLED",
        demo.alice,
        asked_at,
    )
    assert events_of(run, "run.finished") == _cancelled_event("alice")


def test_a_cancel_kept_beside_the_run_shows_on_the_run_as_the_cancel_answered(demo, settings):
    # given alice's run between its steps, cancelled through the API while a step holds it
    settings.RUN_CANCEL_LOCK_WAIT_MS = 0
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk)) is True
    _, key = api_token_issue(username="alice", password=DEMO_PASSWORD, tenant_slug="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    with Holder(run, no_key=True):
        answer = client.post(f"/api/v1/runs/{run.pk}/cancel").json()
    assert CancelRequest.objects.filter(run=run).exists()

    # when she reads the run, alone and in the list, before a step takes the request in
    shown = client.get(f"/api/v1/runs/{run.pk}").json()
    listed = next(
        body for body in client.get("/api/v1/runs").json()["results"] if body["id"] == str(run.pk)
    )

    # then both say what the cancel answered: who asked, and when
    assert (answer["status"], answer["cancelled_by"]) == ("RUNNING", "alice")
    assert answer["cancel_requested_at"] is not None
    for body in (shown, listed):
        assert (body["status"], body["cancel_requested_at"], body["cancelled_by"]) == (
            "RUNNING",
            answer["cancel_requested_at"],
            "alice",
        )
