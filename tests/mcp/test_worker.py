"""MCP calls from a real Celery worker (prefork): each worker process opens one session to
the stdio server and reuses it for every call it makes; no credential reaches its log."""

from collections import Counter
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from registry.models import AgentConfig, McpServer, Tenant
from registry.services.mcp import mcp_server_save
from runs.choices import RunStatus
from runs.models import Run, Source, ToolCall
from tests.celery_worker import alice_client, example_seed, run_status, wait_until
from tests.faults import FaultRow, fault_report
from tests.mcp.conftest import OVERRIDES_REF, TOKEN, TOKEN_REF, over_stdio, status_publish
from tests.runs.conftest import Demo

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 6
CRASHES = 2


def _ask(client, key: str) -> str:
    response = client.post(
        "/api/v1/messages",
        {
            "channel": "api",
            "parts": [{"type": "text", "text": "How is Apollo doing?"}],
            "metadata": {"agent": "project-assistant", "project_id": "apollo"},
        },
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert response.status_code == 202, response.content
    return response.json()["run_id"]


def _wait_end(run_id: str, worker) -> None:
    wait_until(
        lambda: run_status(run_id) not in (RunStatus.QUEUED, RunStatus.RUNNING),
        seconds=60,
        what=f"run {run_id} to end",
        worker=worker,
    )


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return children


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_worker_reuses_one_session_per_process_across_runs(
    start_worker, overrides, overrides_path
):
    example_seed()
    users = get_user_model().objects
    demo = Demo(
        admin=users.get(username="admin"),
        alice=users.get(username="alice"),
        acme=Tenant.objects.get(slug="acme"),
        globex=Tenant.objects.get(slug="globex"),
        agent=AgentConfig.objects.get(name="weekly-reporter"),
    )
    server = mcp_server_save(
        server=over_stdio(McpServer.objects.get(name="projects")), actor=demo.admin
    )
    status_publish(demo, server)
    worker = start_worker(
        pool="prefork",
        concurrency=2,
        environment={TOKEN_REF: TOKEN, OVERRIDES_REF: str(overrides_path)},
    )
    client = alice_client()

    run_ids = [_ask(client, f"mcp-worker-{index}") for index in range(RUNS)]

    for run_id in run_ids:
        _wait_end(run_id, worker)
    assert {run_status(run_id) for run_id in run_ids} == {RunStatus.COMPLETED}
    calls = ToolCall.objects.filter(run_id__in=run_ids)
    assert sorted(set(calls.values_list("name", "status"))) == [("project_status", "completed")]
    assert calls.count() == RUNS
    assert (
        Source.objects.filter(run_id__in=run_ids, content__contains="Vendor SDK delay").count()
        == RUNS
    )
    worker_processes = _children(worker.process.pid)
    sessions = [
        child
        for process in worker_processes
        for child in _children(process)
        if b"examples.mcp_server" in _command(child)
    ]
    assert 1 <= len(sessions) <= len(worker_processes) == 2

    # a server process that exits in the middle of a call fails that call only: the run ends
    # with it, and the next call of that worker process starts a new server
    overrides(crash=True)
    crashed = [_ask(client, f"mcp-crash-{index}") for index in range(CRASHES)]
    for run_id in crashed:
        _wait_end(run_id, worker)
    overrides()
    after = [_ask(client, f"mcp-after-crash-{index}") for index in range(CRASHES)]
    for run_id in after:
        _wait_end(run_id, worker)
    runs = Run.objects.filter(pk__in=crashed + after)
    fault_report(
        FaultRow(
            fault="MCP stdio server exits mid-call",
            injected=CRASHES,
            runs=len(runs),
            statuses=Counter(f"{run.status} {run.reason_code}" for run in runs),
            duplicates=ToolCall.objects.filter(run__in=runs).count() - len(runs),
        )
    )
    failed = ToolCall.objects.filter(run_id__in=crashed)
    assert (
        sorted(failed.values_list("status", "error_category"))
        == [("failed", "UPSTREAM_ERROR")] * CRASHES
    )
    assert {run_status(run_id) for run_id in after} == {RunStatus.COMPLETED}
    worker.stop()
    assert TOKEN not in worker.output()
    wait_until(
        lambda: not any(b"examples.mcp_server" in _command(pid) for pid in sessions),
        seconds=15,
        what="the stdio servers to exit with the worker",
    )
