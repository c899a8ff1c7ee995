"""The example MCP server (examples/mcp_server.py), really running: spawned over stdio by the
platform itself, or served over streamable HTTP on loopback by a process of the session.

Both read the overrides file of `overrides`, so a test can change what the server lists or
how it behaves while the platform holds its session open."""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings

from registry.mcp.connections import connections
from registry.models import AgentConfig, McpServer, ToolVersion
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.mcp import mcp_server_discover, mcp_server_save
from runs.loop import run_execute
from runs.models import Run, ToolCall
from runs.services.ingress import message_ingest
from tests.runs import conftest as runs_fixtures
from tests.runs.test_loop import add_agent

demo = runs_fixtures.demo
model_server = runs_fixtures.model_server
fake_model = runs_fixtures.fake_model

# The credential the host injects, and where the host's environment keeps it.
TOKEN = "mcp-credential-4f1c9a7e2b"
TOKEN_REF = "TEST_PROJECTS_MCP_TOKEN"
OVERRIDES_REF = "TEST_PROJECTS_MCP_OVERRIDES"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, *, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


@pytest.fixture(scope="session")
def overrides_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mcp") / "overrides.json"
    path.write_text("{}")
    return path


@pytest.fixture(scope="session")
def http_server(overrides_path) -> Iterator[str]:
    """The example server over streamable HTTP, requiring the bearer token."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "examples.mcp_server", "--http", "--port", str(port)],
        cwd=settings.BASE_DIR,
        env={
            **os.environ,
            "PROJECTS_MCP_TOKEN": TOKEN,
            "PROJECTS_MCP_OVERRIDES": str(overrides_path),
        },
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def overrides(overrides_path, monkeypatch) -> Iterator[Callable[..., None]]:
    """Set what the server changes (see examples/mcp_server.py); reset after the test, and
    every session of this process closed (stdio servers exit with it)."""
    monkeypatch.setenv(TOKEN_REF, TOKEN)
    monkeypatch.setenv(OVERRIDES_REF, str(overrides_path))
    overrides_path.write_text("{}")

    def change(**values) -> None:
        overrides_path.write_text(json.dumps(values))

    yield change
    overrides_path.write_text("{}")
    connections.close_all()


@pytest.fixture(params=["stdio", "http"])
def transport(request) -> str:
    return request.param


def over_stdio(server: McpServer) -> McpServer:
    """The example server spawned by the platform, its credential and overrides file passed
    by reference to the host's environment (`overrides` sets both variables)."""
    server.transport = McpServer.Transport.STDIO
    server.command = sys.executable
    server.args = ["-m", "examples.mcp_server"]
    server.env = {"PROJECTS_MCP_TOKEN": TOKEN_REF, "PROJECTS_MCP_OVERRIDES": OVERRIDES_REF}
    return server


@pytest.fixture
def projects(demo, transport, overrides, request, settings) -> McpServer:
    """acme's `projects` server (seeded by the demo) on the transport under test; over HTTP,
    its bearer token is a credential the operator granted to acme."""
    server = McpServer.objects.get(tenant=demo.acme, name="projects")
    if transport == "stdio":
        over_stdio(server)
    else:
        settings.TENANT_CREDENTIALS = {"acme": [TOKEN_REF]}
        server.transport = McpServer.Transport.STREAMABLE_HTTP
        server.url = request.getfixturevalue("http_server")
        server.credential_ref = TOKEN_REF
    return mcp_server_save(server=server, actor=demo.admin)


def draft_of(server: McpServer, remote_name: str) -> ToolVersion:
    return ToolVersion.objects.get(
        tool__tenant=server.tenant,
        tool__namespace=server.name,
        tool__name=remote_name,
        status="draft",
    )


def assistant(demo, tool_versions: list[ToolVersion], *, model_config=None) -> AgentConfig:
    """acme's `project-assistant`: one skill on the generic agent workflow pinning
    `tool_versions`, on the offline planner unless `model_config` is given."""
    skill_version = skills.skill_version_publish(
        skill_version=skills.skill_version_create(
            actor=demo.admin,
            tenant=demo.acme,
            name="project-brief",
            version="1.0.0",
            tool_versions=tool_versions,
            description="Answers questions about one project's week.",
            triggers=["project status"],
            required_inputs=["project_scope"],
            rules=[{"id": "cite", "scope": "skill", "priority": 100, "text": "Cite."}],
            output_contract={"sections": ["answer"]},
            acceptance_rules=["every fact has a source"],
            workflow="",
        ),
        actor=demo.admin,
    )
    agent = add_agent(demo, "project-assistant", skill_version)
    if model_config is not None:
        agent.model_config = model_config
        registry_object_save(instance=agent, actor=demo.admin, reason="test model")
    return agent


def status_publish(demo, server: McpServer, model_config=None, **changes) -> ToolVersion:
    """Discover, then publish project_status (changed first as given) and give acme the
    `project-assistant` pinning it (on `model_config`, or the offline planner)."""
    mcp_server_discover(server=server, actor=demo.admin)
    draft = draft_of(server, "project_status")
    if changes:
        draft = tools.tool_version_update(tool_version=draft, actor=demo.admin, **changes)
    version = tools.tool_version_publish(tool_version=draft, actor=demo.admin)
    assistant(demo, [version], model_config=model_config)
    return version


def call_answered(demo, server: McpServer, answer: Callable[..., None], **answering) -> ToolCall:
    """The call of project_status (published with a 10 s timeout) that a run made to `server`,
    which answers it as `answer(**answering)` says; the run's step took well under 10 s."""
    status_publish(demo, server, timeout_s=10)
    answer(**answering)
    run = ask(demo)

    started = time.monotonic()
    run_execute(run_id=str(run.pk))

    assert time.monotonic() - started < 5
    return ToolCall.objects.get(run=run)


@pytest.fixture
def published_status(demo, projects) -> Callable[..., ToolVersion]:
    return lambda model_config=None, **changes: status_publish(
        demo, projects, model_config, **changes
    )


def ask(demo, *, project_id: str = "apollo", actor=None) -> Run:
    """alice (or `actor`) asks project-assistant about a project; the run is QUEUED."""
    return message_ingest(
        actor=actor or demo.alice,
        tenant=demo.acme,
        idempotency_key=f"key-{time.monotonic_ns()}",
        channel="chat",
        parts=[{"type": "text", "text": f"What is the status of {project_id}?"}],
        metadata={"agent": "project-assistant", "project_id": project_id},
    ).run
