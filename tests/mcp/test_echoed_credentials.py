"""An MCP server's credential echoed back where the adapter reads it, in an error message or
in the URI of a resource it returns, is in nothing the run keeps, shows or gives the model.
(The server's answers are set on the client session: the example server sends neither.)"""

import json

import mcp.client.session
import pytest
from mcp import types as mcp_types
from mcp.shared.exceptions import McpError

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


@pytest.fixture
def server_answers(monkeypatch):
    """Make the server's answer to tools/call the one given."""

    def answer(reply) -> None:
        async def call_tool(self, name, arguments=None, *args, **kwargs):
            if isinstance(reply, Exception):
                raise reply
            return reply

        monkeypatch.setattr(mcp.client.session.ClientSession, "call_tool", call_tool)

    return answer


def test_an_error_message_quoting_the_credential_is_stripped(
    demo, projects, published_status, server_answers
):
    # given a server that refuses the call, quoting the authorization it received
    published_status()
    server_answers(
        McpError(mcp_types.ErrorData(code=-32602, message=f"invalid params; auth was {TOKEN}"))
    )
    run = ask(demo)

    # when
    run_execute(run_id=str(run.pk))

    # then the call failed, with the server's message, and the credential is nowhere
    (call,) = ToolCall.objects.filter(run=run)
    assert call.status == "failed"
    assert "invalid params; auth was [redacted]" in call.envelope["error"]["message"]
    assert TOKEN not in kept(run)


def test_a_resource_uri_carrying_the_credential_is_stripped_and_not_shown(
    demo, projects, published_status, server_answers, client
):
    # given a server whose result embeds a resource named by a URI carrying its credential
    published_status()
    server_answers(
        mcp_types.CallToolResult(
            content=[
                mcp_types.EmbeddedResource(
                    type="resource",
                    resource=mcp_types.TextResourceContents(
                        uri=f"https://files.example/apollo.json?access_token={TOKEN}",
                        mimeType="application/json",
                        text='{"health": "green"}',
                    ),
                )
            ],
            structuredContent=None,
            isError=False,
        )
    )
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
