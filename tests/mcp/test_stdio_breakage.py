"""A stdio MCP server that writes one line far past the response limit is not read to its
end: the call fails as the server's fault at once, and the server's process is ended. One
slow to open its session or to list its tools (the worker's copy stale) makes a call wait no
longer than the call's own timeout, all of it included."""

import json
import os
import sys
import time

import pytest

from registry.mcp.connections import connections
from registry.models import McpServer
from registry.services.mcp import mcp_server_save
from runs.loop import run_execute
from runs.models import ToolCall
from tests.mcp.conftest import ask, call_answered, status_publish

pytestmark = pytest.mark.django_db


@pytest.fixture
def hostile_stdio(demo, tmp_path, monkeypatch):
    """acme's projects server spawned as tests/mcp/hostile_stdio_server.py; `answer(**spec)`
    sets how it answers, and its log is returned with it."""
    spec, log = tmp_path / "spec.json", tmp_path / "server.log"
    spec.write_text("{}")
    log.write_text("")
    monkeypatch.setenv("TEST_HOSTILE_STDIO_SPEC", str(spec))
    monkeypatch.setenv("TEST_HOSTILE_STDIO_LOG", str(log))
    server = McpServer.objects.get(tenant=demo.acme, name="projects")
    server.transport, server.command = McpServer.Transport.STDIO, sys.executable
    server.args = ["-m", "tests.mcp.hostile_stdio_server"]
    server.env = {
        "HOSTILE_STDIO_SPEC": "TEST_HOSTILE_STDIO_SPEC",
        "HOSTILE_STDIO_LOG": "TEST_HOSTILE_STDIO_LOG",
    }
    server.timeout_s = 5
    server = mcp_server_save(server=server, actor=demo.admin)
    yield server, lambda **values: spec.write_text(json.dumps(values)), log
    connections.close_all()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited and was not yet reaped is a zombie: gone all the same.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[-1][0] != "Z"


def test_a_line_far_larger_than_the_response_limit_is_not_read_to_its_end(
    demo, hostile_stdio, settings
):
    # given a stdio server answering with a text of 64 MB on one line, the limit being 1 MB,
    # when a run calls it
    settings.TOOL_RESPONSE_MAX_BYTES = 1024 * 1024
    server, answer, log = hostile_stdio
    call = call_answered(demo, server, answer, size=64 * 1024 * 1024)

    # then the call failed at once as the server's fault, the line left unread far before
    # its end, and the server's process was ended
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert call.envelope["error"]["message"] == "acme/projects answered larger than 4194304 bytes."
    (pid,) = [int(line.split()[1]) for line in log.read_text().splitlines() if "pid" in line]
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert int(log.read_text().split()[-1]) < 16 * 1024 * 1024


def test_a_line_within_the_limit_is_read(demo, hostile_stdio, settings):
    # given a stdio server answering with a text of 3 MB on one line, the line's limit 4 MB
    settings.TOOL_RESPONSE_MAX_BYTES = 1024 * 1024
    server, answer, _ = hostile_stdio
    status_publish(demo, server, timeout_s=10)
    answer(size=3 * 1024 * 1024)
    run = ask(demo)

    run_execute(run_id=str(run.pk))

    # then the line was read whole: past the response limit, the call refuses the answer
    call = ToolCall.objects.get(run=run)
    assert (call.status, call.error_category) == ("failed", "UPSTREAM_ERROR")
    assert call.envelope["error"]["message"] == "The server's answer is larger than 1048576 bytes."


@pytest.mark.parametrize(
    "slow",
    [
        {"list_delay_s": 1.5, "call_delay_s": 1.5},
        {"list_delay_s": 4},
        {"init_delay_s": 1.5, "list_delay_s": 1.5},
    ],
    ids=["listing-then-call", "listing", "handshake-then-listing"],
)
def test_what_a_call_waits_on_before_it_is_sent_counts_in_its_timeout(
    demo, hostile_stdio, settings, slow
):
    # given a call of 2 s on a server whose timeout is 5 s, its tool listing stale, and the
    # server slow to list (and to answer, or to open a new session)
    server, answer, _ = hostile_stdio
    status_publish(demo, server, timeout_s=2)
    settings.MCP_DEFINITION_CACHE_SECONDS = 0
    answer(**slow)
    if "init_delay_s" in slow:
        connections.close_all()
    run = ask(demo)

    # when
    run_execute(run_id=str(run.pk))

    # then the call, all it waited on included, ended at its timeout
    call = ToolCall.objects.get(run=run)
    assert (call.status, call.error_category) == ("failed", "TIMEOUT")
    assert call.envelope["error"]["message"] == "acme/projects did not answer in 2 s."
    assert 1900 <= call.duration_ms < 2500


def test_a_call_within_its_timeout_all_included_is_answered(demo, hostile_stdio, settings):
    server, answer, _ = hostile_stdio
    status_publish(demo, server, timeout_s=2)
    settings.MCP_DEFINITION_CACHE_SECONDS = 0
    answer(list_delay_s=0.5, call_delay_s=0.5)
    run = ask(demo)

    run_execute(run_id=str(run.pk))

    assert ToolCall.objects.get(run=run).status == "completed"
