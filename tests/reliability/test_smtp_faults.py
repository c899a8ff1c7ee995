"""The mail server fails the approved send of the running example (a real SMTP server on
loopback, the action resumed and reconciled as its tasks would): down, slow, or closing the
connection after DATA with or without having accepted the message. Each mail goes out at most
once, and exactly once whenever the server can take it."""

import smtplib
import threading
import time
from collections import Counter
from unittest.mock import patch

import pytest
from django.conf import settings
from django.db import connection

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.models import BusinessAction
from examples.models import MailDelivery
from registry.canonical import canonical_hash
from registry.models import ToolVersion
from runs.models import Run, ToolCall
from runs.tools import executor
from tests.approvals.conftest import SMTP_PASSWORD, approved_run, waiting_run
from tests.faults import FaultRow, fault_report
from tests.runs.test_loop import example_tool_changed

RUNS = 3


def _report(fault: str, runs: list[Run], smtp_server) -> tuple[Counter, int]:
    statuses = Counter()
    for run in runs:
        run.refresh_from_db()
        statuses[f"{run.status} {run.reason_code}"] += 1
    sent = Counter(message["Message-ID"] for message in smtp_server.messages)
    duplicates = sum(count - 1 for count in sent.values())
    fault_report(
        FaultRow(
            fault=fault,
            injected=len(runs),
            runs=len(runs),
            statuses=statuses,
            duplicates=duplicates,
        )
    )
    return statuses, duplicates


@pytest.mark.parametrize(
    ("fault", "arrange"),
    [
        ("SMTP slow: no answer after accepting", {"stall": 3}),
        ("SMTP drops the connection after DATA, accepted", {"drop": "after_accept"}),
        ("SMTP drops the connection after DATA, not accepted", {"drop": "before_accept"}),
    ],
)
def test_an_interrupted_delivery_is_settled_by_its_key_and_sent_exactly_once(
    demo, bob, smtp_server, fault, arrange
):
    runs = []
    for _ in range(RUNS):
        run, action = approved_run(demo, bob)
        for name, value in arrange.items():
            setattr(smtp_server, name, value)
        services.action_execute(action_id=action.pk)
        action.refresh_from_db()
        assert action.status == ActionStatus.UNKNOWN
        assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "unknown"
        smtp_server.stall, smtp_server.drop = 0, ""
        # a redelivered resume settles nothing by sending: it hands over to reconciliation
        services.action_execute(action_id=action.pk)
        assert services.action_reconcile(action_id=action.pk) == ActionStatus.SUCCEEDED
        runs.append(run)

    statuses, duplicates = _report(fault, runs, smtp_server)

    assert statuses == {"COMPLETED SENT": RUNS}
    assert duplicates == 0
    assert len(smtp_server.messages) == RUNS
    assert sorted(message["Message-ID"] for message in smtp_server.messages) == sorted(
        run.result["output"]["message_id"] for run in runs
    )


def test_a_mail_server_that_is_down_fails_the_action_and_sends_nothing(demo, bob, smtp_server):
    runs = []
    smtp_server.controller.stop()
    try:
        for _ in range(RUNS):
            run, action = approved_run(demo, bob)
            services.action_execute(action_id=action.pk)
            action.refresh_from_db()
            assert action.status == ActionStatus.FAILED
            assert action.outcome["error"]["category"] == "UPSTREAM_ERROR"
            # nothing was sent, and a redelivered resume does not try again
            services.action_execute(action_id=action.pk)
            call = ToolCall.objects.get(run=run, name="mail_send")
            # a try under the key, where the tool's policy allows one, may still send it
            assert (call.envelope["retryable"], call.envelope["may_have_side_effect"]) == (
                True,
                False,
            )
            assert (
                MailDelivery.objects.get(idempotency_key=action.idempotency_key).status
                == "deferred"
            )
            runs.append(run)
    finally:
        smtp_server.start()

    statuses, _ = _report("SMTP down (connection refused)", runs, smtp_server)

    # nothing was sent and a later try may pass: the user may ask again later
    assert statuses == {"FAILED_RETRYABLE ACTION_FAILED": RUNS}
    assert smtp_server.messages == []


@pytest.mark.parametrize("line_break", ["\n", "\x0b", "\x0c", "\x85", "\u2028"])
def test_a_subject_with_a_line_break_fails_before_the_mail_server_is_asked(
    demo, bob, smtp_server, line_break
):
    # given an approved mail whose subject carries a line break, frozen before the loop
    # refused such drafts: as a header, it would smuggle in a recipient, or be delivered
    # other than approved
    run, action = waiting_run(demo)
    payload = {**action.payload, "subject": f"Weekly status{line_break}Bcc: attacker@evil.example"}
    payload_hash = canonical_hash(payload)
    BusinessAction.objects.filter(pk=action.pk).update(
        payload=payload,
        payload_hash=payload_hash,
        idempotency_key=f"{run.pk}:{action.kind}:{payload_hash}",
    )
    services.approval_decide(
        action_id=action.pk, approver=bob, decision=Decision.APPROVE, payload_hash=payload_hash
    )

    # when it is sent, and a redelivered resume and the reconciliation come after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)
    assert services.action_reconcile(action_id=action.pk) == ActionStatus.FAILED

    # then it failed for its argument, for certain, and nothing reached the mail server
    _failed(run, action, category="INVALID_ARGUMENT", run_status="FAILED_FINAL")
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "failed"
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.status, call.envelope["may_have_side_effect"]) == ("failed", False)
    assert smtp_server.envelope_recipients == []
    assert smtp_server.messages == []


def test_a_message_the_mail_server_rejects_for_good_fails_the_action_and_is_not_sent_again(
    demo, bob, smtp_server
):
    # given an approved mail the server rejects at the end of DATA with a permanent reply
    run, action = approved_run(demo, bob)
    smtp_server.refuse = "554 5.7.1 Message rejected as spam"

    # when it is sent, and a redelivered resume and the reconciliation come after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)
    assert services.action_reconcile(action_id=action.pk) == ActionStatus.FAILED

    # then it failed for certain, with the server's answer, and the server was asked once
    message = _failed(run, action, category="UPSTREAM_ERROR", run_status="FAILED_FINAL")
    assert "554 5.7.1 Message rejected as spam" in message
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "failed"
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.status, call.envelope["may_have_side_effect"]) == ("failed", False)
    assert smtp_server.refused == 1
    assert smtp_server.messages == []


def _recipient(action: BusinessAction) -> str:
    return action.payload["recipient_snapshot"]["corporate_email"]


def _failed(run: Run, action: BusinessAction, *, category: str, run_status: str) -> str:
    """Check the action failed for `category` and its run ended `run_status` ACTION_FAILED,
    both read again. Returns the failure's message."""
    action.refresh_from_db()
    run.refresh_from_db()
    assert (action.status, action.outcome["error"]["category"]) == (ActionStatus.FAILED, category)
    assert (run.status, run.reason_code) == (run_status, "ACTION_FAILED")
    return action.outcome["error"]["message"]


def _turned_away_for_now(run: Run, action: BusinessAction) -> str:
    """Check the send failed as one a later try may pass: nothing was sent, and the key's
    delivery is deferred, for a later try to take over. Returns the failure's message."""
    # the user may ask again later
    message = _failed(run, action, category="UPSTREAM_ERROR", run_status="FAILED_RETRYABLE")
    assert run.result["next_step"] == (
        "Nothing was sent. Send the message again later with a new Idempotency-Key; its new "
        "draft needs a new approval."
    )
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.status, call.envelope["retryable"], call.envelope["may_have_side_effect"]) == (
        "failed",
        True,
        False,
    )
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "deferred"
    return message


@pytest.mark.parametrize(
    ("where", "reply"),
    [
        ("recipient", "451 4.7.1 Greylisted, try again later"),
        ("recipient", "452 4.5.3 Too many recipients"),
        ("sender", "451 4.3.0 Temporary lookup failure"),
        ("sender", "421 4.3.2 Service not available"),
        ("message", "451 4.3.0 Temporary failure, try again"),
        ("message", "452 4.3.1 Insufficient system storage"),
    ],
)
def test_a_mail_the_server_turns_away_for_now_fails_the_action_with_nothing_sent(
    demo, bob, smtp_server, where, reply
):
    # given an approved mail the server turns away for now without taking it (as a
    # greylisting or busy server answers MAIL FROM or RCPT TO, or the end of DATA)
    run, action = approved_run(demo, bob)
    if where == "sender":
        smtp_server.sender_replies = [reply]
        answer = f"{reply}: {settings.DEFAULT_FROM_EMAIL}"
    elif where == "recipient":
        smtp_server.recipient_replies = {_recipient(action): [reply]}
        answer = f"{reply}: {_recipient(action)}"
    else:
        smtp_server.data_replies = [reply]
        answer = reply

    # when it is sent, with the demo's policy of one try, and a redelivered resume comes after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)

    # then it failed with the server's answer, as one a later try may pass: nothing was sent,
    # and the key's delivery is deferred, for a later try to take over
    assert _turned_away_for_now(run, action) == (
        f"The mail server turned the mail away for now ({answer}); nothing was sent."
    )
    assert smtp_server.envelope_refused + smtp_server.refused == 1
    assert smtp_server.messages == []


def _retrying_mail_send(demo) -> ToolVersion:
    """A mail_send version whose policy allows a second try, pinned by the skill the running
    example runs."""
    return example_tool_changed(
        demo,
        "mail_send",
        "1.1.0",
        retry_policy={"max_attempts": 2, "backoff_s": 0.01, "jitter": False},
    )


@pytest.mark.parametrize(
    ("where", "reply"),
    [
        ("recipient", "550 5.1.1 No such user"),
        ("sender", "553 5.7.1 Sender address rejected"),
    ],
)
def test_a_mail_the_server_refuses_for_good_fails_the_action_and_is_not_tried_again(
    demo, bob, smtp_server, where, reply
):
    # given an approved mail whose sender or recipient the server refuses for good
    run, action = approved_run(demo, bob)
    if where == "sender":
        smtp_server.sender_replies = [reply, reply]
    else:
        smtp_server.recipient_replies = {_recipient(action): [reply, reply]}

    # when it is sent, and a redelivered resume comes after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)

    # then it failed for certain, with the server's answer, and the server was asked once
    action.refresh_from_db()
    assert (action.status, action.outcome["error"]["category"]) == (
        ActionStatus.FAILED,
        "INVALID_ARGUMENT",
    )
    refused = settings.DEFAULT_FROM_EMAIL if where == "sender" else _recipient(action)
    assert action.outcome["error"]["message"] == (
        f"The mail server refused the sender or the recipients ({reply}: {refused}); "
        "nothing was sent."
    )
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.envelope["retryable"], call.envelope["may_have_side_effect"]) == (False, False)
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "failed"
    assert smtp_server.envelope_refused == 1
    assert smtp_server.messages == []


NOT_READY = [
    ("421 greeting", {"greetings": ["421 4.3.2 Service not available"]}),
    ("closed before the greeting", {"greetings": [""]}),
    ("no greeting in time", {"greeting_stall": 3}),  # longer than EMAIL_TIMEOUT
]


def _not_ready(smtp_server, arrange: dict) -> None:
    for name, value in arrange.items():
        setattr(smtp_server, name, list(value) if isinstance(value, list) else value)


@pytest.mark.parametrize(("fault", "arrange"), NOT_READY)
def test_a_mail_server_not_ready_at_connect_fails_the_action_with_nothing_sent(
    demo, bob, smtp_server, fault, arrange
):
    # given an approved mail and a mail server that is not ready to take it when asked
    run, action = approved_run(demo, bob)
    _not_ready(smtp_server, arrange)

    # when it is sent, with the demo's policy of one try, and a redelivered resume comes after
    services.action_execute(action_id=action.pk)
    smtp_server.greeting_stall = 0
    services.action_execute(action_id=action.pk)

    # then it failed as one a later try may pass: nothing was sent, and the key's delivery
    # is deferred, for a later try to take over
    message = _turned_away_for_now(run, action)
    assert message.startswith("The mail server could not be reached for now (")
    assert message.endswith("); nothing was sent.")
    assert smtp_server.messages == []


def test_a_mail_server_greeting_with_421_is_quoted_in_the_failure(demo, bob, smtp_server):
    # given an approved mail and a mail server that greets with "service not available"
    _, action = approved_run(demo, bob)
    smtp_server.greetings = ["421 4.3.2 Service not available"]

    # when it is sent
    services.action_execute(action_id=action.pk)

    # then the failure says what the server answered
    action.refresh_from_db()
    assert action.outcome["error"]["message"] == (
        "The mail server could not be reached for now (421 4.3.2 Service not available); "
        "nothing was sent."
    )


def _greylisted(smtp_server, action, settings) -> None:
    smtp_server.recipient_replies = {_recipient(action): ["451 4.7.1 Greylisted, try again later"]}


def _data_refused_for_now(smtp_server, action, settings) -> None:
    smtp_server.data_replies = ["451 4.3.0 Temporary failure, try again"]


def _not_ready_at_greeting(smtp_server, action, settings) -> None:
    smtp_server.greetings = ["421 4.3.2 Service not available"]


def _closed_before_greeting(smtp_server, action, settings) -> None:
    smtp_server.greetings = [""]


def _login_refused_for_now(smtp_server, action, settings) -> None:
    _login_turned_away_for_now(smtp_server, settings)


@pytest.mark.parametrize(
    "turn_away",
    [
        pytest.param(_greylisted, id="recipient greylisted"),
        pytest.param(_data_refused_for_now, id="451 at DATA"),
        pytest.param(_not_ready_at_greeting, id="421 greeting"),
        pytest.param(_closed_before_greeting, id="closed before the greeting"),
        pytest.param(_login_refused_for_now, id="454 to the login"),
    ],
)
def test_a_mail_turned_away_for_now_once_is_sent_on_the_next_try_its_tool_allows(
    demo, bob, smtp_server, settings, turn_away
):
    # given a mail_send version whose policy allows a second try, and a mail server that
    # turns the first try away for now
    mail_send = _retrying_mail_send(demo)
    run, action = approved_run(demo, bob)
    assert action.tool_version_id == mail_send.pk
    turn_away(smtp_server, action, settings)

    # when it is sent
    services.action_execute(action_id=action.pk)

    # then the first try was turned away and the second delivered it, once
    action.refresh_from_db()
    run.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED
    assert (run.status, run.reason_code) == ("COMPLETED", "SENT")
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.status, call.attempts) == ("completed", 2)
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "sent"
    assert smtp_server.envelope_refused + smtp_server.refused <= 1
    unused = (
        smtp_server.greetings,
        smtp_server.auth_replies,
        smtp_server.data_replies,
        [reply for replies in smtp_server.recipient_replies.values() for reply in replies],
    )
    assert unused == ([], [], [], [])
    assert [message["Message-ID"] for message in smtp_server.messages] == [action.external_id]


def test_a_mail_server_refused_at_connect_sends_on_the_next_try_its_tool_allows(
    demo, bob, smtp_server
):
    # given a mail_send version whose policy allows a second try, and a mail server that is
    # down at the first connection and back up for the second
    _retrying_mail_send(demo)
    run, action = approved_run(demo, bob)
    smtp_server.controller.stop()
    connect = smtplib.SMTP.connect
    tries = []

    def connect_and_restart(self, *args, **kwargs):
        tries.append(args)
        try:
            return connect(self, *args, **kwargs)
        finally:
            if len(tries) == 1:
                smtp_server.start()

    with patch.object(smtplib.SMTP, "connect", connect_and_restart):
        services.action_execute(action_id=action.pk)

    # then the first try was refused and the second delivered it, once
    action.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.status, call.attempts) == ("completed", 2)
    assert len(tries) == 2
    assert [message["Message-ID"] for message in smtp_server.messages] == [action.external_id]


TEMPORARY_AUTH_FAILURE = "454 4.7.0 Temporary authentication failure"
# RFC 4954: the account must first log in once with another mechanism, which an
# administrator arranges; trying the same login later meets the same answer.
PASSWORD_TRANSITION_NEEDED = "432 4.7.12 A password transition is needed"


def _login_turned_away_for_now(smtp_server, settings) -> None:
    """The mail server answers the next login (smtplib tries each mechanism it offers, PLAIN
    and LOGIN) with a temporary authentication failure, and takes the one after."""
    settings.EMAIL_HOST_USER = "agentgov"
    settings.EMAIL_HOST_PASSWORD = SMTP_PASSWORD
    smtp_server.auth_replies = [TEMPORARY_AUTH_FAILURE] * 2


def test_a_login_the_mail_server_turns_away_for_now_fails_the_action_with_nothing_sent(
    demo, bob, smtp_server, settings
):
    # given an approved mail and a mail server that cannot check the login for now
    run, action = approved_run(demo, bob)
    _login_turned_away_for_now(smtp_server, settings)

    # when it is sent, with the demo's policy of one try, and a redelivered resume comes after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)

    # then it failed with the server's answer, as one a later try may pass: nothing was sent,
    # and the key's delivery is deferred, for a later try to take over
    assert _turned_away_for_now(run, action) == (
        f"The mail server could not be reached for now ({TEMPORARY_AUTH_FAILURE}); "
        "nothing was sent."
    )
    assert smtp_server.auth_replies == []
    assert smtp_server.messages == []


@pytest.mark.parametrize(
    ("arrange", "error"),
    [
        ({"greetings": ["554 5.3.2 No SMTP service here"] * 2}, "SMTPConnectError"),
        (
            {"EMAIL_HOST_USER": "agentgov", "EMAIL_HOST_PASSWORD": "wrong"},
            "SMTPAuthenticationError",
        ),
        ({"EMAIL_USE_SSL": True}, "SSLError"),
        (
            {
                "EMAIL_HOST_USER": "agentgov",
                "EMAIL_HOST_PASSWORD": SMTP_PASSWORD,
                "auth_replies": [PASSWORD_TRANSITION_NEEDED] * 2,
            },
            "SMTPAuthenticationError",
        ),
    ],
)
def test_a_mail_server_that_turns_the_connection_away_for_good_fails_the_action_for_good(
    demo, bob, smtp_server, settings, arrange, error
):
    # given a mail_send version whose policy allows a second try, and a connection to the
    # mail server that cannot be made as configured
    _retrying_mail_send(demo)
    run, action = approved_run(demo, bob)
    for name, value in arrange.items():
        if name.startswith("EMAIL_"):
            setattr(settings, name, value)
        else:
            setattr(smtp_server, name, list(value))

    # when it is sent, and a redelivered resume comes after
    services.action_execute(action_id=action.pk)
    services.action_execute(action_id=action.pk)

    # then it failed for good, tried once: a second try could not pass
    action.refresh_from_db()
    assert (action.status, action.outcome["error"]["category"]) == (
        ActionStatus.FAILED,
        "UPSTREAM_ERROR",
    )
    assert action.outcome["error"]["message"] == (
        "The mail server could not be reached; nothing was sent."
    )
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.attempts, call.envelope["retryable"], call.envelope["may_have_side_effect"]) == (
        1,
        False,
        False,
    )
    delivery = MailDelivery.objects.get(idempotency_key=action.idempotency_key)
    assert (delivery.status, delivery.error.split(":")[0]) == ("failed", error)
    assert smtp_server.messages == []


@pytest.mark.django_db(transaction=True)
def test_a_reconciliation_while_a_mail_turned_away_is_being_recorded_does_not_send_it(
    demo, bob, smtp_server, monkeypatch
):
    # given an approved mail the server turns away for now, with the demo's policy of one try,
    # and a duplicate resume whose reconciliation asks about the key after the server's
    # answer, before the worker that sent it has recorded the action's failure
    run, action = approved_run(demo, bob)
    smtp_server.recipient_replies = {_recipient(action): ["451 4.7.1 Greylisted, try again later"]}
    send = executor.side_effect_run
    reconciliation_sending, recorded = threading.Event(), threading.Event()
    threads = []

    def reconcile() -> None:
        try:
            services.action_reconcile(action_id=action.pk)
        finally:
            connection.close()

    def with_a_duplicate(admitted):
        if threads:
            reconciliation_sending.set()
            assert recorded.wait(timeout=20)
            return send(admitted)
        outcome = send(admitted)
        threads.append(threading.Thread(target=reconcile))
        threads[0].start()
        while threads[0].is_alive() and not reconciliation_sending.is_set():
            time.sleep(0.01)
        return outcome

    monkeypatch.setattr(executor, "side_effect_run", with_a_duplicate)

    # when it is sent
    services.action_execute(action_id=action.pk)
    recorded.set()
    threads[0].join(timeout=20)

    # then the action failed and the mail was not sent behind it
    _failed(run, action, category="UPSTREAM_ERROR", run_status="FAILED_RETRYABLE")
    assert smtp_server.messages == []
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "deferred"


class WorkerLost(BaseException):
    """The worker died."""


def test_a_mail_turned_away_whose_worker_died_before_recording_it_is_sent_by_reconciliation(
    demo, bob, smtp_server, monkeypatch, settings
):
    # given an approved mail the server turned away for now, whose worker died before it
    # recorded the action's failure
    run, action = approved_run(demo, bob)
    smtp_server.recipient_replies = {_recipient(action): ["451 4.7.1 Greylisted, try again later"]}
    send = executor.side_effect_run

    def then_die(admitted):
        send(admitted)
        raise WorkerLost

    monkeypatch.setattr(executor, "side_effect_run", then_die)
    with pytest.raises(WorkerLost):
        services.action_execute(action_id=action.pk)
    monkeypatch.setattr(executor, "side_effect_run", send)
    action.refresh_from_db()
    assert action.status == ActionStatus.EXECUTING

    # when it is reconciled while the attempt may still be under way, and once it is over
    assert services.action_reconcile(action_id=action.pk) == ActionStatus.UNKNOWN
    assert smtp_server.messages == []
    settings.MAIL_ATTEMPT_SECONDS = 0
    assert services.action_reconcile(action_id=action.pk) == ActionStatus.SUCCEEDED

    # then the reconciliation sent it, once
    action.refresh_from_db()
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("COMPLETED", "SENT")
    assert MailDelivery.objects.get(idempotency_key=action.idempotency_key).status == "sent"
    assert [message["Message-ID"] for message in smtp_server.messages] == [action.external_id]
