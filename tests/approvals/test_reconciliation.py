"""The schedule of an unknown action's reconciliation, kept on the action: the attempts made,
when the next is due, the sweep that sends an attempt whose message was lost, and the number
that makes a second delivery of an attempt do nothing."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError
from django.utils import timezone

from approvals import services, tasks
from approvals.choices import ActionStatus
from approvals.models import BusinessAction
from registry.models import ToolVersion
from registry.selectors import versions_frozen
from runs.models import Run
from tests.approvals.conftest import accepted, approved_run, left_unknown
from tests.celery_worker import queue_purge, queued_tasks

RECONCILE = "approvals.tasks.action_reconcile"
RESUME = "approvals.tasks.action_resume"


def overdue(action: BusinessAction) -> None:
    """Its next attempt was due longer ago than a late message would take."""
    BusinessAction.objects.filter(pk=action.pk).update(
        reconcile_due_at=timezone.now() - services.RECONCILE_LOST_AFTER - timedelta(seconds=1)
    )


def schedule(action: BusinessAction) -> tuple[int, object]:
    action.refresh_from_db()
    return action.reconcile_attempts, action.reconcile_due_at


def deliver(action: BusinessAction, attempt: int) -> str:
    """One delivery of the task that makes reconciliation `attempt`, as a worker runs it."""
    kwargs = {"action_id": str(action.pk), "attempt": attempt}
    return tasks.action_reconcile.apply(kwargs=kwargs).get()


def test_an_unknown_action_whose_reconciliation_was_never_sent_is_reconciled_by_the_sweep(
    demo, bob, smtp_server, broker, caplog, django_capture_on_commit_callbacks
):
    # given a send whose outcome became unknown while the broker could not be reached
    queue_purge()
    broker.down()
    with django_capture_on_commit_callbacks(execute=True):
        run, action = left_unknown(demo, bob, smtp_server)

    # then its first reconciliation was not sent, and the action keeps it due
    assert f"{RECONCILE}{{'action_id': '{action.pk}', 'attempt': 1}} not sent" in caplog.text
    attempts, due = schedule(action)
    assert attempts == 0
    assert timedelta(0) < due - timezone.now() <= timedelta(seconds=services.RECONCILE_AFTER)

    # and once it is overdue, a sweep with the broker still down sends nothing and keeps it
    overdue(action)
    kept = schedule(action)
    assert services.actions_reconcile_overdue() == 0
    assert schedule(action) == kept

    # when the broker is back, the sweep sends the first attempt
    broker.up()
    assert tasks.actions_sweep() == {"expired": 0, "invalidated": 0, "resumed": 0, "reconciled": 1}
    assert queued_tasks() == [(RECONCILE, {"action_id": str(action.pk), "attempt": 1})]
    queue_purge()

    # and its delivery settles the action by its key, without sending again
    smtp_server.stall = 0
    assert deliver(action, 1) == ActionStatus.SUCCEEDED
    assert len(smtp_server.messages) == 1
    assert schedule(action) == (1, None)
    assert Run.objects.get(pk=run.pk).reason_code == "SENT"


def test_a_sweep_with_the_broker_down_keeps_a_stalled_approval_for_the_next_one(
    demo, bob, broker, caplog
):
    # given an approved action whose resume was lost
    queue_purge()
    _run, action = approved_run(demo, bob)
    BusinessAction.objects.filter(pk=action.pk).update(
        updated_at=timezone.now() - services.STALLED_AFTER - timedelta(seconds=1)
    )

    # when the sweep runs while the broker cannot be reached, it ends and sends nothing
    broker.down()
    assert tasks.actions_sweep() == {"expired": 0, "invalidated": 0, "resumed": 0, "reconciled": 0}
    assert f"{RESUME}{{'action_id': '{action.pk}'}} not sent" in caplog.text
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.APPROVED

    # and once the broker is back, the next sweep sends its resume
    broker.up()
    assert tasks.actions_sweep() == {"expired": 0, "invalidated": 0, "resumed": 1, "reconciled": 0}
    assert queued_tasks() == [(RESUME, {"action_id": str(action.pk)})]
    queue_purge()


def test_an_unknown_action_whose_next_attempt_is_not_overdue_is_not_sent_again(
    demo, bob, smtp_server
):
    # given an action left unknown, its first reconciliation on its way
    queue_purge()
    _, action = left_unknown(demo, bob, smtp_server)

    # then the sweep sends it nothing while that attempt is not due
    assert services.actions_reconcile_overdue() == 0
    # nor while it is late by less than a late message may be
    BusinessAction.objects.filter(pk=action.pk).update(
        reconcile_due_at=timezone.now() - services.RECONCILE_LOST_AFTER + timedelta(seconds=10)
    )
    assert services.actions_reconcile_overdue() == 0
    assert queued_tasks() == []


def test_a_second_delivery_of_an_attempt_already_made_does_nothing(
    demo, bob, smtp_server, settings
):
    # given an action left unknown, with a mail system that cannot be asked about it
    settings.MAIL_DELIVERY_LOOKUP = ""
    _, action = left_unknown(demo, bob, smtp_server)

    # when its first attempt is delivered, then delivered again (the sweep took it for lost)
    assert deliver(action, 1) == ActionStatus.UNKNOWN
    made = schedule(action)
    assert deliver(action, 1) == ActionStatus.UNKNOWN

    # then the second changes nothing: one attempt, the next due when the first said
    assert made[0] == 1
    assert schedule(action) == made


def test_an_unknown_action_is_reconciled_with_backoff_then_left_to_a_person(
    demo, bob, smtp_server, settings, django_capture_on_commit_callbacks, caplog
):
    # given an action left unknown, with a mail system that cannot be asked about it
    settings.MAIL_DELIVERY_LOOKUP = ""
    queue_purge()
    run, action = left_unknown(demo, bob, smtp_server)

    # when each attempt is made as its task is delivered
    waits, sent = [], []
    for attempt in range(1, services.RECONCILE_ATTEMPTS + 1):
        made_at = timezone.now()
        with django_capture_on_commit_callbacks(execute=True):
            assert deliver(action, attempt) == ActionStatus.UNKNOWN
        attempts, due = schedule(action)
        assert attempts == attempt
        if due is not None:
            waits.append(round((due - made_at).total_seconds()))
        sent.append(queued_tasks())
        queue_purge()

    # then each one still unknown sent the next, with backoff, and the last sent none
    assert waits == [30, 60, 120, 240, 480, 960, 1920, 3600]
    assert sent == [
        [(RECONCILE, {"action_id": str(action.pk), "attempt": attempt + 1})]
        for attempt in range(1, services.RECONCILE_ATTEMPTS)
    ] + [[]]
    assert schedule(action) == (services.RECONCILE_ATTEMPTS, None)
    # and the log says a person must settle it, once
    left = [record for record in caplog.records if "a person must settle it" in record.message]
    assert [(record.levelname, str(action.pk) in record.message) for record in left] == [
        ("WARNING", True)
    ]

    # and the sweep sends nothing, even for a due time left over from before
    assert services.actions_reconcile_overdue() == 0
    overdue(action)
    assert services.actions_reconcile_overdue() == 0
    assert queued_tasks() == []

    # and the action stays unknown for a person, as its run says, with nothing sent again
    run = Run.objects.get(pk=run.pk)
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    assert (run.status, run.result["next_step"]) == ("RUNNING", services.SETTLING)
    assert len(smtp_server.messages) == 1


def test_a_reconciliation_the_database_failed_keeps_its_schedule_and_is_sent_again(
    demo, bob, smtp_server, monkeypatch
):
    # given an action left unknown by a send that timed out after the server accepted it
    queue_purge()
    run, action = left_unknown(demo, bob, smtp_server)
    smtp_server.stall = 0
    kept = schedule(action)
    # and a database connection that drops as its first reconciliation locks the run
    locked = services._locked

    def dropped(action_id):
        monkeypatch.setattr(services, "_locked", locked)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "_locked", dropped)

    # when that attempt fails, then it is not counted and stays due
    with pytest.raises(OperationalError):
        deliver(action, 1)
    assert schedule(action) == kept
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN

    # and once it is overdue the sweep sends it again, which settles the action once
    overdue(action)
    assert services.actions_reconcile_overdue() == 1
    assert queued_tasks() == [(RECONCILE, {"action_id": str(action.pk), "attempt": 1})]
    queue_purge()
    assert deliver(action, 1) == ActionStatus.SUCCEEDED
    assert len(smtp_server.messages) == 1
    assert Run.objects.get(pk=run.pk).reason_code == "SENT"


LOOKUPS: list[str] = []


def counted_lookup(message_id: str) -> bool:
    """The test mail server's answer (`accepted`), counting the questions."""
    LOOKUPS.append(message_id)
    return accepted(message_id)


@pytest.mark.django_db(transaction=True)
def test_two_deliveries_of_one_attempt_make_one_call(demo, bob, smtp_server, settings):
    # given a send the mail server dropped before accepting it: unknown, and never delivered
    queue_purge()
    settings.MAIL_DELIVERY_LOOKUP = f"{__name__}.counted_lookup"
    _, action = approved_run(demo, bob)
    smtp_server.drop = "before_accept"
    services.action_execute(action_id=action.pk)
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    assert smtp_server.messages == []
    smtp_server.drop = ""
    smtp_server.stall = 1.0  # below EMAIL_TIMEOUT: the send reconciliation makes is late
    LOOKUPS.clear()

    # when its first attempt finds nothing under the key and sends
    first = smtp_server.sending(lambda: deliver(action, 1))
    # and a second delivery of that attempt arrives during the send
    second = deliver(action, 1)
    first.join(10)

    # then the second asked the mail system nothing and sent nothing: one mail, once settled
    assert second == ActionStatus.EXECUTING
    assert len(LOOKUPS) == 1
    assert len(smtp_server.messages) == 1
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.SUCCEEDED
    assert schedule(action) == (1, None)
    queue_purge()


LOOKUP_RELEASED = threading.Event()


def hanging_lookup(message_id: str) -> None:
    """A mail system that does not answer whether it accepted the message."""
    LOOKUP_RELEASED.wait(30)


def test_a_reconciliation_whose_lookup_hangs_ends_within_its_task_s_time(
    demo, bob, smtp_server, settings, monkeypatch
):
    # given an unknown action whose reconciliation has 2 s before its task's soft time
    # limit, by a mail_send whose timeout is 5 s and a mail system that does not answer
    queue_purge()
    _, action = left_unknown(demo, bob, smtp_server)
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    [mail_send] = versions_frozen(model=ToolVersion, ids=[action.tool_version_id]).values()
    monkeypatch.setattr(mail_send, "timeout_s", 5)
    settings.MAIL_DELIVERY_LOOKUP = f"{__name__}.hanging_lookup"
    LOOKUP_RELEASED.clear()

    # when its first attempt is made
    started = time.monotonic()
    try:
        status = deliver(action, 1)
        elapsed = time.monotonic() - started
    finally:
        LOOKUP_RELEASED.set()

    # then the lookup was abandoned within the task's 2 s, not the tool's 5 s, so Celery's
    # soft time limit does not interrupt it: the outcome stays unknown, the attempt is
    # counted and the next one is due, and nothing was sent again
    assert elapsed < 4
    assert status == ActionStatus.UNKNOWN
    attempts, due = schedule(action)
    assert attempts == 1 and due is not None
    assert len(smtp_server.messages) == 1
    queue_purge()


def slow_lookup(message_id: str) -> bool:
    """The test mail server's answer (`accepted`), given after 2 s."""
    time.sleep(2)
    return accepted(message_id)


@pytest.mark.django_db(transaction=True)
def test_a_send_a_reconciliation_makes_ends_within_the_time_its_lookup_left(
    demo, bob, smtp_server, settings, monkeypatch
):
    # given a send the mail server dropped before accepting it (unknown, never delivered),
    # reconciled with 3 s before its task's soft time limit, by a mail_send whose timeout is
    # 5 s, a mail system that takes 2 s to say it never accepted it and a mail server that
    # then holds the new send for longer than the task has left
    queue_purge()
    _, action = approved_run(demo, bob)
    smtp_server.drop = "before_accept"
    services.action_execute(action_id=action.pk)
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    smtp_server.drop = ""
    smtp_server.stall = 8
    settings.EMAIL_TIMEOUT = 10
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 243
    [mail_send] = versions_frozen(model=ToolVersion, ids=[action.tool_version_id]).values()
    monkeypatch.setattr(mail_send, "timeout_s", 5)
    settings.MAIL_DELIVERY_LOOKUP = f"{__name__}.slow_lookup"

    # when its first attempt is made
    started = time.monotonic()
    status = deliver(action, 1)
    elapsed = time.monotonic() - started

    # then the send was abandoned when the task's 3 s were up, not 3 s after the lookup, so
    # Celery's soft time limit does not interrupt it: its outcome is unknown again, for the
    # next attempt, with the one mail the server holds
    assert elapsed < 4
    assert status == ActionStatus.UNKNOWN
    assert len(smtp_server.messages) == 1
    queue_purge()


def failing_lookup(message_id: str) -> bool:
    """A mail system whose API is down: asking it raises."""
    raise ConnectionError("the relay's API is down")


def test_a_reconciliation_whose_lookup_raises_stays_unknown_and_is_tried_again_later(
    demo, bob, smtp_server, settings, caplog
):
    # given an unknown action whose mail system raises when asked about the message
    queue_purge()
    _, action = left_unknown(demo, bob, smtp_server)
    settings.MAIL_DELIVERY_LOOKUP = f"{__name__}.failing_lookup"

    # when its first attempt is made
    made_at = timezone.now()
    status = deliver(action, 1)

    # then the attempt is counted like one the tool could not answer, and the next is due
    # after the backoff, where before the error rolled the attempt back and every sweep
    # made it again at once, without end
    assert status == ActionStatus.UNKNOWN
    attempts, due = schedule(action)
    assert attempts == 1
    assert round((due - made_at).total_seconds()) == 30
    # and nothing was sent again, and the log names the fault (not its message, which may
    # quote what the handler held) for an operator
    assert len(smtp_server.messages) == 1
    assert "mail_send@1.0.0: the handler raised ConnectionError" in caplog.text
    assert "the relay's API is down" not in caplog.text
    queue_purge()
