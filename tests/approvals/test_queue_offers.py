"""The queues and pages offer a person only what they may decide: what the services would
refuse them (their own request, a policy that names none of their roles, a deactivated
tenant, an evaluation sandbox) is neither listed nor given a form."""

from django.contrib.auth import get_user_model

from approvals.choices import ActionStatus
from approvals.models import ApprovalDecision, BusinessAction, Handoff
from evaluations.starter import suite_install
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import Tenant
from registry.services.tenancy import membership_add
from runs.choices import RunStatus
from runs.models import Run
from tests.approvals.conftest import waiting_run
from tests.approvals.test_api_and_pages import api, logged_in, without_csrf
from tests.approvals.test_handoffs import handed_off  # noqa: F401 (fixture)
from tests.evaluations.conftest import TINY_SUITE, dave, evaluate, suites  # noqa: F401 (fixtures)


def test_a_requester_who_is_also_an_approver_is_not_offered_their_own_action(demo):
    # given alice's own action, alice also an approver, and a policy without self-approval
    _run, action = waiting_run(demo)
    membership_add(actor=None, user=demo.alice, tenant=demo.acme, role=Role.APPROVER)
    client = logged_in(demo.alice)

    queue = client.get("/approvals/?status=pending").content.decode()
    listed = api(demo.alice, demo.acme).get("/api/v1/approvals?status=pending").json()
    page = client.get(f"/approvals/{action.pk}/").content.decode()
    refused = without_csrf(client).post(
        f"/approvals/{action.pk}/", {"decision": "approve", "payload_hash": action.payload_hash}
    )

    assert refused.status_code == 403
    assert f"/approvals/{action.pk}/" not in queue
    assert listed["results"] == []
    assert 'name="payload_hash"' not in page
    assert "you may not decide it" in page


def test_the_human_queue_lists_only_what_the_person_may_handle(demo, handed_off):  # noqa: F811
    # given tom, an acme admin (who may decide approvals), under a policy naming only approvers
    handoff = Handoff.objects.get(run=handed_off)
    tom = get_user_model().objects.create_user(username="tom", password=DEMO_PASSWORD)
    membership_add(actor=None, user=tom, tenant=demo.acme, role=Role.ADMIN)
    client = logged_in(tom)

    queue = client.get("/approvals/handoffs/").content.decode()
    listed = api(tom, demo.acme).get("/api/v1/handoffs").json()
    page = client.get(f"/approvals/handoffs/{handoff.pk}/").content.decode()
    refused = without_csrf(client).post(
        f"/approvals/handoffs/{handoff.pk}/", {"outcome": "handled", "note": "done"}
    )

    assert refused.status_code == 403
    assert str(handoff.pk) not in queue
    assert listed["results"] == []
    assert 'name="outcome"' not in page
    assert "you may not handle it" in page


def test_a_deactivated_tenant_s_actions_leave_even_a_superuser_s_queue(demo):
    _run, action = waiting_run(demo)
    client = logged_in(demo.admin)
    Tenant.objects.filter(pk=demo.acme.pk).update(is_active=False)

    queue = client.get("/approvals/").content.decode()
    page = client.get(f"/approvals/{action.pk}/")
    decided = without_csrf(client).post(
        f"/approvals/{action.pk}/", {"decision": "approve", "payload_hash": action.payload_hash}
    )

    assert decided.status_code == 404
    assert f"/approvals/{action.pk}/" not in queue
    assert page.status_code == 404


def test_an_evaluation_sandbox_s_actions_are_in_no_one_s_queue(demo, evaluate):  # noqa: F811
    # given an eval run whose case left its run waiting for an approval in its sandbox
    suite, _ = suite_install({**TINY_SUITE, "cases": TINY_SUITE["cases"][:1]})
    sandbox = evaluate(suite).sandbox
    action = BusinessAction.objects.get(tenant=sandbox, status=ActionStatus.WAITING_APPROVAL)
    client = logged_in(demo.admin)

    # when a platform admin opens the approval queue and the action, and decides it
    queue = client.get("/approvals/?status=pending").content.decode()
    page = client.get(f"/approvals/{action.pk}/")
    decided = without_csrf(client).post(
        f"/approvals/{action.pk}/", {"decision": "approve", "payload_hash": action.payload_hash}
    )

    # then nobody approves in a sandbox: it is neither listed nor found, and nothing is decided
    assert f"/approvals/{action.pk}/" not in queue
    assert sandbox.slug not in queue
    assert page.status_code == 404
    assert decided.status_code == 404
    assert not ApprovalDecision.objects.filter(action=action).exists()
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL


def test_the_api_and_the_queue_agree_on_what_is_pending(demo, bob):
    # given an action still waiting for approval on a run that no longer waits for it (one
    # the sweep has not yet invalidated), beside one whose run still waits
    stopped, orphaned = waiting_run(demo)
    _run, action = waiting_run(demo)
    Run.objects.filter(pk=stopped.pk).update(status=RunStatus.CANCELLED)

    # when bob asks the queue page and the API for what is pending
    queue = logged_in(bob).get("/approvals/?status=pending").content.decode()
    listed = api(bob, demo.acme).get("/api/v1/approvals?status=pending").json()

    # then both list only the action whose run still waits: the other cannot be approved
    assert f"/approvals/{orphaned.pk}/" not in queue
    assert f"/approvals/{action.pk}/" in queue
    assert [item["id"] for item in listed["results"]] == [str(action.pk)]
