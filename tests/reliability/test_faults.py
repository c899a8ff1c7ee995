"""Faults injected into the running example on real worker processes, real PostgreSQL, Redis
and SMTP: whatever breaks, every run ends in a terminal or resumable state, no mail goes out
twice, no event is lost or written twice and each run's seq has no gap. Each scenario adds a
row to the table printed at the end of the session (tests/faults.py)."""

import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.contrib.auth import get_user_model
from django.db import connection

from approvals import services as approvals
from approvals.choices import ActionStatus, Decision
from approvals.models import BusinessAction
from config.celery import app
from runs.choices import TERMINAL_STATUSES, RunStatus
from runs.models import Run, RunEvent, ToolCall
from runs.tasks import runs_sweep
from tests.celery_worker import (
    alice_client,
    database_url,
    example_post,
    example_search_publish,
    example_seed,
    wait_until,
)
from tests.faults import FaultRow, fault_report

pytestmark = pytest.mark.django_db(transaction=True)

SEED = int(os.environ.get("FAULT_SEED", "20261130"))
LEASE_SECONDS = 2
KILLS = int(os.environ.get("FAULT_KILLS", "5"))
RESTART_RUNS, REDIS_RESTARTS = 12, 2
TERMINATE_RUNS, TERMINATIONS = 12, 5
# Events a run of the running example writes exactly once, however often its steps are redone.
ONCE = [
    "message.received",
    "capability.resolved",
    "draft.created",
    "approval.required",
    "approval.granted",
    "run.resumed",
    "action.executing",
    "action.succeeded",
    "run.finished",
]
# Where a run may rest: it ends, or waits for a person or a reconciliation.
RESTING = {*TERMINAL_STATUSES, RunStatus.WAITING_APPROVAL}


def unthrottled() -> None:
    """The running example with project_search allowed more than the demo's 60 calls a minute
    per tenant, which a hundred runs in a minute would reach: the faults here are crashes."""
    example_search_publish(rate_limit={"requests": 10_000, "per_seconds": 60})


def _sweep() -> None:
    """What the beat does every so often: re-enqueue stale runs, stalled actions and the
    overdue reconciliations of unknown ones."""
    runs_sweep()
    approvals.actions_resume_stalled()
    approvals.actions_reconcile_overdue()


class Driver:
    """Posts runs of the running example (at most `window` not yet waiting at a time), approves
    each as bob once it waits, and sweeps as the beat would, until every run is at rest."""

    def __init__(self, *, runs: int, window: int = 10):
        self.client = alice_client()
        self.bob = get_user_model().objects.get(username="bob")
        self.total = runs
        self.window = window
        self.run_ids: list[str] = []
        self.last_sweep = 0.0

    def statuses(self) -> dict[str, str]:
        return {
            str(pk): status
            for pk, status in Run.objects.filter(pk__in=self.run_ids).values_list("pk", "status")
        }

    def tick(self) -> bool:
        """One round; returns whether every run has ended."""
        statuses = self.statuses()
        active = sum(
            status in (RunStatus.QUEUED, RunStatus.RUNNING) for status in statuses.values()
        )
        while len(self.run_ids) < self.total and active < self.window:
            response = example_post(self.client)
            assert response.status_code == 202, response.content
            self.run_ids.append(response.json()["run_id"])
            active += 1
        waiting = BusinessAction.objects.filter(
            run_id__in=self.run_ids, status=ActionStatus.WAITING_APPROVAL
        )
        for action in waiting:
            approvals.approval_decide(
                action_id=action.pk,
                approver=self.bob,
                decision=Decision.APPROVE,
                payload_hash=action.payload_hash,
            )
        if time.monotonic() - self.last_sweep > 0.5:
            _sweep()
            self.last_sweep = time.monotonic()
        return len(self.run_ids) == self.total and all(
            status in TERMINAL_STATUSES for status in statuses.values()
        )

    def drive(self, *, seconds: float, between: Callable[[], None] = lambda: None, worker=None):
        deadline = time.monotonic() + seconds
        while not self.tick():
            if time.monotonic() > deadline:
                log = worker().output()[-4000:] if worker else ""
                statuses = Counter(self.statuses().values())
                pytest.fail(f"Runs not at rest after {seconds} s: {statuses}\n{log}")
            between()
            time.sleep(0.05)


def audited(
    fault: str, injected: int, run_ids: list[str], smtp_server, *, worker_restarts: int = 0
):
    """Audit the runs and add the scenario's row to the fault table (with the workers that
    exited and were replaced); returns the runs' end states and what is wrong."""
    statuses, duplicates, problems = audit(run_ids, smtp_server)
    fault_report(
        FaultRow(
            fault=fault,
            injected=injected,
            runs=len(run_ids),
            statuses=statuses,
            duplicates=duplicates,
            workers_replaced=worker_restarts,
        )
    )
    return statuses, problems


def audit(run_ids: Iterable[str], smtp_server) -> tuple[Counter, int, list[str]]:
    """The runs' end states, the duplicates found and what is wrong: a mail sent twice, an
    event written twice, a gap in seq, a tool call recorded twice."""
    run_ids = list(run_ids)
    problems: list[str] = []
    duplicates = 0
    runs = Run.objects.filter(pk__in=run_ids)
    statuses = Counter(f"{run.status} {run.reason_code}".strip() for run in runs)
    message_ids = [message["Message-ID"] for message in smtp_server.messages]
    for message_id, count in Counter(message_ids).items():
        if count > 1:
            duplicates += count - 1
            problems.append(f"mail {message_id} sent {count} times")
    for run in runs:
        events = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "type"))
        seqs = [seq for seq, _type in events]
        if seqs != list(range(1, len(seqs) + 1)):
            problems.append(f"run {run.pk}: seq {seqs}")
        if run.last_event_seq != len(seqs):
            problems.append(
                f"run {run.pk}: last_event_seq {run.last_event_seq}, {len(seqs)} events"
            )
        types = Counter(event_type for _seq, event_type in events)
        for event_type in ONCE:
            if types[event_type] > 1:
                duplicates += types[event_type] - 1
                problems.append(f"run {run.pk}: {event_type} written {types[event_type]} times")
        completed = Counter(
            event.payload["call_id"]
            for event in RunEvent.objects.filter(run=run, type="tool.completed")
        )
        for call_id, count in completed.items():
            if count > 1:
                duplicates += count - 1
                problems.append(f"run {run.pk}: tool.completed {call_id} written {count} times")
        if run.status == RunStatus.COMPLETED:
            sent = run.result["output"]["message_id"]
            if message_ids.count(sent) != 1:
                problems.append(
                    f"run {run.pk}: its mail {sent} arrived {message_ids.count(sent)} times"
                )
        if run.status not in RESTING:
            problems.append(f"run {run.pk} stopped in {run.status}")
        if run.status != RunStatus.COMPLETED:
            failed = run.tool_calls.exclude(status=ToolCall.Status.COMPLETED)
            problems.append(
                f"run {run.pk} ended {run.status} {run.reason_code}: "
                + "; ".join(f"{c.name} {c.status} {c.error_category} {c.envelope}" for c in failed)
            )
        if ToolCall.objects.filter(run=run).count() != len(
            set(ToolCall.objects.filter(run=run).values_list("call_id", flat=True))
        ):
            problems.append(f"run {run.pk}: a tool call recorded twice")
    return statuses, duplicates, problems


@pytest.fixture
def fast_recovery(settings, monkeypatch):
    """Leases and stall limits of seconds, not minutes, in this process (the sweeps) and in
    the workers (the environment to start them with)."""
    settings.RUN_LEASE_SECONDS = LEASE_SECONDS
    monkeypatch.setattr(approvals, "STALLED_AFTER", timedelta(seconds=LEASE_SECONDS))
    monkeypatch.setattr(approvals, "RECONCILE_LOST_AFTER", timedelta(seconds=LEASE_SECONDS))
    return {"RUN_LEASE_SECONDS": str(LEASE_SECONDS), "MAIL_ATTEMPT_SECONDS": "1"}


def _kill_points(count: int, *, runs: int) -> list[int]:
    """Points of the event log (a run of the running example writes 28 events) drawn from the
    seed: a fault is injected when the log reaches each."""
    return sorted(random.Random(SEED).sample(range(40, runs * 27), count))


def test_workers_sigkilled_at_seeded_points_across_a_hundred_runs_lose_and_repeat_nothing(
    start_worker, smtp_server, fast_recovery
):
    example_seed()
    unthrottled()
    environment = smtp_server.environment(**fast_recovery)
    # Two workers, as a deployment has several; at each kill point the older one is killed
    # (SIGKILL, the whole process group: no cleanup, no ack, no reject) wherever its
    # processes are: a model turn, a tool call, an approval's resume, the SMTP exchange, a
    # commit; a new one starts beside the survivor.
    workers = [
        start_worker(pool="prefork", concurrency=2, environment=environment) for _ in range(2)
    ]
    driver = Driver(runs=100)
    kill_points = _kill_points(KILLS, runs=100)
    kills = []

    def maybe_kill() -> None:
        if kill_points and RunEvent.objects.count() >= kill_points[0]:
            kills.append(kill_points.pop(0))
            workers.pop(0).kill()
            workers.append(
                start_worker(pool="prefork", concurrency=2, environment=environment, wait=False)
            )

    driver.drive(seconds=240, between=maybe_kill, worker=lambda: workers[-1])

    statuses, problems = audited(
        f"worker SIGKILL at seeded points (seed {SEED})",
        len(kills),
        driver.run_ids,
        smtp_server,
        worker_restarts=len(kills),
    )
    assert len(kills) == KILLS
    assert problems == []
    assert statuses == {"COMPLETED SENT": 100}
    assert len(smtp_server.messages) == 100


class RedisServer:
    """A Redis of this test's own on a free port, restarted as a crashed Redis would be: the
    process killed, a new one started empty (no persistence, as the platform's Redis runs)."""

    def __init__(self, port: int, log: Path):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is needed to restart a Redis (scripts/services.sh)"
        with self.log.open("ab") as output:
            self.process = subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: _pings(client), seconds=10, what="the test Redis to answer")
        client.close()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@contextmanager
def broker_at(url: str) -> Iterator[None]:
    """Send this process's tasks to another broker (the app's connection pools follow)."""
    previous = app.conf.broker_url

    def switch(to: str) -> None:
        app.conf.broker_url = to
        app._pool = None
        app.amqp._producer_pool = None

    switch(url)
    try:
        yield
    finally:
        switch(previous)


def test_redis_restarted_mid_run_loses_its_queue_and_the_sweeps_finish_every_run(
    start_worker, smtp_server, fast_recovery, free_tcp_port_factory, tmp_path, settings
):
    example_seed()
    unthrottled()
    server = RedisServer(free_tcp_port_factory(), tmp_path / "redis.log")
    server.start()
    restarts = []
    workers = []
    try:
        with broker_at(server.url):
            settings.CELERY_BROKER_URL = server.url
            environment = smtp_server.environment(REDIS_URL=server.url, **fast_recovery)
            workers.append(start_worker(pool="prefork", concurrency=2, environment=environment))
            driver = Driver(runs=RESTART_RUNS)
            restart_points = _kill_points(REDIS_RESTARTS, runs=RESTART_RUNS)

            def maybe_restart() -> None:
                # As a process supervisor would: a worker that exited is replaced. Celery
                # exits on an "Unrecoverable error" when kombu's Redis transport, closing the
                # lost connection, tries to requeue an unacked message through it.
                if workers[-1].process.poll() is not None:
                    workers.append(
                        start_worker(
                            pool="prefork", concurrency=2, environment=environment, wait=False
                        )
                    )
                if restart_points and RunEvent.objects.count() >= restart_points[0]:
                    restarts.append(restart_points.pop(0))
                    server.kill()
                    server.start()

            driver.drive(seconds=120, between=maybe_restart, worker=lambda: workers[-1])
            # stopped while its broker is up: without one, a warm shutdown waits it out
            workers[-1].stop()
    finally:
        if server.process and server.process.poll() is None:
            server.kill()

    statuses, problems = audited(
        "Redis (broker, cache) killed and restarted empty",
        len(restarts),
        driver.run_ids,
        smtp_server,
        worker_restarts=len(workers) - 1,
    )
    assert len(restarts) == REDIS_RESTARTS
    # a worker exits at most once per lost broker; more would be a crash of the platform's own
    assert len(workers) - 1 <= REDIS_RESTARTS
    assert "Connection to broker lost" in workers[0].output()
    assert problems == []
    assert statuses == {"COMPLETED SENT": RESTART_RUNS}


WORKER_APPLICATION = "agentgov-fault-worker"


def test_database_connections_dropped_mid_step_lose_and_repeat_nothing(
    start_worker, smtp_server, fast_recovery
):
    example_seed()
    unthrottled()
    worker = start_worker(
        pool="prefork",
        concurrency=2,
        environment=smtp_server.environment(
            DATABASE_URL=f"{database_url()}?application_name={WORKER_APPLICATION}",
            **fast_recovery,
        ),
    )
    driver = Driver(runs=TERMINATE_RUNS)
    points = _kill_points(TERMINATIONS, runs=TERMINATE_RUNS)
    terminated = []

    def maybe_terminate() -> None:
        if points and RunEvent.objects.count() >= points[0]:
            points.pop(0)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = %s",
                    [WORKER_APPLICATION],
                )
                terminated.append(cursor.fetchone()[0])

    driver.drive(seconds=120, between=maybe_terminate, worker=lambda: worker)

    statuses, problems = audited(
        "PostgreSQL backends of the worker terminated", sum(terminated), driver.run_ids, smtp_server
    )
    assert len(terminated) == TERMINATIONS and sum(terminated) > 0
    assert problems == []
    assert statuses == {"COMPLETED SENT": TERMINATE_RUNS}
