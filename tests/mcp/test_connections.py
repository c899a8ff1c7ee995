"""One client session per server per process, shared safely: concurrent calls on it stay
paired with their requests, a crashed server is replaced on the next call, and a server that
never completes its handshake costs a bounded wait and leaves nothing behind."""

import asyncio
import gc
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from registry.mcp.connections import (
    Deadline,
    McpTimeout,
    McpUnavailable,
    connections,
    endpoint_for,
)
from registry.models import McpServer
from tests.mcp.conftest import TOKEN, over_stdio

IDENTITY = {"agentgov/tenant": "acme", "agentgov/actor": "alice"}


def example_servers() -> list[int]:
    """Pids of the stdio example servers this process spawned (not the HTTP one)."""
    return children(b"examples.mcp_server", but_not=b"--http")


def children(argument: bytes, *, but_not: bytes | None = None) -> list[int]:
    """Pids of the processes this process spawned with `argument` (and not `but_not`) on
    their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if (
            parent == os.getpid()
            and argument in cmdline
            and (but_not is None or but_not not in cmdline)
        ):
            found.append(int(entry.name))
    return found


@pytest.fixture
def endpoint(overrides):
    return endpoint_for(over_stdio(McpServer(name="projects", timeout_s=10)))


def status_of(endpoint, project_id: str) -> str:
    result = connections.call_tool(
        endpoint,
        "project_status",
        {"project_id": project_id},
        meta=IDENTITY,
        deadline=Deadline.after(10),
    )
    return result.structuredContent["project_id"]


def test_calls_share_one_session_and_concurrent_calls_stay_paired(endpoint):
    assert status_of(endpoint, "apollo") == "apollo"
    (spawned,) = example_servers()

    wanted = ["apollo", "hermes", "zephyr"] * 8
    with ThreadPoolExecutor(max_workers=8) as pool:
        answered = list(pool.map(lambda project: status_of(endpoint, project), wanted))

    assert answered == wanted
    assert example_servers() == [spawned]
    assert len(connections.tools(endpoint).definitions) == 2
    assert example_servers() == [spawned]


def test_a_server_crashing_mid_call_fails_that_call_and_the_next_call_reconnects(
    endpoint, overrides
):
    assert status_of(endpoint, "apollo") == "apollo"
    (first,) = example_servers()
    overrides(crash=True)

    with pytest.raises(McpUnavailable):
        status_of(endpoint, "apollo")

    overrides()
    assert status_of(endpoint, "hermes") == "hermes"
    assert example_servers() != [first] and len(example_servers()) == 1


def test_a_server_that_never_completes_its_handshake_costs_one_timeout(overrides):
    silent = McpServer(
        name="silent",
        transport=McpServer.Transport.STDIO,
        command=sys.executable,
        args=["-c", "import time; time.sleep(60)"],
        timeout_s=1,
    )
    started = time.monotonic()

    with pytest.raises(McpUnavailable, match="did not complete the handshake"):
        connections.tools(endpoint_for(silent))

    assert time.monotonic() - started < 4
    assert str(silent.pk) not in connections._connections


@pytest.mark.parametrize(
    "args",
    [
        ["-c", "import sys; sys.exit(3)"],
        ["-c", "print('listening on stdio'); print('{}')"],
        ["-m", "examples.no_such_module"],
    ],
    ids=["exits", "prints-and-exits", "cannot-start"],
)
def test_a_server_that_exits_at_start_says_it_closed_the_connection(overrides, args):
    gone = McpServer(
        name="gone",
        transport=McpServer.Transport.STDIO,
        command=sys.executable,
        args=args,
        timeout_s=5,
    )
    started = time.monotonic()

    with pytest.raises(McpUnavailable) as raised:
        connections.tools(endpoint_for(gone))

    assert str(raised.value) == "platform/gone: could not connect (it closed the connection)."
    assert time.monotonic() - started < 3


def _stderr_logged(monkeypatch, caplog, *, credential: str, script: str, line: str) -> None:
    """Open a stdio server given `credential` as API_TOKEN, whose `script` writes to stderr
    as it fails to start; wait until the platform's log has `line`."""
    monkeypatch.setenv("TEST_LEAKY_TOKEN", credential)
    leaky = McpServer(
        name="leaky",
        transport=McpServer.Transport.STDIO,
        command=sys.executable,
        args=["-c", script],
        env={"API_TOKEN": "TEST_LEAKY_TOKEN"},
        timeout_s=5,
    )
    caplog.set_level(logging.INFO, logger="registry.mcp.connections")
    with pytest.raises(McpUnavailable):
        connections.tools(endpoint_for(leaky))
    connections.close_all()
    deadline = time.monotonic() + 5
    while line not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)


def test_what_a_stdio_server_writes_to_stderr_is_logged_without_its_credential(
    overrides, monkeypatch, capfd, caplog
):
    # given a stdio server given a credential in its environment, which prints it on stderr
    # as it fails to start, when the platform opens it
    _stderr_logged(
        monkeypatch,
        caplog,
        credential=TOKEN,
        script="import os, sys; token = os.environ['API_TOKEN']; "
        "print('x' * 4090 + token, file=sys.stderr); "
        "print('auth failed for', token, file=sys.stderr)",
        line="auth failed for",
    )

    # then its line is in the platform's log, the credential redacted, and nowhere else; a
    # line too long to log, the credential across where it would be cut, is left out whole
    assert "platform/leaky (stderr): auth failed for [redacted]" in caplog.text
    captured = capfd.readouterr()
    assert TOKEN not in captured.err + captured.out + caplog.text
    assert "xxxx" not in caplog.text and TOKEN[6:] not in caplog.text


def test_a_credential_a_stdio_server_writes_percent_encoded_to_stderr_is_logged_redacted(
    overrides, monkeypatch, caplog
):
    # given a stdio server given a credential with characters a URL escapes, which prints
    # the URL it fails to reach, the credential in its query percent-encoded, when the
    # platform opens it
    _stderr_logged(
        monkeypatch,
        caplog,
        credential="s3cr3t/value+123456==",
        script="import os, sys, urllib.parse; "
        "query = urllib.parse.urlencode({'sig': os.environ['API_TOKEN']}); "
        "print('could not fetch https://upstream.example/?' + query, file=sys.stderr)",
        line="could not fetch",
    )

    # then its line is in the platform's log, the credential redacted
    assert (
        "platform/leaky (stderr): could not fetch https://upstream.example/?sig=[redacted]"
        in caplog.text
    )
    assert "s3cr3t%2Fvalue" not in caplog.text


def test_a_credential_a_stdio_server_writes_base64_encoded_to_stderr_is_logged_redacted(
    overrides, monkeypatch, caplog
):
    # given a stdio server which prints what it sends upstream: the credential it was given
    # base64-encoded after a user name, as Basic authentication encodes it, when the
    # platform opens it
    _stderr_logged(
        monkeypatch,
        caplog,
        credential="s3cr3t~~value??-0123456789",
        script="import base64, os, sys; "
        "sent = base64.b64encode(b'svc:' + os.environ['API_TOKEN'].encode()).decode(); "
        "print('upstream refused', sent, file=sys.stderr)",
        line="upstream refused",
    )

    # then its line is in the platform's log, the credential redacted
    assert "platform/leaky (stderr): upstream refused c3ZjO[redacted]" in caplog.text
    assert "M2NyM3R" not in caplog.text


def test_any_credential_a_stdio_server_writes_to_stderr_is_logged_redacted(overrides, caplog):
    # given a stdio server which, as it fails to start, prints a token of its own upstream
    # (one the host never gave it) on stderr
    token = "ghp_4f9c2a7e1b8d3f6a0c5e9b7d"
    leaky = McpServer(
        name="leaky",
        transport=McpServer.Transport.STDIO,
        command=sys.executable,
        args=[
            "-c",
            f"import sys; token = 'ghp_' + '{token[4:]}'; "
            "print('upstream refused Bearer', token, file=sys.stderr)",
        ],
        timeout_s=5,
    )
    caplog.set_level(logging.INFO, logger="registry.mcp.connections")

    # when the platform opens it
    with pytest.raises(McpUnavailable):
        connections.tools(endpoint_for(leaky))
    connections.close_all()

    # then its line is in the platform's log with the token redacted
    deadline = time.monotonic() + 5
    while "upstream refused" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "platform/leaky (stderr): upstream refused Bearer [redacted]" in caplog.text
    assert token not in caplog.text


def test_a_handshake_given_up_on_leaves_no_unread_failure_behind(overrides, caplog):
    """The caller is told once that the handshake did not complete; the connection it waited
    for, ended for it, must not leave its own failure unread for the event loop to log as an
    error when it is collected (a real failure would be lost among such lines)."""
    silent = McpServer(
        name="silent",
        transport=McpServer.Transport.STDIO,
        command=sys.executable,
        args=["-c", "import time; time.sleep(60)"],
        timeout_s=1,
    )
    caplog.set_level(logging.ERROR, logger="asyncio")

    with pytest.raises(McpUnavailable, match="did not complete the handshake"):
        connections.tools(endpoint_for(silent))
    connections.close_all()
    gc.collect()

    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == []
    assert connections._closing == set()
    assert children(b"import time; time.sleep(60)") == []


def test_a_request_whose_caller_stopped_waiting_ends_with_it(endpoint, overrides, caplog):
    """A caller whose wait for an answer expired cancels its request (as `_run` does): the
    request to the server ends with it instead of running on unobserved, so that closing the
    session later leaves no task behind and no failure unread."""
    assert status_of(endpoint, "apollo") == "apollo"
    overrides(delay_s=30)
    caplog.set_level(logging.ERROR, logger="asyncio")
    loop = connections._running_loop()

    async def status(session):
        return await session.call_tool("project_status", {"project_id": "apollo"}, meta=IDENTITY)

    waiting = asyncio.run_coroutine_threadsafe(
        connections._on_session(endpoint, status, 10, None), loop
    )
    time.sleep(1)
    waiting.cancel()
    connections.close_all()
    gc.collect()

    async def others() -> list[asyncio.Task]:
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run_coroutine_threadsafe(others(), loop).result(5) == []
    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == []
    assert example_servers() == []


def test_a_caller_that_stops_waiting_on_a_stalled_connection_says_so_not_a_server_timeout(
    endpoint,
):
    """The server is well and answers at once; the platform's own side (the event loop the
    sessions live on) is stalled past the caller's wait. The caller is told that it stopped
    waiting and after how long, not that the server did not answer within the call's
    timeout, which it was never given the chance to."""
    assert status_of(endpoint, "apollo") == "apollo"
    connections._running_loop().call_soon_threadsafe(time.sleep, 4)

    started = time.monotonic()
    with pytest.raises(McpTimeout) as raised:
        connections.call_tool(
            endpoint,
            "project_status",
            {"project_id": "apollo"},
            meta=IDENTITY,
            deadline=Deadline.after(0.5),
        )

    waited = time.monotonic() - started
    assert 2 <= waited < 3.5
    assert str(raised.value) == (
        "platform/projects: the platform stopped waiting for the request after 2.5 s (its "
        "timeout is 0.5 s): its outcome was not handed back in time, and whether the server "
        "ran it is not known."
    )
    time.sleep(2)
    assert status_of(endpoint, "hermes") == "hermes"


def test_an_endpoint_never_shows_its_secrets(endpoint):
    assert TOKEN in endpoint.secrets
    assert TOKEN not in repr(endpoint) and TOKEN not in str(endpoint)


def test_a_missing_secret_reference_is_named_without_any_value(monkeypatch):
    server = over_stdio(McpServer(name="projects"))
    monkeypatch.delenv("TEST_PROJECTS_MCP_TOKEN", raising=False)

    with pytest.raises(McpUnavailable, match="TEST_PROJECTS_MCP_TOKEN is not set"):
        endpoint_for(server)
