"""What an auditor reads about the running example, from approval to sent mail: the trace's
spans, the run history with its filters and pages, one run in full, redacted for the viewer,
and the export."""

import base64
import itertools
import json
import logging
import time as time_module
import uuid
from datetime import datetime, time, timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from approvals import services
from approvals.choices import Decision
from approvals.models import BusinessAction
from examples import handlers
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import Membership, ToolVersion
from registry.selectors import versions_frozen
from registry.services.tenancy import api_token_issue, membership_add
from registry.services.tools import tool_version_create, tool_version_revoke
from runs import audit as runs_audit
from runs.audit import PAGE_SIZE
from runs.choices import EventType
from runs.loop import run_execute
from runs.models import Run, RunEvent, Span, ToolCall
from runs.services.runs import run_cancel
from runs.tools import limits
from runs.tools.adapters import ToolRefused
from runs.tracing import root_span_id
from tests.approvals.conftest import approved_run, approver_in, left_unknown, waiting_run
from tests.registry.factories import tool_content
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import apollo_draft, demo_run, read_apollo
from tests.runs.fake_provider import API_KEY as FAKE_API_KEY
from tests.runs.fake_provider import openai_completion

pytestmark = pytest.mark.django_db

model_server = runs_fixtures.model_server
fake_model = runs_fixtures.fake_model

EMAIL = "li.wei@acme.example"
MASKED = "l***@acme.example"


@pytest.fixture
def sent_run(demo, bob, smtp_server) -> Run:
    """The running example approved by bob and sent."""
    run, action = waiting_run(demo)
    services.approval_decide(
        action_id=action.pk,
        approver=bob,
        decision=Decision.APPROVE,
        payload_hash=action.payload_hash,
        comment="Looks right.",
    )
    services.action_execute(action_id=action.pk)
    return Run.objects.get(pk=run.pk)


@pytest.fixture
def carol(demo):
    """acme's auditor (seeded)."""
    return get_user_model().objects.get(username="carol")


def logged_in(client, user):
    assert client.login(username=user.username, password=DEMO_PASSWORD)
    return client


def test_every_stage_of_the_run_is_a_span_of_its_trace(sent_run):
    spans = list(Span.objects.filter(run=sent_run).order_by("started_at"))

    assert [span.name for span in spans if span.name != "run"] == [
        "ingress",
        "capability",
        "routing",
        "tool.call",
        "context",
        "model.turn",
        "tool.call",
        "context",
        "model.turn",
        "approval.wait",
        "tool.call",
        "action",
    ]
    assert {(span.trace_id, span.session_id) for span in spans} == {
        (sent_run.trace_id, sent_run.session_id)
    }
    root = next(span for span in spans if span.name == "run")
    assert (root.span_id, root.parent_span_id) == (root_span_id(sent_run), "")
    assert root.attributes["status"] == "COMPLETED"
    ingress = next(span for span in spans if span.name == "ingress")
    capability = next(span for span in spans if span.name == "capability")
    assert capability.parent_span_id == ingress.span_id
    assert {span.parent_span_id for span in spans} - {"", ingress.span_id} == {root.span_id}
    turn = next(span for span in spans if span.name == "model.turn")
    assert turn.attributes["model"] == "offline-deterministic-planner"
    assert turn.attributes["input_tokens"] > 0
    wait = next(span for span in spans if span.name == "approval.wait")
    assert (wait.attributes["decision"], wait.attributes["approver"]) == ("approve", "bob")
    action = next(span for span in spans if span.name == "action")
    assert action.attributes["outcome"] == "succeeded"
    assert all(span.duration_ms >= 0 and span.ended_at >= span.started_at for span in spans)
    assert EMAIL not in json.dumps([span.attributes for span in spans])


def test_an_auditor_sees_what_the_turns_had_besides_the_transcript(demo, sent_run, carol, client):
    page = logged_in(client, carol).get(reverse("runs:detail", args=[sent_run.pk]))

    given = page.context["record"]["given"]
    assert given["recipient"] == {
        "record_id": "dir-1001",
        "display_name": "Li Wei",
        "corporate_email": MASKED,
        "record_version": 3,
        "looked_up_at": sent_run.state["recipient"]["looked_up_at"],
    }
    assert "memory" in given and "history" in given
    html = page.content.decode()
    assert 'id="given"' in html and "dir-1001" in html
    assert EMAIL not in html


def test_an_auditor_reads_the_run_with_the_email_masked(demo, sent_run, carol, client):
    page = logged_in(client, carol).get(reverse("runs:detail", args=[sent_run.pk]))

    html = page.content.decode()
    assert page.status_code == 200
    assert EMAIL not in html
    assert MASKED in html
    assert "approve by <strong>bob</strong>" in html
    assert "the frozen payload" in html and "NOT the frozen payload" not in html
    assert sent_run.action.payload_hash in html
    checks = "approval_age, approver, requester, policy, directory_record"
    assert f"Re-validated on resume: {checks}" in html
    for span in ("ingress", "model.turn", "approval.wait", "action"):
        assert f"<td>{span}</td>" in html
    assert "project_search" in html and "mail_send" in html
    turns = html.split('id="turns"')[1].split("</table>")[0]
    assert "tool_result project_search (offline-1)" in turns
    assert "untrusted_data" in turns
    assert "run.finished" in html
    assert 'id="live"' not in html


def test_the_run_page_names_each_tool_the_snapshot_left_out_and_why(demo, carol, client):
    # given acme's mail_send 1.0.0 revoked before the running example runs
    revoked = ToolVersion.objects.get(tool__name="mail_send", version="1.0.0")
    tool_version_revoke(tool_version=revoked, actor=demo.admin, reason="compromised")
    run = demo_run(demo)
    run_execute(run_id=str(run.pk))
    run.refresh_from_db()
    assert run.capability["excluded"] == [{"tool": "mail_send@1.0.0", "reason": "VERSION_REVOKED"}]

    # when the auditor opens it, then the page says what was left out and why
    page = logged_in(client, carol).get(reverse("runs:detail", args=[run.pk]))

    assert page.status_code == 200
    assert "Left out: mail_send@1.0.0 (VERSION_REVOKED)." in page.content.decode()


@pytest.mark.parametrize("contract", [["display_name"], "display_name", {"sensitive_fields": 1}])
def test_a_result_contract_stored_before_contracts_were_checked_marks_nothing(
    demo, sent_run, carol, client, contract
):
    # given tool versions whose contract is not the object it must now be (written past the
    # models, which keep published versions frozen)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {ToolVersion._meta.db_table} SET result_contract = %s",
            [json.dumps(contract)],
        )
    logged_in(client, carol)

    # when the auditor opens the run, then it is shown (with emails still masked)
    page = client.get(reverse("runs:detail", args=[sent_run.pk]))
    assert page.status_code == 200
    assert "l***@acme.example" in page.content.decode()


def test_what_the_model_saw_is_masked_before_it_is_cut_for_the_page(demo, carol, client):
    # given a message whose cut for the page falls inside an email address
    cut = runs_audit.SEEN_CHARS
    text = ("Please summarise the week. " * 80)[: cut - 7] + f"{EMAIL} and the rest."
    assert text[:cut].endswith("li.wei@")
    run = demo_run(demo, text=text, project_id="apollo")
    run_execute(run_id=str(run.pk))
    logged_in(client, carol)

    page = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    export = client.get(reverse("runs:export", args=[run.pk])).content.decode()

    assert "li.wei@" not in page and "li.wei@" not in export
    assert MASKED in export


def test_the_run_page_spells_out_the_hidden_characters_of_what_the_run_drafted(
    demo, carol, client, fake_model
):
    # given a model that wrote a right-to-left override and a zero-width space into its
    # draft: raw, the override shows "liame.live@ab" as "ba@evil.email"
    fake = fake_model()
    fake.reply(read_apollo())
    draft = apollo_draft(
        subject="Weekly status\u200b", body="Pay to \u202eliame.live@ab\u202c now."
    )
    fake.reply(openai_completion(content=json.dumps(draft)))
    run, _action = waiting_run(demo)
    logged_in(client, carol)

    # when the auditor reads the run, and exports it
    html = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    export = json.loads(client.get(reverse("runs:export", args=[run.pk])).content)

    # then the page shows each hidden character by its code point, and none of them raw,
    # as the approver was shown them; the export keeps what the run holds
    assert "Pay to &lt;U+202E&gt;liame.live@ab&lt;U+202C&gt; now." in html
    assert "Weekly status&lt;U+200B&gt;" in html
    assert not {"\u200b", "\u202e", "\u202c"} & set(html)
    assert export["actions"][0]["payload"]["body"] == "Pay to \u202eliame.live@ab\u202c now."


def test_the_run_page_spells_out_the_hidden_characters_of_a_tool_name_the_model_invented(
    demo, carol, client, fake_model
):
    # given a model that called a tool by a name of its own, which a zero-width space makes
    # look like the run's mail_send: the gates turn it away as no tool of the run
    invented = "mail\u200b_send"
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(("call_x", invented, "{}"),)))
    fake.reply(read_apollo())
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    run, _action = waiting_run(demo)
    assert ToolCall.objects.get(run=run, call_id="call_x").status == ToolCall.Status.REJECTED
    logged_in(client, carol)

    # when the auditor reads the run
    html = client.get(reverse("runs:detail", args=[run.pk])).content.decode()

    # then every place that names the call (the turn that made it, the entries of the turn
    # after, the call itself) spells the hidden character out, and none shows it raw
    turns = html.split('id="turns"')[1].split("</table>")[0]
    assert "mail&lt;U+200B&gt;_send (call_x)" in turns
    assert "tool_result mail&lt;U+200B&gt;_send (call_x)" in turns
    calls = html.split("<h2>Tool calls</h2>")[1].split("<h2>")[0]
    assert "call_x: mail&lt;U+200B&gt;_send, rejected (NOT_FOUND)" in calls
    assert "\u200b" not in html


def test_each_turn_names_the_model_that_answered_it_when_the_provider_chose_another(
    demo, carol, client, fake_model
):
    # given a provider that answers for the configured "fake-gpt" with a dated model
    fake = fake_model()
    fake.reply(read_apollo())
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    run, _action = waiting_run(demo)

    # when the auditor reads the run
    page = logged_in(client, carol).get(reverse("runs:detail", args=[run.pk]))

    # then each turn names the model asked and the one that answered
    html = page.content.decode().split('id="turns"')[1].split("</table>")[0]
    assert html.count("<td>fake-gpt (answered by fake-gpt-2025-01-01)</td>") == 2


def test_each_turn_shows_the_tokens_the_run_counted_and_which_were_estimated(
    demo, carol, client, fake_model
):
    # given a provider that reports its first turn's usage and leaves it out of its second
    fake = fake_model()
    fake.reply(read_apollo())
    draft = openai_completion(content=json.dumps(apollo_draft()))
    del draft["usage"]
    fake.reply(draft)
    run, _action = waiting_run(demo)
    _reported, estimated = (
        event.payload["counted"]
        for event in run.events.filter(type=EventType.MODEL_RESPONDED).order_by("seq")
    )

    # when the auditor reads the run and exports it
    client = logged_in(client, carol)
    html = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    export = client.get(reverse("runs:export", args=[run.pk])).json()

    # then each turn shows what the run counted for it, its header's total, the estimate
    # said so; the export keeps what the provider reported beside it
    turns = html.split('id="turns"')[1].split("</table>")[0]
    assert "<th>Tokens counted</th>" in turns
    assert "<td>321 in, 45 out</td>" in turns
    assert (
        f"<td>{estimated['input']} in (estimated), {estimated['output']} out (estimated)</td>"
        in turns
    )
    assert run.tokens_used == 321 + 45 + estimated["input"] + estimated["output"]
    assert f"{run.tokens_used} tokens" in html
    assert [turn["usage"] for turn in export["turns"]] == [
        {"input": 321, "cached_input": 0, "cache_write_input": 0, "output": 45},
        {"input": 0, "cached_input": 0, "cache_write_input": 0, "output": 0},
    ]
    assert [turn["counted"] for turn in export["turns"]] == [
        {"input": 321, "cached_input": 0, "cache_write_input": 0, "output": 45, "estimated": []},
        estimated,
    ]


def test_the_run_page_labels_a_run_of_the_offline_planner_offline(demo, sent_run, carol, client):
    # when the auditor reads the running example, drafted by the seeded offline planner
    page = logged_in(client, carol).get(reverse("runs:detail", args=[sent_run.pk]))
    export = logged_in(client, carol).get(reverse("runs:export", args=[sent_run.pk])).json()

    # then the page and the export name the run's model as the offline planner
    label = "offline-planner (Offline deterministic planner: offline-deterministic-planner)"
    assert f"model {label}" in page.content.decode()
    assert export["run"]["model"] == label


def test_each_turn_lists_the_entries_new_to_it_and_counts_those_it_had_before(
    demo, sent_run, carol, client
):
    # given the running example, whose model answered in more than one turn
    page = logged_in(client, carol).get(reverse("runs:detail", args=[sent_run.pk]))
    turns = page.context["record"]["turns"]
    assert len(turns) > 1

    # then each turn lists what it had that the turn before did not, and says how many
    # entries it had before them: the page grows with the transcript, not with its square
    assert turns[0]["seen_before"] == 0
    for before, turn in itertools.pairwise(turns):
        assert turn["seen_before"] == before["seen_before"] + len(before["seen"])
    listed = [entry for turn in turns for entry in turn["seen"]]
    assert [entry["kind"] for entry in listed] == [
        entry["kind"] for entry in sent_run.transcript[: len(listed)]
    ]
    html = page.content.decode().split('id="turns"')[1].split("</table>")[0]
    assert html.count("tool_result project_search (offline-1)") == 1
    assert f"{turns[1]['seen_before']} earlier" in html


def test_each_turn_shows_the_section_sizes_its_context_built_event_recorded(
    demo, sent_run, carol, client
):
    # given the running example, whose context.built events record each section's tokens
    built = {
        event.payload["step"]: event.payload["sections"]
        for event in sent_run.events.filter(type=EventType.CONTEXT_BUILT)
    }
    expected = [
        {name: {"tokens": section["tokens"]} for name, section in built[step].items()}
        for step in sorted(built)
    ]

    # when an auditor opens the run and exports it
    client = logged_in(client, carol)
    page = client.get(reverse("runs:detail", args=[sent_run.pk]))
    export = json.loads(client.get(reverse("runs:export", args=[sent_run.pk])).content)

    # then each turn's sections are those sizes, and no size the event does not record
    assert [turn["sections"] for turn in page.context["record"]["turns"]] == expected
    assert [turn["sections"] for turn in export["turns"]] == expected
    html = page.content.decode().split('id="turns"')[1].split("</table>")[0]
    assert "<th>Sections (tokens)</th>" in html
    for sections in expected:
        shown = ", ".join(f"{name} {size['tokens']}" for name, size in sections.items())
        assert f"<td>{shown}</td>" in html


def test_each_turn_says_which_sections_had_hidden_characters_spelled_out(demo, carol, client):
    # given a message with a zero-width space and a right-to-left override in it, which the
    # model was shown spelled out while the run keeps it as received
    text = "Summarise project Apollo\u200b for this week\u202e please"
    run = demo_run(demo, text=text, project_id="apollo")
    run_execute(run_id=str(run.pk))
    tokens = [
        event.payload["sections"]["transcript"]["tokens"]
        for event in run.events.filter(type=EventType.CONTEXT_BUILT).order_by("seq")
    ]

    # when an auditor opens the run and exports it
    client = logged_in(client, carol)
    page = client.get(reverse("runs:detail", args=[run.pk]))
    export = json.loads(client.get(reverse("runs:export", args=[run.pk])).content)

    # then each turn's transcript section (which held the message) says so, and no other
    # section does
    assert [turn["sections"]["transcript"] for turn in export["turns"]] == [
        {"tokens": size, "hidden_characters_spelled_out": True} for size in tokens
    ]
    assert {
        name
        for turn in export["turns"]
        for name, section in turn["sections"].items()
        if len(section) > 1
    } == {"transcript"}
    html = page.content.decode().split('id="turns"')[1].split("</table>")[0]
    assert html.count("(hidden characters spelled out)") == len(tokens)
    for size in tokens:
        assert f"transcript {size} (hidden characters spelled out)" in html


def test_a_tenant_admin_has_clearance_and_sees_the_email(demo, sent_run, client):
    page = logged_in(client, demo.admin).get(reverse("runs:detail", args=[sent_run.pk]))

    assert EMAIL in page.content.decode()


def test_the_export_is_the_same_record_as_json(demo, sent_run, carol, client):
    response = logged_in(client, carol).get(reverse("runs:export", args=[sent_run.pk]))

    assert response.status_code == 200
    assert response["Content-Disposition"] == f'attachment; filename="run-{sent_run.pk}.json"'
    record = json.loads(response.content)
    assert record["run"]["status"] == "COMPLETED"
    assert [event["seq"] for event in record["events"]] == list(
        range(1, sent_run.last_event_seq + 1)
    )
    assert record["actions"][0]["decision"]["approver"] == "bob"
    assert {span["name"] for span in record["spans"]} >= {"run", "action", "approval.wait"}
    assert EMAIL not in response.content.decode()


def test_the_run_page_and_export_say_when_the_run_was_received_started_and_finished(
    demo, sent_run, carol, client
):
    # given the running example, received, then started by a worker, then finished
    queued = demo_run(demo)
    client = logged_in(client, carol)

    # when the auditor opens it and exports it, and opens a run no worker has started
    page = client.get(reverse("runs:detail", args=[sent_run.pk])).content.decode()
    record = client.get(reverse("runs:export", args=[sent_run.pk])).json()
    waiting = client.get(reverse("runs:detail", args=[queued.pk])).content.decode()

    # then both say when each happened, as the run holds it
    times = {
        "created_at": sent_run.created_at.isoformat(),
        "started_at": sent_run.started_at.isoformat(),
        "finished_at": sent_run.finished_at.isoformat(),
    }
    assert {key: record["run"][key] for key in times} == times
    assert (
        f"received {times['created_at']} · started {times['started_at']} · "
        f"finished {times['finished_at']}"
    ) in page
    assert f"received {queued.created_at.isoformat()} · not started · not finished" in waiting


def test_someone_of_another_tenant_or_role_does_not_find_the_run(demo, sent_run, client):
    erin = get_user_model().objects.get(username="erin")
    globex_auditor = get_user_model().objects.create_user("gina", password=DEMO_PASSWORD)
    membership_add(actor=None, user=globex_auditor, tenant=demo.globex, role=Role.AUDITOR)

    assert (
        logged_in(client, globex_auditor)
        .get(reverse("runs:detail", args=[sent_run.pk]))
        .status_code
        == 404
    )
    assert client.get(reverse("runs:export", args=[sent_run.pk])).status_code == 404
    assert "No run matches." in client.get(reverse("runs:history")).content.decode()
    client.logout()
    assert logged_in(client, erin).get(reverse("runs:history")).status_code == 403
    client.logout()
    anonymous = client.get(reverse("runs:detail", args=[sent_run.pk]))
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]


def test_a_side_effect_is_an_action_executed_not_one_rejected_or_waiting(
    demo, sent_run, carol, bob, client
):
    # given, besides a run whose mail was sent, one waiting for approval and one rejected
    _waiting, _ = waiting_run(demo)
    _rejected, action = waiting_run(demo)
    services.approval_decide(
        action_id=action.pk,
        approver=bob,
        decision=Decision.REJECT,
        payload_hash=action.payload_hash,
    )
    logged_in(client, carol)

    # when the auditor lists the runs with a side effect
    html = client.get(reverse("runs:history"), {"has_side_effect": "on"}).content.decode()

    # then only the sent one is listed: the others did nothing in the world
    assert [str(run.pk) for run in Run.objects.all() if str(run.pk) in html] == [str(sent_run.pk)]


def _refused_by_its_authorisation_check(demo, bob, settings, monkeypatch) -> Run:
    run, action = approved_run(demo, bob)

    def refuse(*_):
        raise ToolRefused("The relay no longer sends for this project.")

    monkeypatch.setattr(handlers.MailSend, "authorize", refuse)
    services.action_execute(action_id=action.pk)
    return run


def _not_authorised_within_its_timeout(demo, bob, settings, monkeypatch) -> Run:
    # mail_send's authorisation check answers after the tool's second is up
    run, action = approved_run(demo, bob)
    [mail_send] = versions_frozen(model=ToolVersion, ids=[action.tool_version_id]).values()
    monkeypatch.setattr(mail_send, "timeout_s", 1)
    monkeypatch.setattr(handlers.MailSend, "authorize", lambda *_: time_module.sleep(1.5))
    services.action_execute(action_id=action.pk)
    return run


def _turned_away_by_its_concurrency_cap(demo, bob, settings, monkeypatch) -> Run:
    # every slot of mail_send held for longer than the send's time (2 s) lets it wait
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 243
    run, action = approved_run(demo, bob)
    [mail_send] = versions_frozen(model=ToolVersion, ids=[action.tool_version_id]).values()
    monkeypatch.setattr(mail_send, "timeout_s", 1)
    for holder in range(mail_send.concurrency_cap):
        assert limits._take(
            limits._slots_key("tool", mail_send.pk),
            cap=mail_send.concurrency_cap,
            holder=f"busy-{holder}",
            expires_at=timezone.now().timestamp() + 60,
            ttl=60,
        )
    services.action_execute(action_id=action.pk)
    return run


@pytest.mark.parametrize(
    ("refused", "run_status"),
    [
        (_refused_by_its_authorisation_check, "FAILED_FINAL"),
        # a cap that frees later may let the send through: the user may ask again later
        (_turned_away_by_its_concurrency_cap, "FAILED_RETRYABLE"),
        # so may a check that answers in time on a later try
        (_not_authorised_within_its_timeout, "FAILED_RETRYABLE"),
    ],
)
def test_an_approved_send_refused_before_its_tool_ran_is_no_side_effect(
    demo, sent_run, carol, bob, smtp_server, client, settings, monkeypatch, refused, run_status
):
    # given, besides a run whose mail was sent and one whose send's outcome is unknown, an
    # approved send refused by a gate before mail_send was called
    unknown, _ = left_unknown(demo, approver_in(demo.acme), smtp_server)
    smtp_server.stall = 0
    run = refused(demo, bob, settings, monkeypatch)
    action = BusinessAction.objects.get(run=run)
    assert action.status == "failed"
    ended = Run.objects.get(pk=run.pk)
    assert (ended.status, ended.reason_code) == (run_status, "ACTION_FAILED")
    assert len(smtp_server.messages) == 2
    logged_in(client, carol)

    # when the auditor lists the runs with a side effect, and reads the refused one
    html = client.get(reverse("runs:history"), {"has_side_effect": "on"}).content.decode()
    record = client.get(reverse("runs:export", args=[run.pk])).json()

    # then the send and the unknown one are listed, and the refused one was never executed
    listed = {str(listed.pk) for listed in Run.objects.all() if str(listed.pk) in html}
    assert listed == {str(sent_run.pk), str(unknown.pk)}
    assert action.executed_at is None
    assert [entry["executed_at"] for entry in record["actions"]] == [None]
    assert BusinessAction.objects.get(run=unknown).executed_at is not None
    # nor do the refused run's result's actions executed list it
    assert record["result"]["actions"] == Run.objects.get(pk=run.pk).result["actions"] == []


def test_the_history_says_its_times_are_when_runs_were_received_in_utc(
    demo, sent_run, carol, client
):
    # given an auditor, who may read the history from any time zone
    logged_in(client, carol)

    # when they list the runs
    html = client.get(reverse("runs:history")).content.decode()

    # then the time column says what it is and in which zone, as the run page names it
    assert "<th>Received (UTC)</th>" in html
    assert f"{sent_run.created_at:%Y-%m-%d %H:%M:%S}</a>" in html


def test_the_history_filters_and_pages_by_keyset(demo, sent_run, carol, client):
    queued = demo_run(demo, text="Summarise project Hermes", project_id="hermes")
    logged_in(client, carol)

    def listed(**params) -> list[str]:
        html = client.get(reverse("runs:history"), params).content.decode()
        return [str(run.pk) for run in Run.objects.all() if str(run.pk) in html]

    assert set(listed()) == {str(sent_run.pk), str(queued.pk)}
    assert listed(status="COMPLETED") == [str(sent_run.pk)]
    assert listed(has_side_effect="on") == [str(sent_run.pk)]
    assert listed(skill="weekly-summary@3.2.0", status="QUEUED") == [str(queued.pk)]
    assert listed(user="bob") == []
    assert listed(has_rejected_call="on") == []
    ToolCall.objects.create(
        run=queued,
        call_id="call_x",
        step=1,
        name="send_everything",
        arguments={},
        status=ToolCall.Status.REJECTED,
        error_category="NOT_FOUND",
    )
    assert listed(has_rejected_call="on") == [str(queued.pk)]
    tomorrow = (timezone.localdate() + timedelta(days=1)).isoformat()
    assert listed(date_from=tomorrow) == []
    assert set(listed(date_to=tomorrow, status="nonsense")) == {str(sent_run.pk), str(queued.pk)}
    # the last and the first day a date can name bound nothing
    assert set(listed(date_to="9999-12-31", date_from="0001-01-01")) == {
        str(sent_run.pk),
        str(queued.pk),
    }


def test_an_invalid_filter_is_ignored_and_said_so_while_the_valid_ones_still_filter(
    demo, sent_run, carol, client
):
    logged_in(client, carol)

    history = client.get(reverse("runs:history"), {"user": "bob", "date_from": "yesterday"})
    dashboard = client.get(reverse("runs:dashboard"), {"skill": "onboarding", "days": "many"})

    assert history.status_code == 200
    assert str(sent_run.pk) not in history.content.decode()
    assert "Ignored, not valid: Date from." in history.content.decode()
    assert dashboard.status_code == 200
    assert "Ignored, not valid: Days." in dashboard.content.decode()
    assert dashboard.context["figures"].statuses == {}


def test_a_history_address_with_too_many_parameters_is_a_page_saying_so(
    demo, sent_run, carol, client, settings
):
    # given an address carrying more parameters than a request may
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 100
    logged_in(client, carol)
    query = "&".join(f"status=COMPLETED{index}" for index in range(101))

    # when the auditor opens the history with it
    response = client.get(f"{reverse('runs:history')}?{query}")

    # then the page says what was wrong, rather than a bare "Bad Request (400)"
    assert response.status_code == 400
    assert "The request carried more than 100 parameters" in response.content.decode()


@pytest.mark.parametrize(
    "position",
    [
        "9999-12-31T23:59:59.999999-23:59",
        "0001-01-01T00:00:00+23:59",
        "2026-01-01T00:00:00",
    ],
)
def test_a_cursor_naming_a_time_no_run_can_have_is_ignored(demo, sent_run, carol, client, position):
    # given a hand-made cursor: a time zone PostgreSQL refuses, or no time zone at all
    before = base64.urlsafe_b64encode(f"{position}|{uuid.UUID(int=0)}".encode()).decode()
    logged_in(client, carol)

    # when
    response = client.get(reverse("runs:history"), {"before": before})

    # then it is read as no cursor: the first page
    assert response.status_code == 200
    assert str(sent_run.pk) in response.content.decode()


def test_a_deep_page_is_one_query_like_the_first(demo, carol, client):
    runs = [demo_run(demo) for _ in range(PAGE_SIZE + 5)]
    logged_in(client, carol)

    with CaptureQueriesContext(connection) as first_queries:
        first = client.get(reverse("runs:history"))
    older = first.content.decode().split('id="next" href="?before=')[1].split('"')[0]
    with CaptureQueriesContext(connection) as next_queries:
        second = client.get(reverse("runs:history"), {"before": older})

    newest_first = sorted(runs, key=lambda run: (run.created_at, str(run.pk)), reverse=True)
    assert str(newest_first[0].pk) in first.content.decode()
    assert str(newest_first[PAGE_SIZE].pk) not in first.content.decode()
    page_two = second.content.decode()
    assert [str(run.pk) in page_two for run in newest_first] == [False] * PAGE_SIZE + [True] * 5
    assert 'id="next"' not in page_two
    assert len(first_queries) <= 10 and len(next_queries) == len(first_queries)


def test_the_run_page_stays_within_eleven_queries(demo, sent_run, carol, client):
    logged_in(client, carol)

    with CaptureQueriesContext(connection) as queries:
        client.get(reverse("runs:detail", args=[sent_run.pk]))

    assert len(queries) <= 11, [query["sql"][:80] for query in queries]


def test_an_active_run_page_follows_the_stream_and_the_stream_is_redacted(
    demo, carol, client, settings
):
    settings.RUN_STREAM_MAX_SECONDS = 1
    run, _action = waiting_run(demo)
    logged_in(client, carol)

    page = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    stream = client.get(reverse("runs:stream", args=[run.pk]), HTTP_LAST_EVENT_ID="0")
    body = b"".join(stream.streaming_content).decode()

    assert 'id="live"' in page and reverse("runs:stream", args=[run.pk]) in page
    followed = json.loads(page.split('id="event-types" type="application/json">')[1].split("<")[0])
    assert followed == [event_type.value for event_type in EventType]
    assert "event: approval.required" in body
    assert EMAIL not in body and MASKED in body


def test_an_active_run_page_follows_only_what_happens_after_what_it_shows(
    demo, carol, client, settings
):
    # given carol on the page of a waiting run, which shows its log so far
    settings.RUN_STREAM_MAX_SECONDS = 1
    run, _action = waiting_run(demo)
    page = logged_in(client, carol).get(reverse("runs:detail", args=[run.pk])).content.decode()
    shown = run.last_event_seq
    assert f'data-after="{shown}"' in page

    # when the run is cancelled, and the page follows its stream after what it shows
    run_cancel(run=run, actor=run.actor)
    stream = client.get(reverse("runs:stream", args=[run.pk]), {"after": shown})
    frames = [
        dict(line.split(": ", 1) for line in block.splitlines())
        for block in b"".join(stream.streaming_content).decode().strip().split("\n\n")
    ]

    # then it is sent the new events only, each with when it happened, then the end
    events = RunEvent.objects.filter(run=run, seq__gt=shown).order_by("seq")
    assert [
        (int(frame["id"]), frame["event"], json.loads(frame["data"])["created_at"])
        for frame in frames[:-1]
    ] == [(event.seq, event.type, event.created_at.isoformat()) for event in events]
    assert len(frames) > 1
    assert frames[-1] == {"event": "end", "data": json.dumps({"status": "CANCELLED"})}


def test_a_page_s_stream_reconnecting_continues_after_the_last_event_it_received(
    demo, carol, client, settings
):
    # given a waiting run's page, whose stream sent one new event after what the page shows
    settings.RUN_STREAM_MAX_SECONDS = 1
    run, _action = waiting_run(demo)
    shown = run.last_event_seq
    run_cancel(run=run, actor=run.actor)

    # when the browser reconnects with the Last-Event-ID of that event
    stream = logged_in(client, carol).get(
        reverse("runs:stream", args=[run.pk]), {"after": shown}, HTTP_LAST_EVENT_ID=str(shown + 1)
    )

    # then the stream continues after it
    body = b"".join(stream.streaming_content).decode()
    seqs = [int(line[4:]) for line in body.splitlines() if line.startswith("id: ")]
    run.refresh_from_db()
    assert seqs == list(range(shown + 2, run.last_event_seq + 1))


def test_the_page_s_stream_ends_once_its_viewer_loses_clearance(demo, client, settings):
    # given a tenant admin, also an auditor, following a waiting run's stream unmasked
    settings.RUN_STREAM_MAX_SECONDS = 1
    run, _action = waiting_run(demo)
    tina = get_user_model().objects.create_user("tina", password=DEMO_PASSWORD)
    for role in (Role.ADMIN, Role.AUDITOR):
        membership_add(actor=None, user=tina, tenant=demo.acme, role=role)
    response = logged_in(client, tina).get(reverse("runs:stream", args=[run.pk]))

    # when she is no longer a tenant admin before the stream sends the log
    Membership.objects.filter(user=tina, tenant=demo.acme, role=Role.ADMIN).delete()
    body = b"".join(response.streaming_content).decode()

    # then the stream ends, sending nothing unmasked (the page she reloads is masked)
    assert body == f"event: end\ndata: {json.dumps({'reason': 'ACCESS_ENDED'})}\n\n"
    page = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    assert EMAIL not in page and MASKED in page


def test_the_registry_history_shows_who_published_what(demo, carol, client):
    page = logged_in(client, carol).get(reverse("registry-history")).content.decode()

    rows = [row.split("</td></tr>")[0].split("</td><td>")[1:] for row in page.split("<tr><td>")[1:]]
    assert ["skill", "weekly-summary@3.2.0", "published", "Changed", "published", "admin"] in [
        row[:6] for row in rows
    ]
    assert ["tool", "mail_send@1.0.0", "draft", "Created", "draft created", "admin"] in [
        row[:6] for row in rows
    ]


def test_the_registry_history_reads_on_after_a_draft_tool_is_deleted(demo, carol, client):
    """A platform admin may delete a draft version and then its tool; the version's history
    records stay, with no tool to name them or tell whose they were."""
    version = tool_version_create(
        actor=demo.admin,
        tenant=demo.globex,
        name="scratch_lookup",
        version="1.0.0",
        **tool_content(),
    )
    tool_version_create(
        actor=demo.admin, tenant=None, name="shared_lookup", version="1.0.0", **tool_content()
    )
    admin = logged_in(client, demo.admin)
    for url in (
        reverse("admin:registry_toolversion_delete", args=[version.pk]),
        reverse("admin:registry_tool_delete", args=[version.tool_id]),
    ):
        assert admin.post(url, {"post": "yes"}).status_code == 302
    client.logout()

    page = logged_in(client, carol).get(reverse("registry-history"))

    assert page.status_code == 200
    assert "scratch_lookup" not in page.content.decode()
    assert "shared_lookup@1.0.0" in page.content.decode()
    assert "mail_send@1.0.0" in page.content.decode()


def test_the_api_masks_the_email_for_an_auditor_and_not_for_the_requester(
    demo, sent_run, carol, settings
):
    settings.RUN_STREAM_MAX_SECONDS = 1

    def api(username: str) -> APIClient:
        _, key = api_token_issue(username=username, password=DEMO_PASSWORD, tenant_slug="acme")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        return client

    auditor, requester = api("carol"), api("alice")
    url = f"/api/v1/runs/{sent_run.pk}"

    seen = json.dumps(
        [
            auditor.get(url).json(),
            auditor.get(f"{url}/events").json(),
            auditor.get("/api/v1/runs").json(),
            b"".join(auditor.get(f"{url}/stream").streaming_content).decode(),
        ]
    )
    assert EMAIL not in seen and MASKED in seen
    own = requester.get(url).json()
    assert own["result"]["output"]["recipient"]["corporate_email"] == EMAIL


def test_no_secret_reaches_the_logs(demo, bob, smtp_server, fake_model, caplog, client):
    caplog.set_level(logging.DEBUG)
    fake = fake_model()
    fake.reply(read_apollo())
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    run, action = waiting_run(demo)
    services.approval_decide(
        action_id=action.pk, approver=bob, decision="approve", payload_hash=action.payload_hash
    )
    services.action_execute(action_id=action.pk)
    _, key = api_token_issue(username="carol", password=DEMO_PASSWORD, tenant_slug="acme")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    api.get(f"/api/v1/runs/{run.pk}/events")
    api.get("/api/v1/runs/not-a-run")
    logged_in(client, demo.admin).get(reverse("runs:detail", args=[run.pk]))

    assert Run.objects.get(pk=run.pk).status == "COMPLETED"
    assert len(fake.requests) == 2
    for secret in (FAKE_API_KEY, key, DEMO_PASSWORD):
        assert secret not in caplog.text


def test_the_dashboard_shows_statuses_latency_approvals_and_cost(demo, sent_run, carol, client):
    waiting_run(demo)
    logged_in(client, carol)

    page = client.get(reverse("runs:dashboard"), {"skill": "weekly-summary@3.2.0"})

    html = page.content.decode()
    assert page.status_code == 200
    assert "<title>COMPLETED: 1</title>" in html
    stages = html.split('id="stages"')[1].split("</table>")[0]
    assert "<td>model.turn</td><td>4</td>" in stages
    assert "<td>tool.call</td><td>5</td>" in stages
    assert "1 decided · 1 approved\n  (100% acceptance)" in html
    assert "No data." in html.split("Tool error categories")[1].split("Cost per day")[0]
    other = client.get(reverse("runs:dashboard"), {"tenant": "globex"}).content.decode()
    assert "COMPLETED" not in other.split("Latency per stage")[0].split("<h2>")[-1]


def test_the_dashboard_counts_decisions_and_not_an_approval_that_expired(
    demo, sent_run, carol, client
):
    _run, expired = waiting_run(demo)
    BusinessAction.objects.filter(pk=expired.pk).update(expires_at=expired.created_at)
    assert services.actions_expire() == 1
    logged_in(client, carol)

    page = client.get(reverse("runs:dashboard"))

    approvals = page.context["figures"].approvals
    assert (approvals["count"], approvals["accepted"], approvals["rate"]) == (1, 1, 100)
    assert "1 decided · 1 approved\n  (100% acceptance)" in page.content.decode()


def test_the_dashboard_counts_the_days_it_shows_and_no_run_before_them(
    demo, sent_run, carol, client
):
    """14 days are today and the 13 before it, each from midnight: a run of the evening before
    the first of them is in no figure (it was in the cost and the approvals, as a 15th day,
    and not in the statuses)."""
    first_day = timezone.localdate() - timedelta(days=13)
    first_midnight = timezone.make_aware(datetime.combine(first_day, time.min))
    Run.objects.filter(pk=sent_run.pk).update(created_at=first_midnight - timedelta(seconds=1))
    logged_in(client, carol)

    page = client.get(reverse("runs:dashboard"))

    figures = page.context["figures"]
    assert (figures.days[0], len(figures.days)) == (first_day, 14)
    assert (figures.statuses, figures.cost, figures.stages) == ({}, {}, [])
    assert figures.approvals["count"] == 0
    assert page.context["skills"] == []


def test_the_dashboard_offers_the_skill_versions_of_its_window_whichever_one_is_shown(
    demo, sent_run, carol, client
):
    later = waiting_run(demo)[0]
    Run.objects.filter(pk=later.pk).update(skill="weekly-summary@3.3.0")
    old = waiting_run(demo)[0]
    Run.objects.filter(pk=old.pk).update(
        skill="weekly-summary@1.0.0", created_at=timezone.now() - timedelta(days=30)
    )
    logged_in(client, carol)

    shown = client.get(reverse("runs:dashboard"), {"skill": "weekly-summary@3.2.0"})
    wider = client.get(reverse("runs:dashboard"), {"days": "31"})
    unseen = client.get(reverse("runs:dashboard"), {"skill": "weekly-summary@0.9.0"})

    assert shown.context["skills"] == ["weekly-summary@3.2.0", "weekly-summary@3.3.0"]
    assert wider.context["skills"] == [
        "weekly-summary@1.0.0",
        "weekly-summary@3.2.0",
        "weekly-summary@3.3.0",
    ]
    assert 'value="weekly-summary@0.9.0" selected' in unseen.content.decode()


def test_the_dashboard_shows_every_version_of_a_skill_named_without_one_as_the_history_does(
    demo, sent_run, carol, client
):
    """Before, the dashboard took only name@version: a bare name, which the history takes as
    every version of the skill, matched no run and showed empty figures."""
    # given runs of weekly-summary 3.2.0 and 3.3.0, and one of another skill whose name it
    # begins with, each completed
    for skill in ("weekly-summary@3.3.0", "weekly-summary-extra@1.0.0"):
        Run.objects.filter(pk=demo_run(demo).pk).update(skill=skill, status="COMPLETED")
    logged_in(client, carol)

    # when the auditor asks for weekly-summary without a version
    page = client.get(reverse("runs:dashboard"), {"skill": "weekly-summary"})

    # then the figures are those of both its versions, and the history lists the same runs
    assert "Ignored" not in page.content.decode()
    assert sum(page.context["figures"].statuses["COMPLETED"].values()) == 2
    history = client.get(reverse("runs:history"), {"skill": "weekly-summary"}).content.decode()
    assert {run.skill for run in Run.objects.all() if str(run.pk) in history} == {
        "weekly-summary@3.2.0",
        "weekly-summary@3.3.0",
    }


def test_the_dashboard_offers_each_skill_version_once_however_many_runs_ran_it(
    demo, sent_run, carol, client
):
    # given two more runs of the sent run's skill version in the window
    waiting_run(demo)
    demo_run(demo)
    logged_in(client, carol)

    # when the auditor opens the dashboard
    page = client.get(reverse("runs:dashboard"))

    # then the version is offered once
    assert page.context["skills"] == ["weekly-summary@3.2.0"]
    assert page.content.decode().count('<option value="weekly-summary@3.2.0"') == 1


def test_the_dashboard_shows_a_day_s_cost_as_the_decimal_it_is(demo, sent_run, carol, client):
    # given a day whose runs cost two thousandths of a cent
    Run.objects.filter(pk=sent_run.pk).update(cost=Decimal("0.000020"))
    logged_in(client, carol)

    # when the auditor opens the dashboard
    page = client.get(reverse("runs:dashboard"))

    # then the cost is written as stored, not as a float in scientific notation
    cost = page.content.decode().split("Cost per day")[1]
    assert f"{timezone.localdate().isoformat()}</text>" in cost
    assert ">0.000020</text>" in cost
    assert "e-05" not in cost


def test_every_span_of_the_run_lies_within_its_root_span(sent_run):
    # given the running example, from its message to its sent mail
    spans = list(Span.objects.filter(run=sent_run))
    root = next(span for span in spans if span.name == "run")

    # then the root span, the run's, covers each stage: a trace viewer draws no stage
    # before the run began or after it ended
    outside = [
        span.name
        for span in spans
        if span.started_at < root.started_at or span.ended_at > root.ended_at
    ]
    assert outside == []
    assert root.duration_ms == int((root.ended_at - root.started_at).total_seconds() * 1000)


def test_a_date_range_that_ends_before_it_starts_is_ignored_and_said_so(
    demo, sent_run, carol, client
):
    # given dates typed the wrong way round: the range holds no day
    today = timezone.localdate()
    logged_in(client, carol)

    # when the auditor filters the history with them
    page = client.get(
        reverse("runs:history"),
        {"date_from": today.isoformat(), "date_to": (today - timedelta(days=7)).isoformat()},
    )

    # then the page says so, rather than that no run matches, and still lists the runs
    html = page.content.decode()
    assert page.status_code == 200
    assert "Ignored, not valid: Date from, Date to." in html
    assert str(sent_run.pk) in html


def test_a_tenant_the_auditor_does_not_audit_is_ignored_and_said_so(demo, sent_run, carol, client):
    # given a filter naming a tenant carol audits no run of (a link from a role she left)
    logged_in(client, carol)

    # when she opens the history and the dashboard with it
    history = client.get(reverse("runs:history"), {"tenant": "globex", "status": "COMPLETED"})
    dashboard = client.get(reverse("runs:dashboard"), {"tenant": "globex"})

    # then the pages say the tenant was not understood, rather than showing "All" tenants
    # with no run, and the other filters still apply
    assert "Ignored, not valid: Tenant." in history.content.decode()
    assert str(sent_run.pk) in history.content.decode()
    assert "Ignored, not valid: Tenant." in dashboard.content.decode()
    assert dashboard.context["figures"].statuses == {"COMPLETED": {timezone.localdate(): 1}}


def test_the_dashboard_s_stages_are_the_steps_of_a_run_and_not_the_run_itself(
    demo, sent_run, carol, client
):
    # given a run that waited an hour for its approval before its mail went out
    root = Span.objects.get(run=sent_run, name="run")
    Span.objects.filter(pk=root.pk).update(duration_ms=root.duration_ms + 3_600_000)
    logged_in(client, carol)

    # when the auditor reads the latency per stage
    page = client.get(reverse("runs:dashboard"))

    # then the stages are those a run goes through; the whole run, with the hour a person
    # took, is not one of them, nor the scale every stage's bar is drawn against
    stages = [row["name"] for row in page.context["figures"].stages]
    assert "run" not in stages
    assert {"ingress", "routing", "model.turn", "tool.call", "action"} <= set(stages)
    assert ">run</text>" not in page.content.decode().split("Latency per stage")[1]
