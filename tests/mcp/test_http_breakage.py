"""MCP servers over streamable HTTP that break mid-session: one restarted (a deploy) is
reached again; a request it no longer knows the session of is sent again on a new one, its
caller told how that ended; a call that timed out leaves no request open; an answer that
cannot be read, or an HTTP error, fails the call at once; an answer outside the protocol is
the server's fault; one far past the response limit, or compressed, is not read to its end;
and nothing the SDK logs quotes what a server sent."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.urls import reverse

from registry.mcp.connections import (
    Deadline,
    McpTimeout,
    McpUnavailable,
    connections,
    endpoint_for,
)
from registry.models import McpServer
from registry.services.mcp import mcp_server_save
from runs.loop import run_execute
from runs.models import ToolCall
from tests.mcp.conftest import (
    TOKEN,
    TOKEN_REF,
    _free_port,
    ask,
    call_answered,
    status_publish,
    wait_for_port,
)

pytestmark = pytest.mark.django_db


def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=django_settings.BASE_DIR, env={**os.environ, **env}
    )


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(10)


def _over_http(demo, url: str, settings) -> McpServer:
    """acme's projects server, moved to `url` with the bearer token."""
    settings.TENANT_CREDENTIALS = {"acme": [TOKEN_REF]}
    server = McpServer.objects.get(tenant=demo.acme, name="projects")
    server.transport = McpServer.Transport.STREAMABLE_HTTP
    server.url = url
    server.credential_ref = TOKEN_REF
    server.timeout_s = 3
    return mcp_server_save(server=server, actor=demo.admin)


@pytest.fixture
def restartable(monkeypatch):
    """The example server over HTTP on a port of its own, and a function that restarts it."""
    monkeypatch.setenv(TOKEN_REF, TOKEN)
    port = _free_port()
    args = ["-m", "examples.mcp_server", "--http", "--port", str(port)]
    processes = [_spawn(args, {"PROJECTS_MCP_TOKEN": TOKEN})]
    wait_for_port(port)

    def restart() -> None:
        _stop(processes[-1])
        processes.append(_spawn(args, {"PROJECTS_MCP_TOKEN": TOKEN}))
        wait_for_port(port)

    yield f"http://127.0.0.1:{port}/mcp", restart
    connections.close_all()
    _stop(processes[-1])


@pytest.fixture
def hostile_http(tmp_path, monkeypatch):
    """tests/mcp/hostile_http_server.py on a port of its own, and `answer(**call)`, which sets
    how it answers tools/call."""
    monkeypatch.setenv(TOKEN_REF, TOKEN)
    spec, log = tmp_path / "spec.json", tmp_path / "calls.log"
    spec.write_text("{}")
    log.write_text("")
    port = _free_port()
    process = _spawn(
        ["-m", "tests.mcp.hostile_http_server", str(port)],
        {"HOSTILE_HTTP_SPEC": str(spec), "HOSTILE_HTTP_LOG": str(log)},
    )
    wait_for_port(port)
    yield f"http://127.0.0.1:{port}/mcp", lambda **call: spec.write_text(json.dumps(call))
    connections.close_all()
    _stop(process)


def test_a_restarted_server_is_reached_again_with_a_new_session(demo, restartable, settings):
    url, restart = restartable
    status_publish(demo, _over_http(demo, url, settings))
    first = ask(demo)
    run_execute(run_id=str(first.pk))
    assert ToolCall.objects.get(run=first).status == "completed"

    # a deploy: the new process knows no session of the old one
    restart()
    second = ask(demo)
    run_execute(run_id=str(second.pk))

    call = ToolCall.objects.get(run=second)
    assert call.status == "completed", (call.error_category, call.envelope["error"])
    assert call.attempts == 1


def test_calls_that_timed_out_leave_no_request_open(demo, hostile_http, settings):
    # given a server whose answer is an SSE stream that never ends
    url, answer = hostile_http
    endpoint = endpoint_for(_over_http(demo, url, settings))
    connections.tools(endpoint)
    answer(sse_forever=True)

    def call(_) -> str:
        try:
            connections.call_tool(
                endpoint, "project_status", {}, meta={}, deadline=Deadline.after(1)
            )
        except McpTimeout:
            return "timeout"
        return "ok"

    # when more calls time out than the HTTP client's pool holds connections (100)
    with ThreadPoolExecutor(20) as pool:
        assert set(pool.map(call, range(110))) == {"timeout"}

    # then none of their streams is still open: once the server is well, calls succeed
    answer()
    assert call(0) == "ok"


def test_an_unreadable_answer_quoting_the_credential_fails_at_once_and_is_not_logged(
    demo, hostile_http, settings, caplog
):
    url, answer = hostile_http
    status_publish(demo, _over_http(demo, url, settings), timeout_s=10)
    # JSON, but not JSON-RPC, quoting the Authorization header it was sent
    answer(body='{"e": "{auth}"}')
    run = ask(demo)

    started = time.monotonic()
    run_execute(run_id=str(run.pk))

    call = ToolCall.objects.get(run=run)
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert time.monotonic() - started < 5
    assert "MCP SDK" in caplog.text
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (
            {"status": 500, "body": "Internal Server Error", "content_type": "text/plain"},
            "the connection broke (HTTP 500)",
        ),
        (
            {"status": 401, "body": "", "content_type": "text/plain"},
            "the connection broke (HTTP 401)",
        ),
        (
            {"status": 200, "body": "<html>maintenance</html>", "content_type": "text/html"},
            "its answer could not be read",
        ),
    ],
    ids=["http-500", "http-401", "html"],
)
def test_an_http_error_mid_session_fails_the_call_at_once(
    demo, hostile_http, settings, call, reason
):
    url, answer = hostile_http

    tool_call = call_answered(demo, _over_http(demo, url, settings), answer, **call)

    assert (tool_call.status, tool_call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert tool_call.envelope["error"]["message"] == f"acme/projects: {reason}."


ANSWERED = '{"jsonrpc": "2.0", "id": {id}, "result": {"content": [{"type": "text", "text": "ok"}]}}'


@pytest.mark.parametrize(
    "call",
    [
        {"body": ": keep-alive\n\n", "content_type": "text/event-stream"},
        {
            "body": f"event: message\ndata: {ANSWERED}\n\n",
            "content_type": "text/event-stream; charset=rot13",
        },
    ],
    ids=["ended", "charset-of-no-text"],
)
def test_an_sse_answer_that_ends_without_the_result_fails_the_call_at_once(
    demo, hostile_http, settings, call
):
    # given a server whose SSE answer to the call ends without the call's result, or names
    # as its charset a codec that decodes no text, when a run calls it
    url, answer = hostile_http
    tool_call = call_answered(demo, _over_http(demo, url, settings), answer, **call)

    # then the call failed as the server's fault, not at its timeout
    assert (tool_call.status, tool_call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert tool_call.envelope["error"]["message"] == (
        "acme/projects: its answer ended without a result."
    )

    # and once the server answers again, the next call gets its result
    answer()
    run = ask(demo)
    run_execute(run_id=str(run.pk))
    assert ToolCall.objects.get(run=run).status == "completed"


def _discovered_in_admin(client: Client, server):
    """The page after the admin's discover action on `server`."""
    return client.post(
        reverse("admin:registry_mcpserver_changelist"),
        {"action": "discover", "_selected_action": [str(server.pk)]},
        follow=True,
    )


def test_a_listing_outside_the_protocol_marks_the_server_unhealthy_in_admin(
    demo, hostile_http, settings, caplog
):
    # given a server answering tools/list in JSON-RPC, its tools not a list but the
    # Authorization header it was sent
    url, answer = hostile_http
    server = _over_http(demo, url, settings)
    answer(
        method="tools/list", body='{"jsonrpc": "2.0", "id": {id}, "result": {"tools": "{auth}"}}'
    )
    client = Client(raise_request_exception=False)
    client.force_login(demo.admin)

    # when an admin discovers it
    response = _discovered_in_admin(client, server)

    # then discovery failed as the server's fault, quoting nothing it sent
    assert response.status_code == 200
    expected = "acme/projects answered with a ListToolsResult the protocol does not allow."
    assert [(m.level_tag, m.message) for m in response.context["messages"]] == [("error", expected)]
    server.refresh_from_db()
    assert (server.health, server.health_detail) == ("unhealthy", expected)
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(
    ("handshake", "reason"),
    [
        (
            {"body": "<html>maintenance {auth}</html>", "content_type": "text/html"},
            "its answer could not be read",
        ),
        ({"body": '{"e": "{auth}"}'}, "its answer could not be read"),
        ({"size": 8 * 1024 * 1024}, "larger than 4194304 bytes"),
        ({"status": 503, "body": "down", "content_type": "text/plain"}, "HTTP 503"),
    ],
    ids=["html", "not-json-rpc", "too-large", "http-503"],
)
def test_a_handshake_the_server_answers_unreadably_says_why_in_admin(
    demo, hostile_http, settings, handshake, reason, caplog
):
    # given a server answering the handshake with a page, JSON that is not JSON-RPC, an
    # answer past the limit or an HTTP error
    settings.TOOL_RESPONSE_MAX_BYTES = 1024 * 1024
    url, answer = hostile_http
    server = _over_http(demo, url, settings)
    answer(method="initialize", **handshake)
    client = Client(raise_request_exception=False)
    client.force_login(demo.admin)

    # when an admin discovers it
    response = _discovered_in_admin(client, server)

    # then the admin is told what the server did, not that something was cancelled
    expected = f"acme/projects: could not connect ({reason})."
    assert [(m.level_tag, m.message) for m in response.context["messages"]] == [("error", expected)]
    server.refresh_from_db()
    assert (server.health, server.health_detail) == ("unhealthy", expected)
    assert TOKEN not in caplog.text


def test_a_listing_refused_quoting_the_credential_leaves_it_out_of_the_server_s_health(
    demo, hostile_http, settings
):
    # given a server answering tools/list with a JSON-RPC error quoting its Authorization
    url, answer = hostile_http
    server = _over_http(demo, url, settings)
    answer(
        method="tools/list",
        body='{"jsonrpc": "2.0", "id": {id}, "error": {"code": -32603, "message": "auth {auth}"}}',
    )
    client = Client(raise_request_exception=False)
    client.force_login(demo.admin)

    # when an admin discovers it
    response = _discovered_in_admin(client, server)

    # then its message is shown and kept without the credential
    expected = "acme/projects: auth Bearer [redacted]"
    assert [(m.level_tag, m.message) for m in response.context["messages"]] == [("error", expected)]
    server.refresh_from_db()
    assert (server.health, server.health_detail) == ("unhealthy", expected)
    page = client.get(reverse("admin:registry_mcpserver_change", args=[server.pk]))
    assert page.status_code == 200
    assert TOKEN not in page.content.decode()


def test_a_call_answered_outside_the_protocol_fails_as_the_server_s_fault(
    demo, hostile_http, settings
):
    url, answer = hostile_http
    status_publish(demo, _over_http(demo, url, settings), timeout_s=10)
    # JSON-RPC, the request's id, but content that is not a list of blocks
    answer(body='{"jsonrpc": "2.0", "id": {id}, "result": {"content": "{auth}"}}')
    run = ask(demo)

    run_execute(run_id=str(run.pk))

    call = ToolCall.objects.get(run=run)
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert TOKEN not in json.dumps(call.envelope)


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
def test_an_answer_far_larger_than_the_response_limit_is_not_read_to_its_end(
    demo, hostile_http, settings, tmp_path, sse
):
    # given a server answering with a text of 64 MB, the limit being 1 MB, when a run calls it
    settings.TOOL_RESPONSE_MAX_BYTES = 1024 * 1024
    url, answer = hostile_http
    server = _over_http(demo, url, settings)
    call = call_answered(demo, server, answer, size=64 * 1024 * 1024, sse=sse)

    # then the call failed at once, the answer left unread far before its end
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert call.envelope["error"]["message"] == "acme/projects answered larger than 4194304 bytes."
    log = tmp_path / "calls.log"
    deadline = time.monotonic() + 5
    while "sent" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = int(log.read_text().split("sent ")[-1])
    assert sent < 16 * 1024 * 1024


def test_a_compressed_answer_is_not_inflated(demo, hostile_http, settings):
    # given a server answering, unasked, with 64 MB of text compressed to a few kB
    settings.TOOL_RESPONSE_MAX_BYTES = 1024 * 1024
    url, answer = hostile_http
    status_publish(demo, _over_http(demo, url, settings), timeout_s=10)
    answer(size=64 * 1024 * 1024, gzip=True)
    run = ask(demo)

    run_execute(run_id=str(run.pk))

    call = ToolCall.objects.get(run=run)
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert call.envelope["error"]["message"] == (
        "acme/projects answered in gzip encoding, which was not asked for."
    )


def test_a_request_sent_again_on_a_new_session_is_waited_for_to_its_own_outcome(
    demo, hostile_http, settings, tmp_path
):
    """A request the server answers, late, with "no such session" (HTTP 404) is sent again
    once on a new session; its caller waits for both, and is told how the second ended. The
    two answers come late enough that together they take longer than one handshake and one
    request may: a caller that waited only that long would be told that the server did not
    answer in time, not what it answered. (Hence the test's length: about 13 s.)"""
    url, answer = hostile_http
    server = _over_http(demo, url, settings)
    server.timeout_s = 1
    endpoint = endpoint_for(server)
    answer(method="resources/read", status=404, body="", delay_s=6.5)

    with pytest.raises(McpUnavailable) as raised:
        connections.read_resource(endpoint, "projects://apollo/notes", meta={}, timeout_s=6.5)

    assert str(raised.value) == "acme/projects ended the session."
    assert (tmp_path / "calls.log").read_text() == "call\ncall\n"
