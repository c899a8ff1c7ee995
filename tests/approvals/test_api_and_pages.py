"""The approvals API of DESIGN.md and the server-rendered queue, over the same service."""

import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import dateformat, timezone
from rest_framework.test import APIClient

from approvals import services
from approvals.choices import ActionStatus
from approvals.models import ApprovalDecision, BusinessAction
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import Tenant
from registry.services.tenancy import api_token_issue, membership_add
from registry.services.tools import TOOL_CONTENT_FIELDS
from runs.models import Run
from tests.approvals.conftest import approved_run, approver_in, waiting_run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import apollo_draft, read_apollo
from tests.runs.fake_provider import openai_completion
from tests.runs.test_loop import publish_skill, publish_tool, seeded_tool

model_server = runs_fixtures.model_server
fake_model = runs_fixtures.fake_model


def api(user, tenant) -> APIClient:
    _, key = api_token_issue(
        username=user.username, password=DEMO_PASSWORD, tenant_slug=tenant.slug
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def decide(client, action, **body):
    return client.post(
        f"/api/v1/approvals/{action.pk}/decision",
        {"decision": "approve", "payload_hash": action.payload_hash, **body},
        format="json",
    )


def test_an_approver_lists_pending_actions_and_sees_the_frozen_payload(demo, bob):
    run, action = waiting_run(demo)

    listed = api(bob, demo.acme).get("/api/v1/approvals?status=pending")
    detail = api(bob, demo.acme).get(f"/api/v1/approvals/{action.pk}")

    assert listed.status_code == 200
    assert [item["id"] for item in listed.json()["results"]] == [str(action.pk)]
    assert detail.status_code == 200
    body = detail.json()
    assert body["payload"] == action.payload
    assert body["payload_hash"] == action.payload_hash
    assert body["requester"] == "alice"
    assert body["skill"] == "weekly-summary@3.2.0"
    assert body["run"] == str(run.pk)
    assert body["decision"] is None
    assert body["send_deadline"] is None


def test_a_status_given_twice_is_refused_rather_than_read_as_the_last(demo, bob):
    waiting_run(demo)

    listed = api(bob, demo.acme).get("/api/v1/approvals?status=pending&status=approved")

    assert listed.status_code == 400
    assert listed.json()["error"]["details"] == {"status": ["Give one value."]}


def test_approving_through_the_api_binds_the_hash_and_the_approver(demo, bob):
    _run, action = waiting_run(demo)

    response = decide(api(bob, demo.acme), action, comment="ok")

    assert response.status_code == 200, response.json()
    assert response.json()["status"] == ActionStatus.APPROVED
    assert response.json()["decision"]["approver"] == "bob"
    # approved well before its expiry: the send must start by then
    assert response.json()["send_deadline"] == response.json()["expires_at"]
    decision = ApprovalDecision.objects.get(action=action)
    assert (decision.payload_hash, decision.approver.username) == (action.payload_hash, "bob")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"payload_hash": "0" * 64}, 409, "PAYLOAD_HASH_MISMATCH"),
        ({"payload_hash": "not-a-hash"}, 400, "VALIDATION_ERROR"),
        ({"decision": "maybe"}, 400, "VALIDATION_ERROR"),
        ({"comment": 1}, 400, "VALIDATION_ERROR"),
        ({"coment": "a typo"}, 400, "VALIDATION_ERROR"),
    ],
)
def test_a_bad_decision_is_refused_with_its_code_and_nothing_recorded(
    demo, bob, body, status, code
):
    _run, action = waiting_run(demo)

    response = decide(api(bob, demo.acme), action, **body)

    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert not ApprovalDecision.objects.exists()


def test_a_decision_that_names_a_field_twice_is_refused_and_nothing_recorded(demo, bob):
    _run, action = waiting_run(demo)
    hashed = f'"payload_hash": "{action.payload_hash}"'
    body = f'{{"decision": "approve", {hashed}, "decision": "reject"}}'

    response = api(bob, demo.acme).post(
        f"/api/v1/approvals/{action.pk}/decision", body, content_type="application/json"
    )

    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "VALIDATION_ERROR",
        "message": "JSON parse error - Names given more than once in an object: decision.",
        "details": {},
    }
    assert not ApprovalDecision.objects.exists()


def test_a_second_decision_is_409_already_decided(demo, bob):
    _run, action = waiting_run(demo)
    decide(api(bob, demo.acme), action)

    response = decide(api(bob, demo.acme), action, decision="reject")

    assert response.status_code == 409
    assert response.json()["error"]["code"] == "ALREADY_DECIDED"


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_deciding_an_action_whose_run_was_cancelled_says_the_run_ended_first(demo, bob, decision):
    # given alice's run waiting for approval, cancelled by alice through the API
    run, action = waiting_run(demo)
    assert api(demo.alice, demo.acme).post(f"/api/v1/runs/{run.pk}/cancel").status_code == 200

    # when bob decides it
    response = decide(api(bob, demo.acme), action, decision=decision)

    # then he is told that the run ended before anyone decided it, not that someone did
    assert response.status_code == 409
    assert response.json()["error"] == {
        "code": "ALREADY_DECIDED",
        "message": "The run ended before anyone decided this action; it will not run.",
        "details": {
            "status": ActionStatus.INVALIDATED,
            "reason": "CANCELLED_BY_USER",
            "run_status": "CANCELLED",
        },
    }
    assert not ApprovalDecision.objects.exists()
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED


def test_self_approval_is_403_and_other_tenants_see_404(demo):
    _run, action = waiting_run(demo)
    membership_add(actor=None, user=demo.alice, tenant=demo.acme, role=Role.APPROVER)
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex)

    own = decide(api(demo.alice, demo.acme), action)
    own_malformed = api(demo.alice, demo.acme).post(
        f"/api/v1/approvals/{action.pk}/decision", {"decision": "maybe"}, format="json"
    )
    foreign = api(outsider, globex).get(f"/api/v1/approvals/{action.pk}")
    foreign_decision = decide(api(outsider, globex), action)
    member_view = api(demo.alice, demo.acme).get("/api/v1/approvals/not-a-uuid")

    assert own.status_code == 403
    assert own.json()["error"]["code"] == "SELF_APPROVAL_FORBIDDEN"
    # the requester is refused before the body is read, whatever it holds
    assert own_malformed.status_code == 403
    assert own_malformed.json()["error"]["code"] == "SELF_APPROVAL_FORBIDDEN"
    assert foreign.status_code == 404
    assert foreign_decision.status_code == 404
    assert member_view.status_code == 404
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL


def test_a_person_of_the_tenant_without_an_approver_role_is_403_and_sees_no_queue(demo, bob):
    # given an admin of acme whose role the policy does not name, and a member of acme
    _run, action = waiting_run(demo)
    tom = get_user_model().objects.create_user(username="tom", password=DEMO_PASSWORD)
    membership_add(actor=None, user=tom, tenant=demo.acme, role=Role.ADMIN)
    admin, member = api(tom, demo.acme), api(demo.alice, demo.acme)

    # when they read the queue and the action, and decide it
    listed = admin.get("/api/v1/approvals")
    detail = admin.get(f"/api/v1/approvals/{action.pk}")
    decisions = [
        decide(admin, action),
        decide(member, action),
        admin.post(f"/api/v1/approvals/{action.pk}/decision", {}, format="json"),
    ]
    approver_listed = api(bob, demo.acme).get("/api/v1/approvals")

    # then the queue holds only what they may decide; the decision is refused for the role,
    # whatever its body
    assert listed.status_code == 200
    assert listed.json()["results"] == []
    assert detail.status_code == 200
    for response in decisions:
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "PERMISSION_DENIED"
    assert [item["id"] for item in approver_listed.json()["results"]] == [str(action.pk)]
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL
    assert not ApprovalDecision.objects.exists()


def test_the_queue_page_lists_only_what_the_approver_may_decide(demo, bob):
    # given an admin of acme whose role the policy does not name
    _run, action = waiting_run(demo)
    tom = get_user_model().objects.create_user(username="tom", password=DEMO_PASSWORD)
    membership_add(actor=None, user=tom, tenant=demo.acme, role=Role.ADMIN)
    client = logged_in(tom)

    # when they open the queue and the action, and post a decision the page did not offer
    queue = client.get("/approvals/")
    page = client.get(f"/approvals/{action.pk}/")
    decided = without_csrf(client).post(
        f"/approvals/{action.pk}/",
        {"decision": "approve", "payload_hash": action.payload_hash},
    )

    # then neither the queue nor the page offers it, and the decision is refused
    assert queue.status_code == 200
    assert f"/approvals/{action.pk}/" not in queue.content.decode()
    assert page.status_code == 200
    assert 'name="payload_hash"' not in page.content.decode()
    assert decided.status_code == 403
    assert not ApprovalDecision.objects.exists()


@pytest.mark.parametrize("swept", [False, True], ids=["before_the_sweep", "after_the_sweep"])
def test_a_late_decision_is_409_approval_expired_whether_or_not_the_sweep_ran(demo, bob, swept):
    # given an approval past its expiry, which the sweep may or may not have ended yet
    _run, action = waiting_run(demo)
    BusinessAction.objects.filter(pk=action.pk).update(expires_at=action.created_at)
    if swept:
        assert services.actions_expire() == 1

    response = decide(api(bob, demo.acme), action)

    assert response.status_code == 409
    assert response.json()["error"]["code"] == "APPROVAL_EXPIRED"
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.EXPIRED
    assert not ApprovalDecision.objects.exists()


def logged_in(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def without_csrf(client: Client) -> Client:
    """The same session with CSRF not enforced: posting a form the page did not offer."""
    plain = Client()
    plain.cookies = client.cookies
    return plain


def test_the_queue_lists_waiting_actions_for_approvers_only(demo, bob):
    _run, action = waiting_run(demo)

    page = logged_in(bob).get("/approvals/")
    other = logged_in(demo.alice).get("/approvals/")
    anonymous = Client().get("/approvals/")

    assert page.status_code == 200
    assert f"/approvals/{action.pk}/" in page.content.decode()
    assert "alice" in page.content.decode()
    assert str(action.pk) not in other.content.decode()
    assert anonymous.status_code == 302
    assert logged_in(demo.alice).get(f"/approvals/{action.pk}/").status_code == 404


def queue_row(html: str, url: str) -> str:
    """The table row of a queue page that links to `url`."""
    (row,) = [row for row in html.split("<tr>") if url in row]
    return row


def test_the_queue_says_how_long_an_action_waits_only_while_it_waits(demo, bob, smtp_server):
    # given two actions proposed three days ago: one still waiting, one approved and sent
    _run, waiting = waiting_run(demo)
    _run, sent = approved_run(demo, bob)
    services.action_execute(action_id=sent.pk)
    BusinessAction.objects.filter(pk__in=[waiting.pk, sent.pk]).update(
        created_at=timezone.now() - timedelta(days=3)
    )

    # when bob opens the queue
    html = logged_in(bob).get("/approvals/").content.decode()

    # then the waiting one waits for three days, and the sent one says when it was decided,
    # not that it waited all along
    assert "3\xa0days" in queue_row(html, f"/approvals/{waiting.pk}/")
    row = queue_row(html, f"/approvals/{sent.pk}/")
    assert BusinessAction.objects.get(pk=sent.pk).status == ActionStatus.SUCCEEDED
    assert "3\xa0days" not in row
    assert "Decided 0\xa0minutes ago" in row


def test_the_action_page_shows_exactly_the_frozen_payload_and_posts_its_hash(demo, bob):
    _run, action = waiting_run(demo)
    client = logged_in(bob)

    page = client.get(f"/approvals/{action.pk}/")
    html = page.content.decode()

    assert page.status_code == 200
    assert "li.wei@acme.example" in html
    assert "spelled out" not in html
    assert action.payload_hash in html
    assert f'name="payload_hash" value="{action.payload_hash}"' in html
    # without the CSRF token the post is refused
    refused = client.post(
        f"/approvals/{action.pk}/", {"decision": "approve", "payload_hash": action.payload_hash}
    )
    assert refused.status_code == 403
    assert not ApprovalDecision.objects.exists()

    token = client.cookies["csrftoken"].value
    stale = client.post(
        f"/approvals/{action.pk}/",
        {"decision": "approve", "payload_hash": "1" * 64, "csrfmiddlewaretoken": token},
    )
    assert stale.status_code == 409
    assert not ApprovalDecision.objects.exists()

    approved = client.post(
        f"/approvals/{action.pk}/",
        {
            "decision": "approve",
            "payload_hash": action.payload_hash,
            "comment": "Send it.",
            "csrfmiddlewaretoken": token,
        },
    )
    assert approved.status_code == 302
    decision = ApprovalDecision.objects.get(action=action)
    assert (decision.approver, decision.comment) == (bob, "Send it.")
    assert Run.objects.get(pk=action.run_id).status == "WAITING_APPROVAL"
    # and the page says by when the approved send must start: the action's expiry
    expiry = dateformat.format(timezone.localtime(action.expires_at), "c")
    page = client.get(f"/approvals/{action.pk}/").content.decode()
    assert f"this approval's send must start by {expiry}" in page


OFFLINE_LABEL = "offline-planner (Offline deterministic planner: offline-deterministic-planner)"


def test_a_draft_of_the_offline_planner_is_labelled_offline_where_it_waits(demo, bob):
    # given the running example, drafted by the seeded offline planner
    run, action = waiting_run(demo)

    # when alice reads her run while it waits, and bob opens the approval
    result = api(demo.alice, demo.acme).get(f"/api/v1/runs/{run.pk}").json()["result"]
    html = logged_in(bob).get(f"/approvals/{action.pk}/").content.decode()

    # then both say that the offline planner, not a provider, wrote the draft
    assert result["status"] == "WAITING_APPROVAL"
    assert (result["model"]["name"], result["model"]["provider"]) == ("offline-planner", "offline")
    assert f"<dt>Model</dt><dd>{OFFLINE_LABEL}</dd>" in html


def test_a_draft_of_a_provider_s_model_is_labelled_with_that_provider(demo, bob, fake_model):
    # given the running example drafted by an OpenAI-compatible model
    fake = fake_model()
    fake.reply(read_apollo())
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    _run, action = waiting_run(demo)

    # when bob opens the approval
    html = logged_in(bob).get(f"/approvals/{action.pk}/").content.decode()

    # then it names that model and its provider, and nothing offline
    label = "fake-openai (OpenAI-compatible Chat Completions: fake-gpt)"
    assert f"<dt>Model</dt><dd>{label}</dd>" in html
    assert "Offline" not in html


def test_a_page_post_over_the_body_limit_is_413_with_a_page_saying_so(demo, bob, settings):
    # given an approver whose form post carries a comment past the body limit
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    _run, action = waiting_run(demo)
    client = without_csrf(logged_in(bob))

    # when it is posted
    response = client.post(
        f"/approvals/{action.pk}/",
        {"decision": "approve", "payload_hash": action.payload_hash, "comment": "x" * 5000},
    )

    # then the page says what was wrong, and nothing is recorded
    assert response.status_code == 413
    assert "The form sent more than 4 KB; nothing was saved." in response.content.decode()
    assert not ApprovalDecision.objects.exists()


def test_the_action_page_spells_out_the_hidden_characters_of_what_will_be_sent(
    demo, bob, fake_model
):
    # given a model that wrote a right-to-left override and a zero-width space into its
    # draft: raw, the override shows "liame.live@ab" as "ba@evil.email"
    fake = fake_model()
    fake.reply(read_apollo())
    draft = apollo_draft(
        subject="Weekly status\u200b", body="Pay to \u202eliame.live@ab\u202c now."
    )
    fake.reply(openai_completion(content=json.dumps(draft)))
    _run, action = waiting_run(demo)

    # when bob opens the action's page
    html = logged_in(bob).get(f"/approvals/{action.pk}/").content.decode()

    # then he reads each hidden character by its code point, and none of them raw
    assert "<dd>Weekly status&lt;U+200B&gt;</dd>" in html
    assert "Pay to &lt;U+202E&gt;liame.live@ab&lt;U+202C&gt; now." in html
    assert not {"\u200b", "\u202e", "\u202c"} & set(html)
    assert "spelled out above as &lt;U+XXXX&gt;: what will be sent holds them as written" in html
    # while what will be sent, and its hash, are the payload as frozen
    assert action.payload["body"] == "Pay to \u202eliame.live@ab\u202c now."
    assert f'name="payload_hash" value="{action.payload_hash}"' in html


def test_the_action_page_lists_every_tool_version_whatever_the_tools_are_named(demo, bob):
    # given acme's weekly-summary pinning, beside the running example's tools, one named
    # "items", which a template would read as the versions' own items()
    seeded = seeded_tool(demo, "project_search")
    items = publish_tool(
        demo,
        "items",
        "1.0.0",
        **{field: getattr(seeded, field) for field in TOOL_CONTENT_FIELDS},
    )
    publish_skill(
        demo,
        "weekly-summary",
        "3.3.0",
        tool_versions=[
            *(seeded_tool(demo, name) for name in ("project_search", "directory_lookup")),
            seeded_tool(demo, "mail_send"),
            items,
        ],
    )
    _run, action = waiting_run(demo)
    assert action.payload["tool_versions"]["items"] == "1.0.0"

    # when bob opens the action's page
    page = logged_in(bob).get(f"/approvals/{action.pk}/")

    # then he reads each tool version the payload names, by name
    assert page.status_code == 200
    assert (
        "<dd>directory_lookup@1.0.0, items@1.0.0, mail_send@1.0.0, project_search@2.0.0</dd>"
        in page.content.decode()
    )


@pytest.mark.parametrize(
    "twice",
    [
        lambda action: {"decision": ["approve", "reject"]},
        lambda action: {"payload_hash": ["1" * 64, action.payload_hash]},
    ],
    ids=["decision", "payload_hash"],
)
def test_a_decision_posted_with_a_field_given_twice_records_nothing(demo, bob, twice):
    # given bob on the action's page
    run, action = waiting_run(demo)
    client = logged_in(bob)
    client.get(f"/approvals/{action.pk}/")
    fields = {"decision": "approve", "payload_hash": action.payload_hash, **twice(action)}

    # when he posts a decision that names a field twice
    posted = client.post(
        f"/approvals/{action.pk}/",
        {**fields, "csrfmiddlewaretoken": client.cookies["csrftoken"].value},
    )

    # then he is sent back to the page, and nothing is decided
    assert posted.status_code == 302
    assert posted.url == f"/approvals/{action.pk}/"
    assert not ApprovalDecision.objects.exists()
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL
    assert Run.objects.get(pk=run.pk).status == "WAITING_APPROVAL"


def test_a_comment_over_the_limit_is_refused_with_the_reason_and_the_form_bounds_it(demo, bob):
    # given bob on the action's page, whose comment box holds at most 2000 characters
    run, action = waiting_run(demo)
    client = logged_in(bob)
    page = client.get(f"/approvals/{action.pk}/").content.decode()
    assert '<textarea name="comment" cols="60" rows="3" maxlength="2000" id="id_comment">' in page

    # when a post with a longer comment reaches the server anyway
    posted = client.post(
        f"/approvals/{action.pk}/",
        {
            "decision": "reject",
            "payload_hash": action.payload_hash,
            "comment": "x" * 2001,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
        follow=True,
    )

    # then the page says why nothing was recorded, and nothing was
    html = posted.content.decode()
    assert posted.redirect_chain == [(f"/approvals/{action.pk}/", 302)]
    assert (
        "Nothing was recorded. Comment: Ensure this value has at most 2000 characters "
        "(it has 2001)." in html
    )
    assert not ApprovalDecision.objects.exists()
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL
    assert Run.objects.get(pk=run.pk).status == "WAITING_APPROVAL"


def test_the_action_page_spells_out_the_hidden_characters_of_the_approver_s_comment(demo, bob):
    # given bob rejecting an action with a comment holding a right-to-left override: raw,
    # "ask \u202emoc.live@ab" reads "ask ba@evil.com"
    _run, action = waiting_run(demo)
    client = logged_in(bob)
    client.get(f"/approvals/{action.pk}/")
    comment = "Not this week; ask \u202emoc.live@ab\u202c first."
    client.post(
        f"/approvals/{action.pk}/",
        {
            "decision": "reject",
            "payload_hash": action.payload_hash,
            "comment": comment,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )

    # when the page shows the decision
    html = client.get(f"/approvals/{action.pk}/").content.decode()

    # then he reads each hidden character of the comment by its code point, none of them raw,
    # and the page says so, though the payload holds none
    assert ": Not this week; ask &lt;U+202E&gt;moc.live@ab&lt;U+202C&gt; first.</dd>" in html
    assert not {"\u202e", "\u202c"} & set(html)
    assert "spelled out above as &lt;U+XXXX&gt;" in html
    assert ApprovalDecision.objects.get(action=action).comment == comment


def test_a_late_decision_on_the_page_shows_the_action_expired_without_its_form(demo, bob):
    # given an approval past its expiry, its page open with the form
    _run, action = waiting_run(demo)
    client = logged_in(bob)
    client.get(f"/approvals/{action.pk}/")
    BusinessAction.objects.filter(pk=action.pk).update(expires_at=action.created_at)

    # when the approver posts the decision
    refused = client.post(
        f"/approvals/{action.pk}/",
        {
            "decision": "approve",
            "payload_hash": action.payload_hash,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )

    # then the answer is the page as the action now is: expired, with nothing to decide
    html = refused.content.decode()
    assert refused.status_code == 409
    assert "Expired (APPROVAL_EXPIRED)" in html
    assert 'name="payload_hash"' not in html
    assert not ApprovalDecision.objects.exists()


def test_an_approval_past_its_expiry_is_not_pending_before_the_sweep_ends_it(demo, bob):
    # given an approval past its expiry that the sweep has not ended yet, and a later one
    # still waiting
    _run, expired = waiting_run(demo)
    _run, waiting = waiting_run(demo)
    BusinessAction.objects.filter(pk=expired.pk).update(expires_at=expired.created_at)
    client = logged_in(bob)

    # when bob lists what is pending, on the queue and through the API, then the whole queue,
    # and opens the expired one
    pending = client.get("/approvals/", {"status": "pending"}).content.decode()
    listed = api(bob, demo.acme).get("/api/v1/approvals?status=pending")
    queue = client.get("/approvals/").content.decode()
    page = client.get(f"/approvals/{expired.pk}/").content.decode()

    # then only the one still waiting is pending and listed first; the expired one does not
    # wait, and its page offers no decision that would only be refused
    assert f"/approvals/{waiting.pk}/" in pending
    assert f"/approvals/{expired.pk}/" not in pending
    assert [item["id"] for item in listed.json()["results"]] == [str(waiting.pk)]
    assert queue.index(f"/approvals/{waiting.pk}/") < queue.index(f"/approvals/{expired.pk}/")
    assert "0\xa0minutes" in queue_row(queue, f"/approvals/{waiting.pk}/")
    assert "0\xa0minutes" not in queue_row(queue, f"/approvals/{expired.pk}/")
    assert 'name="payload_hash"' not in page
    assert "Nothing is left to decide: the approval expired" in page
    # and reading changed nothing
    assert BusinessAction.objects.get(pk=expired.pk).status == ActionStatus.WAITING_APPROVAL
    assert not ApprovalDecision.objects.exists()


def test_the_queue_and_the_list_cost_the_same_queries_for_one_action_or_three(
    demo, bob, django_assert_max_num_queries
):
    waiting_run(demo)
    client, token_client = logged_in(bob), api(bob, demo.acme)
    with django_assert_max_num_queries(12) as one_page:
        client.get("/approvals/")
    with django_assert_max_num_queries(12) as one_list:
        token_client.get("/api/v1/approvals")
    waiting_run(demo)
    waiting_run(demo)

    with django_assert_max_num_queries(len(one_page.captured_queries)):
        assert client.get("/approvals/").status_code == 200
    with django_assert_max_num_queries(len(one_list.captured_queries)):
        assert len(token_client.get("/api/v1/approvals").json()["results"]) == 3
