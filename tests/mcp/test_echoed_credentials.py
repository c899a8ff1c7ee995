"""An MCP server's credential echoed back where the adapter reads it, in an error message or
in the URI of a resource it returns, is in nothing the run keeps, shows or gives the model.
The example server, really running over stdio and over HTTP, sends the failed call, the
JSON-RPC error and the resource (`overrides`)."""

import json

import pytest

from registry.demo import DEMO_PASSWORD
from runs.loop import run_execute
from runs.models import Run, RunEvent, Source, ToolCall
from tests.mcp.conftest import TOKEN, ask

pytestmark = pytest.mark.django_db


def kept(run: Run) -> str:
    """Everything the run keeps, as one text."""
    run.refresh_from_db()
    return json.dumps(
        [
            list(RunEvent.objects.filter(run=run).values_list("payload", flat=True)),
            list(ToolCall.objects.filter(run=run).values_list("envelope", flat=True)),
            list(Source.objects.filter(run=run).values_list("reference", "content")),
            run.transcript,
            run.result,
        ],
        ensure_ascii=False,
    )


def test_a_failed_call_quoting_the_credential_is_stripped(
    demo, projects, published_status, overrides
):
    # given a server that fails the call, quoting the authorization it received
    published_status()
    overrides(echo_credential="error")
    run = ask(demo)

    # when
    run_execute(run_id=str(run.pk))

    # then the call came back failed, with the server's message, and the credential is nowhere
    (call,) = ToolCall.objects.filter(run=run)
    assert call.envelope["business_status"] == "failed", call.envelope
    assert call.envelope["raw"]["content"] == [
        {
            "type": "text",
            "text": "Error executing tool project_status: invalid params; auth was [redacted]",
        }
    ]
    assert TOKEN not in kept(run)


def test_a_protocol_error_quoting_the_credential_is_stripped(
    demo, projects, published_status, overrides
):
    # given a server that answers tools/call with a JSON-RPC error quoting the authorization
    published_status()
    overrides(echo_credential="protocol_error")
    run = ask(demo)

    # when
    run_execute(run_id=str(run.pk))

    # then the call failed at the protocol, with the server's message, and the credential is
    # nowhere
    (call,) = ToolCall.objects.filter(run=run)
    assert call.status == "failed"
    assert call.envelope["protocol_status"] == "error", call.envelope
    assert call.envelope["error"]["message"] == "acme/projects: invalid params; auth was [redacted]"
    assert TOKEN not in kept(run)


def test_a_resource_uri_carrying_the_credential_is_stripped_and_not_shown(
    demo, projects, published_status, overrides, client
):
    # given a server whose result embeds a resource named by a URI carrying its credential
    published_status()
    overrides(echo_credential="resource_uri")
    run = ask(demo)

    # when
    run_execute(run_id=str(run.pk))

    # then the resource is evidence under a reference without the credential
    (call,) = ToolCall.objects.filter(run=run)
    assert call.status == "completed", call.envelope
    assert Source.objects.filter(
        run=run, reference="https://files.example/apollo.json?access_token=[redacted]"
    ).exists()
    assert TOKEN not in kept(run)
    # and the auditor's page shows it so
    assert client.login(username="carol", password=DEMO_PASSWORD)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "files.example/apollo.json" in page
    assert TOKEN not in page
