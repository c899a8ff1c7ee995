"""The approvals' evidence in the Django admin: read-only, and within the tenants where the
staff user administers."""

import json
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from approvals.choices import ActionStatus
from approvals.models import ApprovalDecision, Handoff
from approvals.services import handoff_resolve
from registry.choices import Role
from registry.models import Tenant
from registry.services.tenancy import membership_add
from tests.approvals import test_handoffs
from tests.approvals.conftest import approved_run

pytestmark = pytest.mark.django_db

handed_off = test_handoffs.handed_off

PATHS = {
    "action": "/admin/approvals/businessaction/",
    "decision": "/admin/approvals/approvaldecision/",
}


def staff_admin_of(tenant: Tenant, username: str) -> Client:
    """A staff user who administers `tenant`, holding Django's view permissions of the
    approvals' models (which must not widen what the tenant scope allows)."""
    user = get_user_model().objects.create_user(username=username, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="approvals"))
    membership_add(actor=None, user=user, tenant=tenant, role=Role.ADMIN)
    client = Client()
    client.force_login(user)
    return client


def test_a_tenant_administrator_sees_only_the_approvals_of_their_tenant(demo, bob):
    # given an acme action, decided, and an administrator of acme and one of globex
    _run, action = approved_run(demo, bob)
    decision = ApprovalDecision.objects.get(action=action)
    ours = staff_admin_of(demo.acme, "acme-admin")
    theirs = staff_admin_of(Tenant.objects.get(slug="globex"), "globex-admin")

    # then acme's administrator reads both, and may not change them
    assert str(action.pk) in ours.get(PATHS["action"]).content.decode()
    assert ours.get(f"{PATHS['action']}{action.pk}/change/").status_code == 200
    assert ours.get(f"{PATHS['decision']}{decision.pk}/change/").status_code == 200
    assert ours.post(f"{PATHS['action']}{action.pk}/delete/").status_code == 403
    # and globex's finds neither, nor acme among the tenants to filter by
    listed = theirs.get(PATHS["action"]).content.decode()
    assert str(action.pk) not in listed
    assert f"tenant__id__exact={demo.acme.pk}" not in listed
    assert theirs.get(f"{PATHS['action']}{action.pk}/change/").status_code == 302
    assert theirs.get(f"{PATHS['decision']}{decision.pk}/change/").status_code == 302
    assert theirs.get(f"{PATHS['action']}{action.pk}/history/").status_code == 404


def test_the_history_of_another_tenants_action_is_not_found_as_if_it_never_existed(demo, bob):
    _run, action = approved_run(demo, bob)
    record = action.history.earliest("history_date")
    theirs = staff_admin_of(Tenant.objects.get(slug="globex"), "globex-admin")
    missing = uuid.uuid4()

    pages = {
        "history": (f"{action.pk}/history/", f"{missing}/history/"),
        "record": (
            f"{action.pk}/history/{record.history_id}/",
            f"{missing}/history/{record.history_id}/",
        ),
    }

    for existing, never in pages.values():
        assert theirs.get(PATHS["action"] + existing).status_code == 404
        assert theirs.get(PATHS["action"] + never).status_code == 404


@pytest.mark.parametrize("page", PATHS)
def test_the_lists_of_approvals_do_not_read_the_runs_behind_them(demo, bob, admin_client, page):
    # (a run's row carries its transcript, state and capability: a page of 100 actions would
    # read 100 of them to show none)
    approved_run(demo, bob)

    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(PATHS[page])

    assert response.status_code == 200
    assert not [query for query in queries if '"runs_run"' in query["sql"]]


def test_a_handoffs_history_record_posted_back_changes_nothing(demo, bob, handed_off):
    """simple-history saves the row from a record's page posted back: a handled request must
    not be made open again, nor its note rewritten, by anyone who may read its history."""
    handoff = Handoff.objects.get(run=handed_off)
    handoff_resolve(handoff_id=handoff.pk, person=bob, outcome="handled", note="Sent it myself.")
    opened = handoff.history.earliest("history_date")
    ours = staff_admin_of(demo.acme, "acme-admin")
    record_page = f"/admin/approvals/handoff/{handoff.pk}/history/{opened.history_id}/"

    reverted = ours.post(
        record_page,
        {
            "tenant": demo.acme.pk,
            "run": handed_off.pk,
            "requester": demo.alice.pk,
            "skill": handoff.skill,
            "risks": json.dumps(handoff.risks),
            "request": handoff.request,
            "status": "open",
            "note": "Nobody handled it.",
        },
    )

    assert ours.get(record_page).status_code == 200
    assert reverted.status_code == 403
    handoff.refresh_from_db()
    assert (handoff.status, handoff.resolved_by, handoff.note) == (
        "handled",
        bob,
        "Sent it myself.",
    )
    assert handoff.history.count() == 2


def test_an_actions_history_record_posted_back_is_refused(demo, bob):
    _run, action = approved_run(demo, bob)
    waiting = action.history.earliest("history_date")
    record_page = f"/admin/approvals/businessaction/{action.pk}/history/{waiting.history_id}/"

    reverted = staff_admin_of(demo.acme, "acme-admin").post(record_page, {"status": "waiting"})

    assert reverted.status_code == 403
    action.refresh_from_db()
    assert action.status == ActionStatus.APPROVED
