"""The running example end to end through a real worker and a real SMTP server; concurrent
approvals of one action."""

import threading
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.errors import AlreadyDecided
from approvals.models import ApprovalDecision, BusinessAction
from runs.choices import RunStatus
from runs.models import Run
from tests.approvals.conftest import SENDING_EVENTS, approver_in
from tests.celery_worker import (
    EXAMPLE_EVENTS,
    alice_client,
    example_post,
    example_seed,
    run_status,
    wait_until,
)
from tests.celery_worker import (
    event_types as logged_event_types,
)


def test_the_running_example_delivers_one_mail_after_twenty_concurrent_approvals(
    start_worker, smtp_server
):
    example_seed()
    worker = start_worker(environment=smtp_server.environment())
    response = example_post(alice_client())
    run_id = response.json()["run_id"]
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=60,
        what="the run to wait for approval",
        worker=worker,
    )
    action = BusinessAction.objects.get(run_id=run_id)
    approvers = [approver_in(action.tenant, f"approver-{index}") for index in range(20)]
    barrier = threading.Barrier(len(approvers))
    outcomes: list[str] = []

    def decide(approver) -> None:
        barrier.wait()
        try:
            services.approval_decide(
                action_id=action.pk,
                approver=approver,
                decision=Decision.APPROVE,
                payload_hash=action.payload_hash,
            )
            outcomes.append("decided")
        except AlreadyDecided:
            outcomes.append("already decided")
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(approver,)) for approver in approvers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes) == ["already decided"] * 19 + ["decided"]
    assert ApprovalDecision.objects.filter(action=action).count() == 1
    wait_until(
        lambda: run_status(run_id) in (RunStatus.COMPLETED, RunStatus.FAILED_FINAL),
        seconds=60,
        what="the worker to send the approved mail",
        worker=worker,
    )
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.reason_code) == ("COMPLETED", "SENT")
    assert [message["To"] for message in smtp_server.messages] == ["li.wei@acme.example"]
    assert run.result["output"]["message_id"] == smtp_server.messages[0]["Message-ID"]
    assert logged_event_types(run_id) == [*EXAMPLE_EVENTS, *SENDING_EVENTS]


def test_a_worker_killed_while_sending_is_replaced_and_exactly_one_mail_goes_out(
    start_worker, smtp_server
):
    # given an approved run whose worker is inside the SMTP exchange: the server has the
    # mail but has not answered yet
    example_seed()
    environment = smtp_server.environment(EMAIL_TIMEOUT="60")
    first = start_worker(environment=environment)
    run_id = example_post(alice_client()).json()["run_id"]
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=60,
        what="the run to wait for approval",
        worker=first,
    )
    action = BusinessAction.objects.get(run_id=run_id)
    smtp_server.stall = 60
    services.approval_decide(
        action_id=action.pk,
        approver=get_user_model().objects.get(username="bob"),
        decision=Decision.APPROVE,
        payload_hash=action.payload_hash,
    )
    wait_until(
        lambda: len(smtp_server.messages) == 1,
        seconds=60,
        what="the mail server to receive the mail",
        worker=first,
    )

    # when the worker is killed there and another one takes over
    first.kill()
    smtp_server.stall = 0
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.EXECUTING
    second = start_worker(environment=environment)
    BusinessAction.objects.filter(pk=action.pk).update(
        updated_at=timezone.now() - services.STALLED_AFTER - timedelta(seconds=1)
    )
    assert services.actions_resume_stalled() == 1

    # then the action is settled by its key, and the mail is not sent again
    wait_until(
        lambda: run_status(run_id) == RunStatus.COMPLETED,
        seconds=60,
        what="the new worker to settle the action",
        worker=second,
    )
    action = BusinessAction.objects.get(pk=action.pk)
    assert len(smtp_server.messages) == 1
    assert action.status == ActionStatus.SUCCEEDED
    assert action.reconciled_at is not None
    assert action.external_id == smtp_server.messages[0]["Message-ID"]
    assert logged_event_types(run_id)[-3:] == [
        "action.reconciled",
        "action.succeeded",
        "run.finished",
    ]
