"""The human queue: a request whose skill uses tools of a risk the policy leaves to people is
routed to them instead of the agent; the run waits until a person handles or declines it."""

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.utils import timezone
from django.utils.html import escape

from approvals.models import Handoff
from approvals.services import handoff_resolve
from registry.choices import Risk, Role
from registry.models import Membership, Policy, Tenant
from registry.services.common import registry_object_save
from registry.services.tenancy import membership_add
from runs.choices import RunStatus
from runs.loop import run_execute
from runs.models import CancelRequest, Run, Session, ToolCall
from runs.services.runs import run_cancel
from runs.services.scheduler import occurrences_sweep
from runs.tasks import runs_sweep
from tests.approvals.conftest import approver_in
from tests.approvals.test_api_and_pages import api, logged_in, queue_row
from tests.runs.conftest import demo_run, event_types, events_of
from tests.runs.test_schedules import PAST_DEADLINE, fired, refreshed

REQUEST = "Summarise project Apollo's week and mail it to the R&D lead."


@pytest.fixture
def handed_off(demo) -> Run:
    """The running example under a policy that leaves external side effects to people."""
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    run = demo_run(demo, text=REQUEST, project_id="apollo")
    run_execute(run_id=str(run.pk))
    return Run.objects.get(pk=run.pk)


def resolve(client, handoff, **body):
    return client.post(
        f"/api/v1/handoffs/{handoff.pk}/resolve",
        {"outcome": "handled", "note": "Sent the summary myself.", **body},
        format="json",
    )


def assert_withdrawn(handoff: Handoff, reason: str, *, events_before: list[str]) -> Handoff:
    """The request was withdrawn for `reason`, and its run's log says so after
    `events_before`, its last events; returns the request as it is now."""
    handoff = Handoff.objects.get(pk=handoff.pk)
    assert (handoff.status, handoff.status_reason) == ("withdrawn", reason)
    assert event_types(handoff.run) == [*events_before, "handoff.resolved", "run.finished"]
    assert events_of(handoff.run, "handoff.resolved") == [
        {
            "handoff_id": str(handoff.pk),
            "outcome": "withdrawn",
            "resolved_by": None,
            "note": "",
            "reason": reason,
        }
    ]
    return handoff


def test_the_request_waits_for_people_and_the_agent_does_nothing(demo, handed_off):
    handoff = Handoff.objects.get(run=handed_off)

    assert handed_off.status == RunStatus.WAITING_APPROVAL
    assert handed_off.result["handoff"] == {"id": str(handoff.pk)}
    assert (handoff.status, handoff.requester, handoff.request, handoff.risks) == (
        "open",
        demo.alice,
        REQUEST,
        ["external_side_effect"],
    )
    [route] = events_of(handed_off, "route.selected")
    assert (route["mode"], route["for_people"], route["pre_approval"]) == (
        "human_queue",
        ["external_side_effect"],
        False,
    )
    assert "leaves to people" in " ".join(route["why"])
    assert event_types(handed_off)[-1] == "handoff.requested"
    assert "model.requested" not in event_types(handed_off)
    assert not ToolCall.objects.filter(run=handed_off).exists()


def test_a_person_handles_it_through_the_api_and_the_run_ends_with_their_note(
    demo, bob, handed_off
):
    handoff = Handoff.objects.get(run=handed_off)
    client = api(bob, demo.acme)

    listed = client.get("/api/v1/handoffs").json()
    handled = resolve(client, handoff)
    again = resolve(client, handoff, outcome="declined", note="No.")

    assert [item["id"] for item in listed["results"]] == [str(handoff.pk)]
    assert handled.status_code == 200
    assert (handled.json()["status"], handled.json()["resolved_by"]) == ("handled", "bob")
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.COMPLETED, "HANDLED_BY_PERSON")
    assert run.result["output"] == {
        "handoff_id": str(handoff.pk),
        "note": "Sent the summary myself.",
    }
    assert event_types(run)[-2:] == ["handoff.resolved", "run.finished"]
    assert events_of(run, "handoff.resolved")[0]["resolved_by"] == "bob"
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "ALREADY_DECIDED"


def test_the_project_a_handed_off_request_named_is_the_session_s_project(demo, bob, handed_off):
    """Before, a request left to people did not move its session to the project it named, as
    a run that goes on or asks the user does: the next message naming none was not about it."""
    # given alice's request about apollo, handled by bob
    assert resolve(api(bob, demo.acme), Handoff.objects.get(run=handed_off)).status_code == 200

    # when she writes again in the session, naming no project
    later = demo_run(demo, text="Now next week's plan, please.", session_id=handed_off.session_id)
    run_execute(run_id=str(later.pk))

    # then her message is about apollo
    assert Session.objects.get(pk=handed_off.session_id).state["project_id"] == "apollo"
    assert Run.objects.get(pk=later.pk).state["inputs"]["project_id"] == "apollo"


def test_the_human_queue_says_how_long_a_request_waits_only_while_it_waits(demo, bob, handed_off):
    # given a request left to people three days ago, and another handled by bob since
    waiting = Handoff.objects.get(run=handed_off)
    later = demo_run(demo, text=REQUEST, project_id="apollo")
    run_execute(run_id=str(later.pk))
    handled = Handoff.objects.get(run=later)
    assert resolve(api(bob, demo.acme), handled).status_code == 200
    Handoff.objects.filter(pk__in=[waiting.pk, handled.pk]).update(
        created_at=timezone.now() - timedelta(days=3)
    )

    # when bob opens the human queue
    html = logged_in(bob).get("/approvals/handoffs/").content.decode()

    # then the open one waits for three days, and the handled one says when it was handled
    assert "3\xa0days" in queue_row(html, f"/approvals/handoffs/{waiting.pk}/")
    row = queue_row(html, f"/approvals/handoffs/{handled.pk}/")
    assert "3\xa0days" not in row
    assert "Handled 0\xa0minutes ago" in row


def test_a_person_declines_it_on_the_page(demo, bob, handed_off):
    handoff = Handoff.objects.get(run=handed_off)
    client = logged_in(bob)

    queue = client.get("/approvals/handoffs/").content.decode()
    page = client.get(f"/approvals/handoffs/{handoff.pk}/")
    token = client.cookies["csrftoken"].value
    without_note = client.post(
        f"/approvals/handoffs/{handoff.pk}/", {"outcome": "declined", "csrfmiddlewaretoken": token}
    )
    declined = client.post(
        f"/approvals/handoffs/{handoff.pk}/",
        {"outcome": "declined", "note": "Ask the PMO instead.", "csrfmiddlewaretoken": token},
    )

    assert f"/approvals/handoffs/{handoff.pk}/" in queue
    assert escape(REQUEST) in page.content.decode()
    assert without_note.status_code == 302
    assert declined.status_code == 302
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.REFUSED, "DECLINED_BY_PERSON")
    assert run.result["output"]["note"] == "Ask the PMO instead."
    assert Handoff.objects.get(pk=handoff.pk).resolved_by == bob


def test_a_declined_request_tells_its_user_who_declined_it_why_and_what_to_do(
    demo, bob, handed_off
):
    # given bob declining alice's request with a note holding a right-to-left override
    handoff = Handoff.objects.get(run=handed_off)

    handoff_resolve(
        handoff_id=handoff.pk,
        person=bob,
        outcome="declined",
        note="Ask \u202eOMP the instead.",
    )

    # then her result says who declined it, with the note spelled out, and what she can do;
    # not to ask a tenant admin for access, which she has
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.REFUSED, "DECLINED_BY_PERSON")
    assert run.result["next_step"] == (
        'Nothing was done: bob declined the request, saying "Ask <U+202E>OMP the instead.". '
        "Change the request as needed and send it again in a new message."
    )


def test_a_handled_request_tells_its_user_who_handled_it_and_what_they_did(demo, bob, handed_off):
    # given bob handling alice's request with a note holding a right-to-left override
    handoff = Handoff.objects.get(run=handed_off)

    handoff_resolve(
        handoff_id=handoff.pk,
        person=bob,
        outcome="handled",
        note="Sent \u202eti the summary myself.",
    )

    # then her result says who handled it, with the note spelled out, not only that
    # nothing more is to be done
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.COMPLETED, "HANDLED_BY_PERSON")
    assert run.result["next_step"] == (
        'bob handled the request, saying "Sent <U+202E>ti the summary myself.". Nothing more to do.'
    )


def test_a_task_s_declined_request_tells_its_owner_to_change_the_task(demo, bob):
    # given a scheduled task whose run left its request to people, and bob declining it
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    handoff = Handoff.objects.get(run_id=occurrence.run_id)

    handoff_resolve(handoff_id=handoff.pk, person=bob, outcome="declined", note="Not weekly.")

    # then its owner is told who declined it and that the task is theirs to change
    assert refreshed(occurrence).run.result["next_step"] == (
        'Nothing was done: bob declined the request, saying "Not weekly.". Change the task '
        "as needed; its next occurrence asks again."
    )


def test_the_page_spells_out_the_hidden_characters_of_the_request(demo, bob):
    # given a request handed to people whose text holds a right-to-left override and a
    # zero-width space: raw, "mail it to \u202emoc.live@ab" reads "mail it to ba@evil.com"
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    text = "Summarise Apollo's week and mail it to \u202emoc.live@ab\u202c\u200b."
    run = demo_run(demo, text=text, project_id="apollo")
    run_execute(run_id=str(run.pk))
    handoff = Handoff.objects.get(run=run)

    # when a person opens it
    page = logged_in(bob).get(f"/approvals/handoffs/{handoff.pk}/").content.decode()

    # then each is spelled out, the page says so, and the request is kept as written
    assert escape("mail it to <U+202E>moc.live@ab<U+202C><U+200B>.") in page
    assert "\u202e" not in page and "\u200b" not in page
    assert "spelled out above as &lt;U+XXXX&gt;" in page
    assert Handoff.objects.get(pk=handoff.pk).request == text


def test_the_queue_spells_out_the_hidden_characters_of_a_request(demo, bob):
    # given a request handed to people whose text holds a right-to-left override
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    run = demo_run(demo, text="Mail it to \u202emoc.live@ab\u202c.", project_id="apollo")
    run_execute(run_id=str(run.pk))
    handoff = Handoff.objects.get(run=run)

    # when a person opens the human queue
    html = logged_in(bob).get("/approvals/handoffs/").content.decode()

    # then the request's row spells it out, and holds none of it raw
    row = queue_row(html, f"/approvals/handoffs/{handoff.pk}/")
    assert escape("Mail it to <U+202E>moc.live@ab<U+202C>.") in row
    assert "\u202e" not in html and "\u202c" not in html


def test_the_page_spells_out_the_hidden_characters_of_the_handler_s_note(demo, bob, handed_off):
    # given bob declining a request with a note holding a right-to-left override: raw,
    # "ask \u202emoc.live@ab" reads "ask ba@evil.com"
    handoff = Handoff.objects.get(run=handed_off)
    client = logged_in(bob)
    client.get(f"/approvals/handoffs/{handoff.pk}/")
    note = "Not for us; ask \u202emoc.live@ab\u202c instead."
    client.post(
        f"/approvals/handoffs/{handoff.pk}/",
        {
            "outcome": "declined",
            "note": note,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )

    # when the page shows the outcome
    page = client.get(f"/approvals/handoffs/{handoff.pk}/").content.decode()

    # then he reads each hidden character of the note by its code point, none of them raw,
    # and the page says so, though the request holds none
    assert escape(": Not for us; ask <U+202E>moc.live@ab<U+202C> instead.") in page
    assert "\u202e" not in page and "\u202c" not in page
    assert "spelled out above as &lt;U+XXXX&gt;" in page
    assert Handoff.objects.get(pk=handoff.pk).note == note


def test_a_note_over_the_limit_is_refused_with_the_reason_and_the_form_bounds_it(
    demo, bob, handed_off
):
    # given bob on the request's page, whose note box holds at most 4000 characters
    handoff = Handoff.objects.get(run=handed_off)
    client = logged_in(bob)
    page = client.get(f"/approvals/handoffs/{handoff.pk}/").content.decode()
    box = '<textarea name="note" cols="60" rows="4" maxlength="4000" required id="id_note">'
    assert box in page
    events_before = event_types(handed_off)

    # when a post with a longer note reaches the server anyway
    posted = client.post(
        f"/approvals/handoffs/{handoff.pk}/",
        {
            "outcome": "handled",
            "note": "x" * 4001,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
        follow=True,
    )

    # then the page says why nothing was recorded, and neither the request nor the run changes
    html = posted.content.decode()
    assert posted.redirect_chain == [(f"/approvals/handoffs/{handoff.pk}/", 302)]
    assert (
        "Nothing was recorded. Note: Ensure this value has at most 4000 characters "
        "(it has 4001)." in html
    )
    assert Handoff.objects.get(pk=handoff.pk).status == "open"
    assert Run.objects.get(pk=handed_off.pk).status == RunStatus.WAITING_APPROVAL
    assert event_types(handed_off) == events_before


@pytest.mark.parametrize(
    "outcome", ["withdrawn", "open", "maybe", ["handled", "declined"]], ids=str
)
def test_a_page_post_of_an_outcome_a_person_cannot_give_records_nothing(
    demo, bob, handed_off, outcome
):
    # given bob on the request's page
    handoff = Handoff.objects.get(run=handed_off)
    client = logged_in(bob)
    client.get(f"/approvals/handoffs/{handoff.pk}/")
    events_before = event_types(handed_off)

    # when he posts an outcome the form does not offer
    posted = client.post(
        f"/approvals/handoffs/{handoff.pk}/",
        {
            "outcome": outcome,
            "note": "Gone.",
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )

    # then he is sent back to the page, and neither the request nor the run changes
    assert posted.status_code == 302
    assert posted.url == f"/approvals/handoffs/{handoff.pk}/"
    assert Handoff.objects.get(pk=handoff.pk).status == "open"
    assert Run.objects.get(pk=handed_off.pk).status == RunStatus.WAITING_APPROVAL
    assert event_types(handed_off) == events_before


@pytest.mark.parametrize(
    ("body", "field"), [({"note": 1}, "note"), ({"note": "Done.", "notes": "Done."}, "notes")]
)
def test_a_resolution_with_a_note_that_is_no_text_or_an_unknown_field_is_refused(
    demo, bob, handed_off, body, field
):
    handoff = Handoff.objects.get(run=handed_off)

    refused = api(bob, demo.acme).post(
        f"/api/v1/handoffs/{handoff.pk}/resolve", {"outcome": "handled", **body}, format="json"
    )

    assert refused.status_code == 400
    assert list(refused.json()["error"]["details"]) == [field]
    assert Handoff.objects.get(pk=handoff.pk).status == "open"


def test_a_credential_pasted_into_the_note_is_not_kept(demo, bob, handed_off):
    handoff = Handoff.objects.get(run=handed_off)
    key = "sk-live-4f9c2a7e1b3d5f6a8c9e"

    handled = resolve(api(bob, demo.acme), handoff, note=f"Sent it with key {key}.")

    assert handled.status_code == 200
    assert key not in handled.content.decode()
    assert Handoff.objects.get(pk=handoff.pk).note == "Sent it with key [redacted]."
    assert Run.objects.get(pk=handed_off.pk).result["output"]["note"] == (
        "Sent it with key [redacted]."
    )
    assert key not in json.dumps(events_of(handed_off, "handoff.resolved"))


def test_only_other_people_of_the_tenant_with_an_approver_role_may_handle_it(demo, bob, handed_off):
    handoff = Handoff.objects.get(run=handed_off)
    membership_add(actor=None, user=demo.alice, tenant=demo.acme, role=Role.APPROVER)
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex)
    carol = type(demo.alice).objects.get(username="carol")

    own = resolve(api(demo.alice, demo.acme), handoff)
    foreign = resolve(api(outsider, globex), handoff)
    auditor = resolve(api(carol, demo.acme), handoff)
    own_malformed = resolve(api(demo.alice, demo.acme), handoff, outcome="open")
    bad_outcome = resolve(api(bob, demo.acme), handoff, outcome="open")
    no_uuid = api(demo.alice, demo.acme).get("/api/v1/handoffs/not-a-uuid")

    assert (own.status_code, own.json()["error"]["code"]) == (403, "SELF_APPROVAL_FORBIDDEN")
    # the requester is refused before the body is read, whatever it holds
    assert (own_malformed.status_code, own_malformed.json()["error"]["code"]) == (
        403,
        "SELF_APPROVAL_FORBIDDEN",
    )
    assert foreign.status_code == 404
    assert api(outsider, globex).get("/api/v1/handoffs").json()["results"] == []
    # a person of the tenant without an approver role is told so, not that it does not exist
    assert (auditor.status_code, auditor.json()["error"]["code"]) == (403, "PERMISSION_DENIED")
    assert bad_outcome.status_code == 400
    assert no_uuid.status_code == 404
    assert logged_in(carol).get(f"/approvals/handoffs/{handoff.pk}/").status_code == 404
    assert Client().get("/approvals/handoffs/").status_code == 302
    assert Handoff.objects.get(pk=handoff.pk).status == "open"


def test_a_cancelled_run_s_request_can_no_longer_be_handled(demo, bob, handed_off):
    handoff = Handoff.objects.get(run=handed_off)
    run_cancel(run=handed_off, actor=demo.alice)

    late = resolve(api(bob, demo.acme), handoff)

    assert late.status_code == 409
    assert late.json()["error"] == {
        "code": "ALREADY_DECIDED",
        "message": "The run ended before anyone handled this request; it is closed.",
        "details": {
            "status": "withdrawn",
            "reason": "CANCELLED_BY_USER",
            "run_status": RunStatus.CANCELLED,
        },
    }
    handoff = Handoff.objects.get(pk=handoff.pk)
    assert (handoff.status, handoff.status_reason, handoff.resolved_by) == (
        "withdrawn",
        "CANCELLED_BY_USER",
        None,
    )
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "CANCELLED_BY_USER")


def test_cancelling_the_run_through_the_api_withdraws_its_request_from_the_human_queue(
    demo, bob, handed_off
):
    # given a request waiting for people, in bob's queue
    handoff = Handoff.objects.get(run=handed_off)
    events_before = event_types(handed_off)

    # when its requester cancels the run
    cancelled = api(demo.alice, demo.acme).post(f"/api/v1/runs/{handed_off.pk}/cancel")

    # then the request is withdrawn with the run, and the run's log says so
    assert cancelled.status_code == 200
    handoff = assert_withdrawn(handoff, "CANCELLED_BY_USER", events_before=events_before)
    assert handoff.resolved_at is not None
    assert handoff.history.first().history_change_reason == "CANCELLED_BY_USER"
    # and neither the API nor the queue page offers it as open
    [listed] = api(bob, demo.acme).get("/api/v1/handoffs").json()["results"]
    assert (listed["status"], listed["status_reason"], listed["run_status"]) == (
        "withdrawn",
        "CANCELLED_BY_USER",
        RunStatus.CANCELLED,
    )
    client = logged_in(bob)
    queue = client.get("/approvals/handoffs/").content.decode()
    assert "Withdrawn (CANCELLED_BY_USER)" in queue
    assert "Open" not in queue
    page = client.get(f"/approvals/handoffs/{handoff.pk}/").content.decode()
    assert "its run ended (CANCELLED_BY_USER) before anyone handled it" in page
    assert 'name="outcome"' not in page


def test_handling_a_withdrawn_request_on_the_page_is_refused_and_changes_nothing(
    demo, bob, handed_off
):
    # given a request whose run was cancelled while bob had its page open
    handoff = Handoff.objects.get(run=handed_off)
    client = logged_in(bob)
    client.get(f"/approvals/handoffs/{handoff.pk}/")
    run_cancel(run=handed_off, actor=demo.alice)
    events_before = event_types(handed_off)

    # when bob submits the form he had
    late = client.post(
        f"/approvals/handoffs/{handoff.pk}/",
        {
            "outcome": "handled",
            "note": "Sent it myself.",
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )

    # then it is refused, and neither the request nor the run changes
    assert late.status_code == 409
    assert "The run ended before anyone handled this request" in late.content.decode()
    handoff = Handoff.objects.get(pk=handoff.pk)
    assert (handoff.status, handoff.resolved_by, handoff.note) == ("withdrawn", None, "")
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "CANCELLED_BY_USER")
    assert event_types(run) == events_before


def test_a_cancel_kept_beside_the_run_withdraws_its_request_when_the_sweep_takes_it_in(
    demo, handed_off
):
    # given a cancel that waited beside the run while a step held it
    handoff = Handoff.objects.get(run=handed_off)
    CancelRequest.objects.create(run=handed_off, reason="CANCELLED_BY_USER")

    # when the sweep takes it in
    runs_sweep()

    # then the run ends cancelled and its request is withdrawn
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "CANCELLED_BY_USER")
    handoff = Handoff.objects.get(pk=handoff.pk)
    assert (handoff.status, handoff.status_reason) == ("withdrawn", "CANCELLED_BY_USER")
    assert event_types(run)[-2:] == ["handoff.resolved", "run.finished"]


def test_a_request_whose_requester_lost_the_tenant_is_withdrawn_by_the_sweep(demo, bob, handed_off):
    # given alice's request waiting for people, in bob's queue
    handoff = Handoff.objects.get(run=handed_off)
    events_before = event_types(handed_off)

    # when alice is no longer a member of acme, and the sweep comes round
    Membership.objects.filter(user=demo.alice, tenant=demo.acme).delete()
    runs_sweep()

    # then the run ends refused and its request leaves the human queue, the log saying so
    run = Run.objects.get(pk=handed_off.pk)
    assert (run.status, run.reason_code) == (RunStatus.REFUSED, "REQUESTER_NO_LONGER_AUTHORISED")
    assert run.result["status"] == RunStatus.REFUSED
    handoff = assert_withdrawn(
        handoff, "REQUESTER_NO_LONGER_AUTHORISED", events_before=events_before
    )
    assert handoff.resolved_by is None

    # and handling it afterwards is refused
    late = resolve(api(bob, demo.acme), handoff)
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "ALREADY_DECIDED"
    assert Handoff.objects.get(pk=handoff.pk).status == "withdrawn"


def test_a_scheduled_task_s_request_is_withdrawn_when_its_deadline_passes(demo, bob):
    # given a scheduled task whose run left its request to people
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    handoff = Handoff.objects.get(run_id=occurrence.run_id)
    assert refreshed(occurrence).status == "waiting_approval"

    # when its deadline passes
    counts = occurrences_sweep(now=timezone.now() + PAST_DEADLINE)

    # then the run ends and its request leaves the queue with the deadline as reason
    assert counts["deadline_passed"] == 1
    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.run.reason_code) == ("deadline_passed", "DEADLINE_PASSED")
    handoff = Handoff.objects.get(pk=handoff.pk)
    assert (handoff.status, handoff.status_reason) == ("withdrawn", "DEADLINE_PASSED")
    assert event_types(occurrence.run)[-2:] == ["handoff.resolved", "run.finished"]
    late = resolve(api(bob, demo.acme), handoff)
    assert (late.status_code, late.json()["error"]["details"]["reason"]) == (
        409,
        "DEADLINE_PASSED",
    )


def test_a_secret_pasted_into_a_request_is_shown_to_no_one(demo, bob, client):
    # given a request, pasted key and all, that the policy leaves to people
    key = "sk-proj-Q7f3Kd9Lm2Xv8Rt4Wz6Yb1Nc"
    policy = Policy.objects.get(agent_configs=demo.agent)
    policy.human_queue_risks = [Risk.EXTERNAL_SIDE_EFFECT]
    registry_object_save(instance=policy, actor=demo.admin, reason="people send mail")
    run = demo_run(demo, text=f"{REQUEST} Use key {key}.", project_id="apollo")
    run_execute(run_id=str(run.pk))
    handoff = Handoff.objects.get(run=run)

    # when the person who handles it reads it on the page and in the API
    page = logged_in(bob).get(f"/approvals/handoffs/{handoff.pk}/").content.decode()
    listed = api(bob, demo.acme).get(f"/api/v1/handoffs/{handoff.pk}").content.decode()

    # then they read the request without the key
    assert "Summarise project Apollo" in page
    assert key not in page
    assert key not in listed
    assert handoff.request == f"{REQUEST} Use key [redacted]."


def test_the_queue_s_api_lists_requests_by_status(demo, bob, handed_off):
    # given one request still open and one withdrawn when its run was cancelled
    withdrawn = Handoff.objects.get(run=handed_off)
    run_cancel(run=handed_off, actor=demo.alice)
    waiting = demo_run(demo, text=REQUEST, project_id="apollo")
    run_execute(run_id=str(waiting.pk))
    still_open = Handoff.objects.get(run_id=waiting.pk)
    client = api(bob, demo.acme)

    def listed(query: str) -> list[str]:
        return [entry["id"] for entry in client.get(f"/api/v1/handoffs{query}").json()["results"]]

    assert listed("?status=open") == [str(still_open.pk)]
    assert listed("?status=withdrawn") == [str(withdrawn.pk)]
    assert sorted(listed("")) == sorted([str(still_open.pk), str(withdrawn.pk)])
    refused = client.get("/api/v1/handoffs?status=closed")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "VALIDATION_ERROR"


@pytest.mark.django_db(transaction=True)
def test_a_request_left_open_by_a_run_that_ended_before_requests_were_withdrawn_is_withdrawn(
    demo, handed_off
):
    # given a request left open when its run was cancelled, as before runs withdrew theirs,
    # and another that still waits
    ended_at = timezone.now()
    Run.objects.filter(pk=handed_off.pk).update(
        status=RunStatus.CANCELLED, reason_code="CANCELLED_BY_USER", finished_at=ended_at
    )
    waiting = demo_run(demo, text=REQUEST, project_id="apollo")
    run_execute(run_id=str(waiting.pk))

    # when the migration that withdraws them runs (the schema is brought back to the latest
    # migrations afterwards: the later tests of this database need it)
    executor = MigrationExecutor(connection)
    executor.migrate([("approvals", "0004_handoff_withdrawn")])
    try:
        executor.loader.build_graph()
        executor.migrate([("approvals", "0005_handoffs_of_ended_runs_withdrawn")])
        stale = Handoff.objects.get(run=handed_off)
    finally:
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())

    # then the ended run's request is withdrawn as its run ended, and the other still waits
    assert (stale.status, stale.status_reason, stale.resolved_at) == (
        "withdrawn",
        "CANCELLED_BY_USER",
        ended_at,
    )
    assert Handoff.objects.get(run=waiting).status == "open"
