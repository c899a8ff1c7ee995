"""A field a tool's result contract marks sensitive is hidden from a viewer without clearance
(an auditor) wherever the run shows it: in the call's envelope, and where the host copied it
(the recipient in the result, the action, the events), on the page, in the export, in the API
and in the stream. Its requester sees it."""

import html
import io
import json
import re
import unicodedata

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from examples.models import DirectoryRecord
from registry.choices import ModelProvider
from registry.demo import DEMO_PASSWORD
from registry.models import ModelConfig
from registry.services import tools as tool_services
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue
from runs.api.stream import viewer_shape
from runs.loop import run_execute
from runs.models import Run, RunEvent, ToolCall
from tests.approvals.conftest import waiting_run
from tests.runs import conftest as runs_fixtures
from tests.runs.fake_provider import API_KEY as FAKE_API_KEY
from tests.runs.fake_provider import CREDENTIAL_REF as FAKE_CREDENTIAL_REF
from tests.runs.fake_provider import openai_completion
from tests.runs.test_loop import add_agent, publish_skill, seeded_tool

NAME = "Li Wei"

model_server = runs_fixtures.model_server


@pytest.fixture
def demo_names_sensitive(db, monkeypatch):
    """The demo, with directory_lookup's result contract marking display_name sensitive."""
    create = tool_services.tool_version_create

    def with_contract(**spec):
        if spec["name"] == "directory_lookup":
            spec["result_contract"] = {"sensitive_fields": ["display_name"]}
        return create(**spec)

    with monkeypatch.context() as patched:
        patched.setattr(tool_services, "tool_version_create", with_contract)
        call_command("seed_demo", stdout=io.StringIO())
    return runs_fixtures.demo_found()


def api_as(username: str) -> APIClient:
    _, key = api_token_issue(username=username, password=DEMO_PASSWORD, tenant_slug="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def shown_everywhere(run: Run, page: Client, api: APIClient) -> dict[str, str]:
    """What a signed-in page client and an API client are shown of the run, by where."""
    return {
        "page": page.get(reverse("runs:detail", args=[run.pk])).content.decode(),
        "export": page.get(reverse("runs:export", args=[run.pk])).content.decode(),
        "stream": b"".join(
            page.get(reverse("runs:stream", args=[run.pk])).streaming_content
        ).decode(),
        "api.run": api.get(f"/api/v1/runs/{run.pk}").content.decode(),
        "api.runs": api.get("/api/v1/runs").content.decode(),
        "api.events": api.get(f"/api/v1/runs/{run.pk}/events").content.decode(),
        "api.stream": b"".join(
            api.get(
                f"/api/v1/runs/{run.pk}/stream", HTTP_ACCEPT="text/event-stream"
            ).streaming_content
        ).decode(),
    }


def test_a_sensitive_field_is_hidden_from_an_auditor_wherever_the_run_shows_it(
    demo_names_sensitive, client, settings
):
    settings.RUN_STREAM_MAX_SECONDS = 1  # the run waits: its stream would not end
    run, _ = waiting_run(demo_names_sensitive)
    assert client.login(username="carol", password=DEMO_PASSWORD)

    shown = shown_everywhere(run, client, api_as("carol"))

    assert [where for where, text in shown.items() if NAME in text] == []
    record = json.loads(shown["export"])
    assert record["result"]["recipient"]["display_name"] == "[redacted]"
    own = api_as("alice").get(f"/api/v1/runs/{run.pk}").json()
    assert own["result"]["recipient"]["display_name"] == NAME


def fake_model(demo, model_server, monkeypatch) -> None:
    """Point the demo's weekly-reporter at the fake provider."""
    monkeypatch.setenv(FAKE_CREDENTIAL_REF, FAKE_API_KEY)
    demo.agent.model_config = registry_object_save(
        instance=ModelConfig(
            tenant=None,
            name="fake-openai",
            provider=ModelProvider.OPENAI_COMPATIBLE,
            model_name="fake-gpt",
            base_url=f"http://127.0.0.1:{model_server.port}/v1",
            credential_ref=FAKE_CREDENTIAL_REF,
        ),
        actor=demo.admin,
    )
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="fake model")


def test_a_sensitive_field_a_model_copied_into_a_later_call_is_hidden_too(
    demo_names_sensitive, model_server, monkeypatch, client
):
    # given a model that passes the name on as an argument of its next call
    demo = demo_names_sensitive
    fake_model(demo, model_server, monkeypatch)
    arguments = {"project_id": "apollo", "display_name": NAME}
    model_server.reply(
        openai_completion(tool_calls=(("call_1", "project_search", json.dumps(arguments)),))
    )
    model_server.reply(openai_completion(content="Done."))
    run = runs_fixtures.demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))

    # when the auditor exports the run, then the name is nowhere in it
    assert client.login(username="carol", password=DEMO_PASSWORD)
    record = json.loads(client.get(reverse("runs:export", args=[run.pk])).content)
    assert NAME not in json.dumps(record, ensure_ascii=False)
    (copied,) = [call for call in record["tool_calls"] if call["call_id"] == "call_1"]
    assert copied["arguments"]["display_name"] == "[redacted]"


def test_a_sensitive_value_the_model_wrote_into_text_is_masked_for_an_auditor_only(
    demo_names_sensitive, model_server, monkeypatch, client, settings
):
    # given a model that writes the recipient's name, which the directory returned under a
    # sensitive field, into the body of its draft
    settings.RUN_STREAM_MAX_SECONDS = 1  # the run waits: its stream would not end
    demo = demo_names_sensitive
    fake_model(demo, model_server, monkeypatch)
    model_server.reply(runs_fixtures.read_apollo())
    draft = runs_fixtures.apollo_draft(body=f"Dear {NAME}, here is the week.")
    model_server.reply(openai_completion(content=json.dumps(draft)))
    run, _ = waiting_run(demo)

    # when the auditor without clearance reads the run anywhere, then the name is nowhere
    assert client.login(username="carol", password=DEMO_PASSWORD)
    by_carol = shown_everywhere(run, client, api_as("carol"))
    assert [where for where, text in by_carol.items() if NAME in text] == []
    assert "Dear [redacted], here is the week." in by_carol["export"]
    assert "Dear [redacted], here is the week." in by_carol["api.events"]
    # and a viewer with clearance, and the run's requester, still read it
    client.force_login(demo.admin)
    by_admin = shown_everywhere(run, client, api_as("admin"))
    assert [where for where, text in by_admin.items() if NAME not in text] == []
    own = api_as("alice")
    for url in (f"/api/v1/runs/{run.pk}/events", f"/api/v1/runs/{run.pk}/stream"):
        assert (
            f"Dear {NAME}, here is the week."
            in b"".join(
                own.get(url, HTTP_ACCEPT="text/event-stream").streaming_content
                if url.endswith("stream")
                else [own.get(url).content]
            ).decode()
        )


def test_a_stream_that_began_before_the_tools_answered_masks_what_the_model_copies_after(
    demo_names_sensitive, model_server, monkeypatch
):
    # given a viewer without clearance who follows the run from before its first step
    demo = demo_names_sensitive
    fake_model(demo, model_server, monkeypatch)
    model_server.reply(runs_fixtures.read_apollo())
    draft = runs_fixtures.apollo_draft(body=f"Dear {NAME}, here is the week.")
    model_server.reply(openai_completion(content=json.dumps(draft)))
    run = runs_fixtures.demo_run(demo, project_id="apollo")
    shape = viewer_shape(Run.objects.get(pk=run.pk), cleared=False)

    # when the run writes the name the directory returned into its draft
    run_execute(run_id=str(run.pk))

    # then the events the stream sends, shaped in their order, do not hold it
    events = list(RunEvent.objects.filter(run=run).order_by("seq"))
    shown = json.dumps([shape(event) for event in events], ensure_ascii=False)
    assert "Dear [redacted], here is the week." in shown
    assert NAME not in shown


def test_a_recipient_confirmed_in_an_earlier_run_of_the_session_is_masked_in_text_too(
    demo_names_sensitive, model_server, monkeypatch, client, settings
):
    # given alice chose the recipient in an earlier run of her session: the directory
    # returned the name there, and the next run reuses the confirmation without a lookup
    settings.RUN_STREAM_MAX_SECONDS = 1  # the run waits: its stream would not end
    demo = demo_names_sensitive
    first = runs_fixtures.demo_run(demo, project_id="apollo", recipient_record_id="dir-1001")
    run_execute(run_id=str(first.pk))
    fake_model(demo, model_server, monkeypatch)
    model_server.reply(runs_fixtures.read_apollo())
    draft = runs_fixtures.apollo_draft(body=f"Dear {NAME}, here is the week.")
    model_server.reply(openai_completion(content=json.dumps(draft)))
    run = runs_fixtures.demo_run(demo, session_id=first.session_id)
    followed = viewer_shape(Run.objects.get(pk=run.pk), cleared=False)

    # when the model writes the name into the draft of that next run
    run_execute(run_id=str(run.pk))

    # then the auditor without clearance reads it nowhere, nor in a stream that began first
    run = Run.objects.get(pk=run.pk)
    assert run.status == "WAITING_APPROVAL"
    assert not ToolCall.objects.filter(run=run, call_id="host-recipient").exists()
    assert client.login(username="carol", password=DEMO_PASSWORD)
    by_carol = shown_everywhere(run, client, api_as("carol"))
    assert [where for where, text in by_carol.items() if NAME in text] == []
    assert "Dear [redacted], here is the week." in by_carol["export"]
    events = RunEvent.objects.filter(run=run).order_by("seq")
    assert NAME not in json.dumps([followed(event) for event in events], ensure_ascii=False)
    # and the requester still reads it
    assert (
        f"Dear {NAME}, here is the week."
        in api_as("alice").get(f"/api/v1/runs/{run.pk}/events").content.decode()
    )


def agent_on_the_fake_model(demo, name: str, tool: str) -> None:
    """An acme agent `name` on the fake provider, whose skill pins the seeded `tool` and binds
    no workflow: the generic agent answers it."""
    skill = publish_skill(
        demo,
        f"{name}-skill",
        "1.0.0",
        tool_versions=[seeded_tool(demo, tool)],
        workflow="",
        required_inputs=["project_scope"],
        rules=[{"id": "evidence-only", "scope": "skill", "priority": 100, "text": "Cite."}],
    )
    agent = add_agent(demo, name, skill)
    agent.model_config = demo.agent.model_config
    registry_object_save(instance=agent, actor=demo.admin, reason="fake model")


@pytest.mark.parametrize("next_tool", ["directory_lookup", "project_search"])
def test_what_an_earlier_run_of_the_session_said_back_is_masked_in_the_next_one(
    demo_names_sensitive, model_server, monkeypatch, client, settings, next_tool
):
    # given an agent that looks up Apollo's lead and names them in its answer
    settings.RUN_STREAM_MAX_SECONDS = 1
    demo = demo_names_sensitive
    fake_model(demo, model_server, monkeypatch)
    agent_on_the_fake_model(demo, "lead-finder", "directory_lookup")
    lookup = json.dumps({"project_id": "apollo", "role": "研发负责人"})
    model_server.reply(openai_completion(tool_calls=(("call_1", "directory_lookup", lookup),)))
    model_server.reply(openai_completion(content=f"Apollo's R&D lead is {NAME}."))
    first = runs_fixtures.demo_run(
        demo, text="Who leads Apollo?", agent="lead-finder", project_id="apollo"
    )
    run_execute(run_id=str(first.pk))

    # when the next run of the session (of an agent whose tools may hide no field), which
    # calls no tool, has that answer in its history and its model repeats the name
    agent_on_the_fake_model(demo, "follow-up", next_tool)
    model_server.reply(openai_completion(content=f"As I said: {NAME}."))
    run = runs_fixtures.demo_run(
        demo,
        text="Who was it again?",
        agent="follow-up",
        project_id="apollo",
        session_id=first.session_id,
    )
    run_execute(run_id=str(run.pk))
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.state["history"][0]["reply"]) == (
        "COMPLETED",
        f"Apollo's R&D lead is {NAME}.",
    )

    # then the auditor without clearance reads the name in neither run, anywhere
    assert client.login(username="carol", password=DEMO_PASSWORD)
    for shown in (Run.objects.get(pk=first.pk), run):
        by_carol = shown_everywhere(shown, client, api_as("carol"))
        assert [where for where, text in by_carol.items() if NAME in text] == []
    assert "As I said: [redacted]." in by_carol["api.run"]
    # and a viewer with clearance still reads it
    client.force_login(demo.admin)
    assert NAME in client.get(reverse("runs:detail", args=[run.pk])).content.decode()


ACCENTED = "Zoë Brandt"
READ = ACCENTED.casefold()


def revealed(text: str) -> str:
    """`text` as a reader takes it in: JSON's \\u escapes and HTML's character references
    read (as often as they were applied: a page escapes the HTML a draft holds), in one
    Unicode normal form (NFC) and one case."""
    while True:
        read = html.unescape(
            re.sub(r"\\+u([0-9a-fA-F]{4})", lambda match: chr(int(match.group(1), 16)), text)
        )
        if read == text:
            return unicodedata.normalize("NFC", text).casefold()
        text = read


@pytest.mark.parametrize(
    ("written", "content"),
    [
        # a model that answers JSON with every letter beyond ASCII escaped: "Zo\u00eb"
        (ACCENTED, lambda draft: json.dumps(draft)),
        # the same letter as "e" and a combining diaeresis (NFD)
        (unicodedata.normalize("NFD", ACCENTED), lambda draft: json.dumps(draft)),
        (
            unicodedata.normalize("NFD", ACCENTED),
            lambda draft: json.dumps(draft, ensure_ascii=False),
        ),
        # an HTML body: "Zo&euml; Brandt", "Zo&#235; Brandt"
        ("Zo&euml; Brandt", lambda draft: json.dumps(draft, ensure_ascii=False)),
        ("ZO&#xCB; brandt", lambda draft: json.dumps(draft, ensure_ascii=False)),
    ],
    ids=["json-escaped", "nfd-json-escaped", "nfd", "html-named", "html-numeric"],
)
def test_a_sensitive_value_beyond_ascii_is_masked_in_any_form_the_model_wrote_it(
    demo_names_sensitive, model_server, monkeypatch, client, settings, written, content
):
    # given a directory that returns a name with a letter beyond ASCII, under the sensitive
    # field, and a model that writes it into its draft escaped or in another normal form
    settings.RUN_STREAM_MAX_SECONDS = 1  # the run waits: its stream would not end
    demo = demo_names_sensitive
    DirectoryRecord.objects.filter(display_name=NAME).update(display_name=ACCENTED)
    fake_model(demo, model_server, monkeypatch)
    model_server.reply(runs_fixtures.read_apollo())
    draft = runs_fixtures.apollo_draft(body=f"Dear {written}, here is the week.")
    model_server.reply(openai_completion(content=content(draft)))
    run, _ = waiting_run(demo)

    # when the auditor without clearance reads the run anywhere, then the name is nowhere,
    # in no form
    assert client.login(username="carol", password=DEMO_PASSWORD)
    by_carol = shown_everywhere(run, client, api_as("carol"))
    assert [where for where, text in by_carol.items() if READ in revealed(text)] == []
    record = json.loads(by_carol["export"])
    (drafted,) = [event for event in record["events"] if event["type"] == "draft.created"]
    assert drafted["payload"]["draft"]["body"] == "Dear [redacted], here is the week."
    # and a viewer with clearance reads it as the model wrote it
    client.force_login(demo.admin)
    by_admin = shown_everywhere(run, client, api_as("admin"))
    assert [where for where, text in by_admin.items() if READ not in revealed(text)] == []
