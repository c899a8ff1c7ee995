"""A cancel the user was told was accepted is honoured by whatever holds the run next: a cancel
made while a step, a decision or the sending held the run waits beside it (`CancelRequest`,
taken in by the sweep every 30 s). Before, an approval, the resume and the handoff never
looked there, nor did reconciling a send that never arrived: the mail went out after the
cancel."""

import threading

import pytest
from django.db import connection

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.errors import AlreadyDecided
from approvals.models import ApprovalDecision, BusinessAction, Handoff
from runs import loop
from runs.loop import run_advance_step
from runs.models import CancelRequest, Run
from runs.services.runs import run_cancel
from tests.approvals.conftest import approved_run, waiting_run
from tests.approvals.test_handoffs import handed_off  # noqa: F401 (fixture)
from tests.runs.conftest import demo_run, event_types


def cancelled_while_held(run: Run) -> None:
    """What `run_cancel` leaves when the run's lock is not free within its wait."""
    CancelRequest.objects.create(run_id=run.pk, reason="CANCELLED_BY_USER")


def decide(action: BusinessAction, approver, decision: Decision) -> None:
    services.approval_decide(
        action_id=action.pk,
        approver=approver,
        decision=decision,
        payload_hash=action.payload_hash,
    )


@pytest.mark.django_db(transaction=True)
def test_a_cancel_made_while_the_drafting_step_holds_the_run_wins_over_the_approval(
    demo, bob, smtp_server, monkeypatch
):
    run = demo_run(demo, project_id="apollo")
    freezing, let_go = threading.Event(), threading.Event()
    await_approval = loop._await_approval

    def slow_freeze(run, draft):
        freezing.set()
        assert let_go.wait(timeout=20)
        return await_approval(run, draft)

    monkeypatch.setattr(loop, "_await_approval", slow_freeze)

    def steps():
        try:
            while run_advance_step(run_id=str(run.pk)):
                pass
        finally:
            connection.close()

    stepping = threading.Thread(target=steps)
    stepping.start()
    assert freezing.wait(timeout=30)
    accepted = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)
    let_go.set()
    stepping.join(timeout=30)
    action = BusinessAction.objects.get(run=run)

    with pytest.raises(AlreadyDecided, match="cancelled"):
        decide(action, bob, Decision.APPROVE)
    services.action_execute(action_id=action.pk)

    assert accepted.cancel_requested_at is not None
    run.refresh_from_db()
    action.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert action.status == ActionStatus.INVALIDATED
    assert smtp_server.messages == []
    assert not CancelRequest.objects.filter(run=run).exists()


def test_an_approved_action_whose_run_was_cancelled_meanwhile_is_not_sent(demo, bob, smtp_server):
    run, action = approved_run(demo, bob)
    cancelled_while_held(run)

    services.action_execute(action_id=action.pk)

    run.refresh_from_db()
    action.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, "CANCELLED_BY_USER")
    assert smtp_server.messages == []


def test_a_send_that_never_arrived_is_not_made_again_after_a_cancel(demo, bob, smtp_server):
    run, action = approved_run(demo, bob)
    smtp_server.drop = "before_accept"
    services.action_execute(action_id=action.pk)
    action.refresh_from_db()
    assert action.status == ActionStatus.UNKNOWN
    smtp_server.drop = ""
    accepted = run_cancel(run=Run.objects.get(pk=run.pk), actor=demo.alice)

    services.action_reconcile(action_id=action.pk)

    assert accepted.cancel_requested_at is not None
    run.refresh_from_db()
    action.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert action.status == ActionStatus.FAILED
    assert action.outcome["error"]["message"] == (
        "The send never started, and the run was cancelled."
    )
    assert smtp_server.messages == []


def test_a_handoff_of_a_run_cancelled_meanwhile_is_closed_not_handled(demo, bob, handed_off):  # noqa: F811
    cancelled_while_held(handed_off)
    handoff = Handoff.objects.get(run=handed_off)

    with pytest.raises(AlreadyDecided, match="cancelled"):
        services.handoff_resolve(
            handoff_id=handoff.pk, person=bob, outcome="handled", note="Sent it myself."
        )

    handed_off.refresh_from_db()
    handoff.refresh_from_db()
    assert (handed_off.status, handed_off.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert (handoff.status, handoff.status_reason, handoff.resolved_by) == (
        "withdrawn",
        "CANCELLED_BY_USER",
        None,
    )
    assert event_types(handed_off)[-2:] == ["handoff.resolved", "run.finished"]


def test_a_waiting_run_cancelled_meanwhile_refuses_a_rejection_too(demo, bob):
    run, action = waiting_run(demo)
    cancelled_while_held(run)

    with pytest.raises(AlreadyDecided):
        decide(action, bob, Decision.REJECT)

    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert not ApprovalDecision.objects.filter(action=action).exists()


def test_a_cancel_made_before_the_approval_expired_ends_the_run_as_the_user_asked(demo):
    run, action = waiting_run(demo)
    CancelRequest.objects.create(run_id=run.pk, reason="CANCELLED_BY_USER", requested_by=demo.alice)
    BusinessAction.objects.filter(pk=action.pk).update(expires_at=action.created_at)

    assert services.actions_expire() == 0

    run.refresh_from_db()
    action.refresh_from_db()
    assert (run.status, run.reason_code, run.cancelled_by) == (
        "CANCELLED",
        "CANCELLED_BY_USER",
        demo.alice,
    )
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, "CANCELLED_BY_USER")
    assert event_types(run)[-2:] == ["approval.invalidated", "run.finished"]
    assert not CancelRequest.objects.filter(run=run).exists()
