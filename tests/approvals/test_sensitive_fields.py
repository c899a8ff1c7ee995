"""A field a tool's result contract marks sensitive is hidden from a viewer without clearance
(an auditor) wherever the run shows it: in the call's envelope, and where the host copied it
(the recipient in the result, the action, the events), on the page, in the export, in the API
and in the stream. Its requester sees it."""

import io
import json

import pytest
from django.core.management import call_command
from django.urls import reverse
from rest_framework.test import APIClient

from registry.demo import DEMO_PASSWORD
from registry.services import tools as tool_services
from registry.services.tenancy import api_token_issue
from tests.approvals.conftest import waiting_run
from tests.runs import conftest as runs_fixtures

NAME = "Li Wei"


@pytest.fixture
def demo_names_sensitive(db, monkeypatch):
    """The demo, with directory_lookup's result contract marking display_name sensitive."""
    create = tool_services.tool_version_create

    def with_contract(**spec):
        if spec["name"] == "directory_lookup":
            spec["result_contract"] = {"sensitive_fields": ["display_name"]}
        return create(**spec)

    monkeypatch.setattr(tool_services, "tool_version_create", with_contract)
    call_command("seed_demo", stdout=io.StringIO())
    monkeypatch.undo()
    return runs_fixtures.demo.__wrapped__(db)


def api_as(username: str) -> APIClient:
    _, key = api_token_issue(username=username, password=DEMO_PASSWORD, tenant_slug="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def test_a_sensitive_field_is_hidden_from_an_auditor_wherever_the_run_shows_it(
    demo_names_sensitive, client, settings
):
    settings.RUN_STREAM_MAX_SECONDS = 1  # the run waits: its stream would not end
    run, _ = waiting_run(demo_names_sensitive)
    assert client.login(username="carol", password=DEMO_PASSWORD)
    carol = api_as("carol")

    shown = {
        "page": client.get(reverse("runs:detail", args=[run.pk])).content.decode(),
        "export": client.get(reverse("runs:export", args=[run.pk])).content.decode(),
        "api.run": carol.get(f"/api/v1/runs/{run.pk}").content.decode(),
        "api.events": carol.get(f"/api/v1/runs/{run.pk}/events").content.decode(),
        "api.stream": b"".join(
            carol.get(
                f"/api/v1/runs/{run.pk}/stream", HTTP_ACCEPT="text/event-stream"
            ).streaming_content
        ).decode(),
    }

    assert [where for where, text in shown.items() if NAME in text] == []
    record = json.loads(shown["export"])
    assert record["result"]["recipient"]["display_name"] == "[redacted]"
    own = api_as("alice").get(f"/api/v1/runs/{run.pk}").json()
    assert own["result"]["recipient"]["display_name"] == NAME
