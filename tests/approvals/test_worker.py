"""The running example end to end through a real worker and a real SMTP server; concurrent
approvals of one action."""

import threading

from django.db import connection

from approvals import services
from approvals.choices import Decision
from approvals.errors import AlreadyDecided
from approvals.models import ApprovalDecision, BusinessAction
from runs.choices import RunStatus
from runs.models import Run
from tests.approvals.conftest import approver_in
from tests.celery_worker import (
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
    worker = start_worker(
        environment={
            "EMAIL_HOST": smtp_server.host,
            "EMAIL_PORT": str(smtp_server.port),
            "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
        }
    )
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
    assert logged_event_types(run_id)[-7:] == [
        "approval.granted",
        "run.resumed",
        "tool.requested",
        "action.executing",
        "tool.completed",
        "action.succeeded",
        "run.finished",
    ]
