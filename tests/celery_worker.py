"""A real Celery worker process for end-to-end and fault-injection tests.

The worker is a subprocess of the test session (`celery -A config worker`) pointed at the
session's own test database, so it sees what the test committed (use `transactional_db`),
and at a broker queue of the session's own, so two test sessions on one Redis never take
each other's tasks. The running example comes from `seed_demo`; `gated_example_publish`
adds a version of it whose project_search waits at a gate file (tests/reliability/gated_tool).
"""

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.test import APIClient

from config.celery import app
from registry.demo import DATA, DEMO_PASSWORD, seed_demo
from registry.models import Tenant, ToolVersion
from registry.services import skills, tools
from registry.services.tenancy import api_token_issue
from runs.models import Run, RunEvent

BASE_DIR = Path(__file__).resolve().parent.parent
CELERY = Path(sys.executable).parent / "celery"
QUEUE = f"agentgov-test-{os.getpid()}"
READY_SECONDS = 30
GATED_HANDLER = "tests.reliability.gated_tool.project_search"
# The running example: alice asks for project Apollo's week, mailed to its R&D lead.
EXAMPLE_MESSAGE = {
    "channel": "api",
    "parts": [
        {
            "type": "text",
            "text": "Summarise this week's project status and mail it to the R&D lead.",
        }
    ],
    "metadata": {"project_id": "apollo"},
}

# Its event log up to WAITING_APPROVAL: ingress, the host's recipient lookup, a model turn
# with its read call, a model turn that drafts, the approval request.
EXAMPLE_EVENTS = [
    "message.received",
    "message.normalized",
    "session.loaded",
    "capability.resolved",
    "route.selected",
    "skill.activated",
    "tools.assembled",
    "tool.requested",
    "tool.completed",
    "tools.assembled",
    "context.built",
    "model.requested",
    "model.responded",
    "tool.requested",
    "tool.completed",
    "context.built",
    "model.requested",
    "model.responded",
    "draft.created",
    "approval.required",
    "tools.assembled",
]


def _broker() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def queued_tasks() -> list[tuple[str, dict]]:
    """The task name and keyword arguments of each message waiting in this session's queue,
    oldest first."""
    client = _broker()
    try:
        raw_messages = client.lrange(QUEUE, 0, -1)
    finally:
        client.close()
    tasks = []
    # Kombu pushes on the left and pops on the right: the oldest message is last.
    for raw in reversed(raw_messages):
        message = json.loads(raw)
        _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        tasks.append((message["headers"]["task"], kwargs))
    return tasks


def queued_run_ids() -> list[str]:
    """The run ids of the run_advance messages waiting in this session's queue, in order."""
    tasks = queued_tasks()
    assert {name for name, _ in tasks} <= {"runs.tasks.run_advance"}
    return [kwargs["run_id"] for _, kwargs in tasks]


def queue_purge() -> None:
    client = _broker()
    try:
        client.delete(QUEUE)
    finally:
        client.close()


def _unacked_purge() -> None:
    """Forget the deliveries of this session's queue that a killed worker left unacknowledged,
    so no later worker on this Redis restores them after the visibility timeout."""
    client = _broker()
    try:
        for tag, value in client.hgetall("unacked").items():
            _message, _exchange, routing_key = json.loads(value)
            if routing_key == QUEUE:
                client.zrem("unacked_index", tag)
                client.hdel("unacked", tag)
    finally:
        client.close()


def kombu_routes(queue: str) -> list[str]:
    """The Redis keys in which kombu keeps the routes of a queue it has sent to."""
    return [f"_kombu.{kind}.{queue}" for kind in ("binding", "binding_permanent")]


def _routes_forget() -> None:
    """The routes kombu keeps for the session's queue, once nothing sends to it."""
    client = _broker()
    try:
        client.delete(*kombu_routes(QUEUE))
    finally:
        client.close()


class Broker:
    """Moves the Celery app's broker to a closed port on loopback (`down`) and back (`up`)."""

    def __init__(self) -> None:
        self.url = app.conf.broker_url

    def _move(self, url: str) -> None:
        app.conf.broker_url = url
        app._pool = None
        app.amqp._producer_pool = None

    def down(self) -> None:
        self._move("redis://127.0.0.1:9/0")

    def up(self) -> None:
        self._move(self.url)


@pytest.fixture
def broker() -> Iterator[Broker]:
    """The broker of the tasks this process sends, to take down and bring back."""
    broker = Broker()
    yield broker
    broker.up()


@pytest.fixture(scope="session", autouse=True)
def celery_queue() -> Iterator[str]:
    """Route the tasks this process sends to the session's own queue (the router reads
    `task_default_queue` on every send), from its first test on: a test that commits a run
    never leaves its task on the default queue another session's worker consumes."""
    previous = app.conf.task_default_queue
    app.conf.task_default_queue = QUEUE
    yield QUEUE
    app.conf.task_default_queue = previous
    queue_purge()
    _unacked_purge()
    _routes_forget()


@dataclass
class Worker:
    name: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _task_lines(self, task: str, outcome: str) -> int:
        """How many `Task <name>[<id>] <outcome>` lines the worker logged."""
        return sum(
            1
            for line in self.output().splitlines()
            if f"Task {task}[" in line and f"] {outcome}" in line
        )

    def tasks_received(self, task: str = "runs.tasks.run_advance") -> int:
        return self._task_lines(task, "received")

    def tasks_succeeded(self, task: str = "runs.tasks.run_advance") -> int:
        return self._task_lines(task, "succeeded in")

    def kill(self) -> None:
        """SIGKILL, as an out-of-memory killer or a lost machine would: no cleanup at all."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """A warm shutdown, as a supervisor stops a worker when the README's deployment asks
        (systemd `KillMode=mixed`): SIGTERM to the main process only, which finishes the tasks
        in hand and then ends its pool processes."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        self.wait_stopped()

    def terminate(self) -> None:
        """SIGTERM to every process of the worker (systemd's default control-group kill): a
        pool process ends at once, its task in hand as a crash leaves it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def wait_stopped(self) -> None:
        if self.process.poll() is not None:
            return
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


def database_url() -> str:
    """The URL of the database this test session uses (the test database, not the dev one)."""
    database = connection.settings_dict
    credentials = quote(database["USER"] or "", safe="")
    if database["PASSWORD"]:
        credentials += ":" + quote(database["PASSWORD"], safe="")
    host = database["HOST"] or "127.0.0.1"
    port = database["PORT"] or "5432"
    return f"postgres://{credentials}@{host}:{port}/{database['NAME']}"


def wait_until(condition: Callable[[], object], *, seconds: float, what: str, worker=None):
    """Poll `condition` until it returns something truthy; fail with the worker's log."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    log = worker.output()[-4000:] if worker is not None else ""
    pytest.fail(f"Timed out after {seconds} s waiting for {what}.\n{log}")


@pytest.fixture
def start_worker(transactional_db, celery_queue, tmp_path) -> Iterator[Callable[..., Worker]]:
    """Start a real worker on this session's queue and test database; it is stopped after the
    test, before the database is flushed."""
    assert connection.vendor == "postgresql", "worker tests need PostgreSQL (make test)"
    assert settings.REDIS_URL, "worker tests need Redis as the broker (make test)"
    started: list[Worker] = []

    def start(
        *,
        pool: str = "solo",
        concurrency: int = 1,
        environment: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Worker:
        """Start a worker; with `wait`, return once it answers a ping."""
        name = f"e2e-{os.getpid()}-{len(started) + 1}@localhost"
        log = tmp_path / f"worker-{len(started) + 1}.log"
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "REDIS_URL": settings.REDIS_URL,
            "CACHE_KEY_PREFIX": settings.CACHES["default"]["KEY_PREFIX"],
            "CELERY_QUEUE": QUEUE,
            "PYTHON_TOOL_HANDLER_MODULES": ",".join(settings.PYTHON_TOOL_HANDLER_MODULES),
            "PYTHONPATH": str(BASE_DIR),
            **(environment or {}),
        }
        with log.open("wb") as output:
            process = subprocess.Popen(
                [
                    str(CELERY),
                    "-A",
                    "config",
                    "worker",
                    f"--pool={pool}",
                    f"--concurrency={concurrency}",
                    "--queues",
                    QUEUE,
                    "--hostname",
                    name,
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                    "--loglevel=INFO",
                ],
                cwd=BASE_DIR,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name=name, process=process, log=log)
        started.append(worker)

        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"The worker exited with {process.returncode}:\n{worker.output()}")
            return bool(app.control.ping(destination=[name], timeout=0.3))

        if wait:
            wait_until(
                ready, seconds=READY_SECONDS, what=f"worker {name} to answer a ping", worker=worker
            )
        return worker

    yield start
    for worker in started:
        worker.terminate()
    for worker in started:
        worker.wait_stopped()


def example_seed() -> None:
    """The running example's registry and business data, as `manage.py seed_demo` loads them."""
    seed_demo()


def gated_example_publish() -> ToolVersion:
    """Publish project_search 2.1.0 (the same contract, its handler waits at the gate file)
    and weekly-summary 3.3.0 pinning it, as acme's publisher would."""
    return example_search_publish(adapter_config={"handler": GATED_HANDLER})


def example_search_publish(**changes) -> ToolVersion:
    """Publish project_search 2.1.0 with `changes` to the running example's version and
    weekly-summary 3.3.0 pinning it, as acme's publisher would."""
    publisher = get_user_model().objects.get(username="dave")
    tool_specs = {spec["name"]: spec for spec in yaml.safe_load((DATA / "tools.yaml").read_text())}
    search = tools.tool_version_create(
        actor=publisher,
        tenant=Tenant.objects.get(slug="acme"),
        **{**tool_specs["project_search"], "version": "2.1.0", **changes},
    )
    tools.tool_version_publish(tool_version=search, actor=publisher)
    skill_spec = yaml.safe_load((DATA / "weekly-summary.yaml").read_text())
    skill_spec.pop("depends_on_tools")
    pinned = [
        search,
        ToolVersion.objects.get(tool__name="directory_lookup", version="1.0.0"),
        ToolVersion.objects.get(tool__name="mail_send", version="1.0.0"),
    ]
    skill_version = skills.skill_version_create(
        actor=publisher,
        tenant=search.tool.tenant,
        **{**skill_spec, "version": "3.3.0"},
        tool_versions=pinned,
    )
    skills.skill_version_publish(skill_version=skill_version, actor=publisher)
    return search


def alice_client() -> APIClient:
    """An API client holding a token of alice (member of acme), as the running example's user."""
    _, key = api_token_issue(username="alice", password=DEMO_PASSWORD, tenant_slug="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def example_post(client: APIClient, *, key: str | None = None):
    return client.post(
        "/api/v1/messages",
        EXAMPLE_MESSAGE,
        format="json",
        HTTP_IDEMPOTENCY_KEY=key or f"e2e-{uuid.uuid4()}",
    )


def run_status(run_id: str) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run_id)


def event_types(run_id: str) -> list[str]:
    return list(
        RunEvent.objects.filter(run_id=run_id).order_by("seq").values_list("type", flat=True)
    )


def event_seqs(run_id: str) -> list[int]:
    return list(
        RunEvent.objects.filter(run_id=run_id).order_by("seq").values_list("seq", flat=True)
    )
