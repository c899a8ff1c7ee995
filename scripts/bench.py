"""`make bench`: what governance costs per run and per tool call, on PostgreSQL and Redis.

It works in a scratch database, `agentgov_bench` on the server of DATABASE_URL, dropped and
created afresh (never the development or a test database), migrated and loaded with
`seed_demo`, and on Redis queues and cache keys of its own. It prints plain figures:

1. in process: BENCH_RUNS runs of the running example (alice, project apollo, the offline
   planner) through `message_ingest` and `run_execute`. The governance overhead is the wall
   time minus the tool handlers' own time, measured around each handler's call on its
   handler thread;
2. the marginal cost of one more tool call: runs of a read-only agent whose skill pins
   k = 1..4 read tools, one run of each k in turn, overhead regressed on k; and, since one
   round that a checkpoint or the scheduler slowed moves a mean, the median of the rounds'
   own slopes;
3. the floor, in the same invocation: as many event rows as (1) wrote, the same rows, into a
   scratch table shaped like the event log, with raw psycopg, one INSERT and COMMIT each;
   (1) runs in ten chunks and each chunk's rows are written right after it, so that
   the machine's drift in speed falls on both sides of the ratio alike; the ratio is given
   from the totals and as the median of the ten chunks' own ratios;
4. end to end: BENCH_RUNS messages through the ingress service, advanced by a real Celery
   worker (as many pool processes as a worker started without --concurrency has,
   CELERY_WORKER_CONCURRENCY, or BENCH_CONCURRENCY), until every run waits for approval;
5. the worker alone: as many messages ingested first, then drained by a new worker.

Before (1) and after (5) it times a fixed pure-Python loop (median of three): the same code
measures differently on a machine whose CPU is slower for a while (a shared host); comparing
the check across invocations, and its start with its end, shows such a drift apart from a
change in the code. A slow spell between the two checks shows only in the medians above.

Environment: BENCH_RUNS (200), BENCH_CONCURRENCY (the worker's default), BENCH_KEEP_DB (0),
BENCH_PROFILE (0: set to 1 to print where the in-process time goes, with cProfile).
"""

import cProfile
import io
import os
import pstats
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
from scratch_database import ScratchDatabase

BASE_DIR = Path(__file__).resolve().parent.parent
BENCH_DATABASE = "agentgov_bench"
RUNS = int(os.environ.get("BENCH_RUNS", "200"))
KEEP_DATABASE = os.environ.get("BENCH_KEEP_DB", "0") == "1"
PROFILE = os.environ.get("BENCH_PROFILE", "0") == "1"
WARM_UP_RUNS = 5
FLOOR_CHUNKS = 10
MAX_TOOLS = 4
INPROCESS_QUEUE = f"agentgov-bench-inprocess-{os.getpid()}"
WORKER_QUEUE = f"agentgov-bench-{os.getpid()}"
CACHE_PREFIX = f"agentgov-bench-{os.getpid()}"
EXAMPLE_TEXT = "Summarise this week's project status and mail it to the R&D lead."


SCRATCH = ScratchDatabase(BENCH_DATABASE)
if not os.environ.get("REDIS_URL"):
    sys.exit("make bench needs REDIS_URL (the broker of the real worker).")
SCRATCH.recreate()
os.environ["DATABASE_URL"] = SCRATCH.url
os.environ["CACHE_KEY_PREFIX"] = CACHE_PREFIX
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
# One log line per step on a terminal would be measured too; warnings and errors still show.
os.environ.setdefault("LOG_LEVEL", "WARNING")
sys.path.insert(0, str(BASE_DIR))

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
import yaml  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import Count  # noqa: E402

from config.celery import app  # noqa: E402
from registry.demo import DATA, seed_demo  # noqa: E402
from registry.models import AgentConfig, Policy, Tenant, ToolVersion  # noqa: E402
from registry.services import skills, tools  # noqa: E402
from registry.services.common import registry_object_save  # noqa: E402
from runs.choices import RunStatus  # noqa: E402
from runs.loop import run_execute  # noqa: E402
from runs.models import Run, RunEvent, ToolCall  # noqa: E402
from runs.services.ingress import message_ingest  # noqa: E402
from runs.tools import threads  # noqa: E402

# The worker's pool processes: as a worker started without --concurrency has them.
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY") or settings.CELERY_WORKER_CONCURRENCY)


class HandlerClock:
    """The tool handlers' own time: the handler's call on its handler thread, nothing around
    it (gates, limits, the hand-over to that thread which holds the call to its timeout, the
    envelope, events). A handler's authorisation check, which runs on the same threads under
    the same timeout, is gate 3: governance, not the tool's work, so it is not counted here.
    Calls of one step may run in parallel threads, so the clock counts the wall time during
    which at least one handler ran (the union of their intervals)."""

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._call_within = threads.call_within

    def install(self) -> None:
        def timed_call_within(function, *arguments, seconds):
            if getattr(function, "__name__", "") == "authorize":
                return self._call_within(function, *arguments, seconds=seconds)

            def timed(*handler_arguments):
                started = time.perf_counter()
                try:
                    return function(*handler_arguments)
                finally:
                    interval = (started, time.perf_counter())
                    with self._lock:
                        self._intervals.append(interval)

            return self._call_within(timed, *arguments, seconds=seconds)

        threads.call_within = timed_call_within

    def reset(self) -> float:
        """The handlers' wall time since the last reset."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        seconds, end = 0.0, float("-inf")
        for start, stop in intervals:
            if stop > end:
                seconds += stop - max(start, end)
                end = stop
        return seconds


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


QUEUES = (INPROCESS_QUEUE, WORKER_QUEUE, f"{WORKER_QUEUE}-idle")


def _forget_broker_and_cache(*, bindings: bool = False) -> None:
    """Empty the bench's queues and cache keys; with `bindings` (at the end, when nothing
    publishes any more), also the routes kombu keeps for its queues."""
    client = _redis()
    try:
        client.delete(*QUEUES)
        if bindings:
            client.delete(
                *(
                    f"_kombu.{kind}.{queue}"
                    for queue in QUEUES
                    for kind in ("binding", "binding_permanent")
                )
            )
        keys = list(client.scan_iter(match=f"{CACHE_PREFIX}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def _tool_spec(name: str) -> dict:
    return next(
        tool for tool in yaml.safe_load((DATA / "tools.yaml").read_text()) if tool["name"] == name
    )


def _prepare() -> tuple[object, Tenant]:
    """The demo seed, plus project_search 2.0.1 and weekly-summary 3.2.1 pinning it: the same
    contract without the demo's rate limit (60 calls a minute per tenant), which the bench's
    hundreds of runs a minute would hit. Published as a publisher would, through the services."""
    call_command("migrate", verbosity=0, interactive=False)
    seed_demo()
    publisher = get_user_model().objects.get(username="dave")
    acme = Tenant.objects.get(slug="acme")
    unlimited = tools.tool_version_publish(
        tool_version=tools.tool_version_create(
            actor=publisher,
            tenant=acme,
            **{**_tool_spec("project_search"), "version": "2.0.1", "rate_limit": {}},
        ),
        actor=publisher,
    )
    skill_spec = yaml.safe_load((DATA / "weekly-summary.yaml").read_text())
    skill_spec.pop("depends_on_tools")
    pinned = [
        unlimited,
        ToolVersion.objects.get(tool__name="directory_lookup", version="1.0.0"),
        ToolVersion.objects.get(tool__name="mail_send", version="1.0.0"),
    ]
    skills.skill_version_publish(
        skill_version=skills.skill_version_create(
            actor=publisher,
            tenant=acme,
            tool_versions=pinned,
            **{**skill_spec, "version": "3.2.1"},
        ),
        actor=publisher,
    )
    return get_user_model().objects.get(username="alice"), acme


def _read_agents_publish(tenant: Tenant) -> list[str]:
    """Agents whose one skill pins k read tools (k = 1..MAX_TOOLS): the offline planner calls
    each once in one turn, then answers. Only k differs between them."""
    publisher = get_user_model().objects.get(username="dave")
    spec = _tool_spec("project_search")
    read_tools = []
    for index in range(1, MAX_TOOLS + 1):
        draft = tools.tool_version_create(
            actor=publisher,
            tenant=tenant,
            **{**spec, "name": f"bench_read_{index}", "version": "1.0.0", "rate_limit": {}},
        )
        read_tools.append(tools.tool_version_publish(tool_version=draft, actor=publisher))
    demo_agent = AgentConfig.objects.get(tenant=tenant, name="weekly-reporter")
    policy = Policy.objects.get(tenant=tenant, name="approval-before-side-effects")
    names = []
    for count in range(1, MAX_TOOLS + 1):
        skill = skills.skill_version_publish(
            skill_version=skills.skill_version_create(
                actor=publisher,
                tenant=tenant,
                name=f"bench-read-{count}",
                version="1.0.0",
                tool_versions=read_tools[:count],
                description=f"Reads a project with {count} read tools and answers.",
                triggers=["bench"],
                required_inputs=["project_scope"],
                rules=[{"id": "evidence-only", "scope": "skill", "priority": 100, "text": "Cite."}],
                output_contract={"sections": ["answer"]},
                acceptance_rules=["answers from the tool results"],
            ),
            actor=publisher,
        )
        agent = registry_object_save(
            instance=AgentConfig(
                tenant=tenant,
                name=f"zz-bench-{count}-tools",
                model_config=demo_agent.model_config,
                policy=policy,
                max_steps=8,
                max_tool_calls=12,
                max_seconds=300,
                max_tokens=60_000,
                max_cost=demo_agent.max_cost,
            ),
            actor=publisher,
        )
        agent.skills.add(skill.skill)
        names.append(agent.name)
    return names


def _ingest(alice, acme, *, metadata: dict) -> Run:
    return message_ingest(
        actor=alice,
        tenant=acme,
        idempotency_key=f"bench-{uuid.uuid4()}",
        channel="api",
        parts=[{"type": "text", "text": EXAMPLE_TEXT}],
        metadata=metadata,
    ).run


def _timed_runs(alice, acme, clock: HandlerClock, *, count: int, metadata: dict) -> dict:
    """`count` runs in process; returns the timings and what the runs wrote."""
    ingest = execute = 0.0
    run_ids = []
    clock.reset()
    for _ in range(count):
        started = time.perf_counter()
        run = _ingest(alice, acme, metadata=metadata)
        accepted = time.perf_counter()
        run_execute(run_id=str(run.pk))
        execute += time.perf_counter() - accepted
        ingest += accepted - started
        run_ids.append(run.pk)
    handler = clock.reset()
    statuses = set(Run.objects.filter(pk__in=run_ids).values_list("status", flat=True))
    return {
        "run_ids": run_ids,
        "ingest": ingest,
        "execute": execute,
        "handler": handler,
        "statuses": statuses,
        "events": RunEvent.objects.filter(run_id__in=run_ids).count(),
        "tool_calls": ToolCall.objects.filter(run_id__in=run_ids).count(),
    }


class Floor:
    """The same event rows, one INSERT + COMMIT each, into a table shaped like the event log
    (same columns, primary key, unique (run, seq) and indexes; no foreign key)."""

    def __init__(self) -> None:
        self._raw = psycopg.connect(SCRATCH.url)
        self._raw.execute(
            "CREATE TABLE bench_floor_event "
            "(LIKE runs_runevent INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)"
        )
        self._raw.commit()
        self.rows = 0
        self.seconds = 0.0

    def write(self, run_ids: list) -> float:
        """The event rows of these runs, timed; returns their seconds."""
        rows = list(
            RunEvent.objects.filter(run_id__in=run_ids)
            .order_by("run_id", "seq")
            .values_list("run_id", "seq", "type", "payload")
        )
        payloads = [psycopg.types.json.Jsonb(payload) for *_, payload in rows]
        started = time.perf_counter()
        for (run_id, seq, event_type, _), payload in zip(rows, payloads, strict=True):
            self._raw.execute(
                "INSERT INTO bench_floor_event (id, run_id, seq, type, payload, created_at) "
                "VALUES (%s, %s, %s, %s, %s, now())",
                (uuid.uuid4(), run_id, seq, event_type, payload),
            )
            self._raw.commit()
        seconds = time.perf_counter() - started
        self.seconds += seconds
        self.rows += len(rows)
        return seconds

    def close(self) -> None:
        self._raw.close()


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )


WORKER_NAME = f"bench-{os.getpid()}@localhost"


def _worker_start(queue: str = WORKER_QUEUE) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "celery"),
            "-A",
            "config",
            "worker",
            "--pool=prefork",
            f"--concurrency={CONCURRENCY}",
            "--queues",
            queue,
            "--hostname",
            WORKER_NAME,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=WARNING",
        ],
        cwd=BASE_DIR,
        env={**os.environ, "PYTHONPATH": str(BASE_DIR)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not app.control.ping(destination=[WORKER_NAME], timeout=0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            _worker_stop(process)
            sys.exit("The bench worker did not start.")
    return process


def _worker_stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for_approval(run_ids: list) -> None:
    """Until no run is queued or advancing. Every earlier part of the bench ran its runs to a
    pause or an end, so the active runs are this batch's. The question is the partial index's
    (status in QUEUED, RUNNING): the poller, which shares the cores with the worker it waits
    for, costs next to nothing; the statuses are checked afterwards."""
    deadline = time.monotonic() + 60 + len(run_ids)
    active = Run.objects.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
    while active.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _statuses(run_ids: list) -> dict:
    return dict(
        Run.objects.filter(pk__in=run_ids).values_list("status").annotate(count=Count("pk"))
    )


def _end_to_end(alice, acme) -> dict:
    """Messages ingested one after another while the worker advances them."""
    app.conf.task_default_queue = WORKER_QUEUE
    worker = _worker_start()
    try:
        started = time.perf_counter()
        run_ids = [_ingest(alice, acme, metadata={"project_id": "apollo"}).pk for _ in range(RUNS)]
        accepted = time.perf_counter()
        _wait_for_approval(run_ids)
        finished = time.perf_counter()
    finally:
        _worker_stop(worker)
    return {
        "seconds": finished - started,
        "ingest_seconds": accepted - started,
        "statuses": _statuses(run_ids),
    }


def _backlog(alice, acme) -> dict:
    """The worker alone: the messages are ingested first, then a worker drains them. The
    worker starts on an empty queue and is told to consume the backlog when the clock starts,
    so no run is advanced before it."""
    app.conf.task_default_queue = WORKER_QUEUE
    run_ids = [_ingest(alice, acme, metadata={"project_id": "apollo"}).pk for _ in range(RUNS)]
    worker = _worker_start(queue=f"{WORKER_QUEUE}-idle")
    try:
        started = time.perf_counter()
        app.control.add_consumer(WORKER_QUEUE, destination=[WORKER_NAME], reply=True)
        _wait_for_approval(run_ids)
        finished = time.perf_counter()
    finally:
        _worker_stop(worker)
    return {"seconds": finished - started, "statuses": _statuses(run_ids)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def _figure(label: str, value: object) -> None:
    print(f"   {label:<48} {value}")


def _round_trips_per_run(alice, acme, *, count: int = 5) -> dict[str, float]:
    """What ingest and execute send per run: SQL statements and transactions on the run's
    connection (each transaction also sends a BEGIN and a COMMIT of its own, which the
    statements do not count), and Redis commands (the limits' scripts and the task's
    publish). The handlers' own queries, on their threads' connections, are not counted
    (they are the tools' work)."""
    sent = dict.fromkeys(("statements", "transactions", "redis"), 0)

    def counting(execute, sql, params, many, context):
        sent["statements"] += 1
        return execute(sql, params, many, context)

    def committing(commit=connection.commit):
        sent["transactions"] += 1
        commit()

    def redis_command(client, *args, **options):
        sent["redis"] += 1
        return execute_command(client, *args, **options)

    execute_command = redis.Redis.execute_command
    connection.commit, redis.Redis.execute_command = committing, redis_command
    try:
        with connection.execute_wrapper(counting):
            for _ in range(count):
                run_execute(run_id=str(_ingest(alice, acme, metadata={"project_id": "apollo"}).pk))
    finally:
        del connection.commit
        redis.Redis.execute_command = execute_command
    return {kind: number / count for kind, number in sent.items()}


def _cpu_check() -> float:
    """Seconds this machine takes for a fixed pure-Python loop, the median of three: printed
    at the start and at the end, to compare the machine's speed between two invocations, and
    between the start and the end of one (not a slow spell in between)."""

    def once() -> float:
        started = time.perf_counter()
        total = 0
        for number in range(2_000_000):
            total += number
        return time.perf_counter() - started

    return statistics.median(once() for _ in range(3))


def main() -> None:
    print(f"bench: scratch database {BENCH_DATABASE}, PostgreSQL {connection.pg_version}")
    cpu_at_start = _cpu_check()
    _figure("CPU check at the start: a fixed Python loop (ms)", _ms(cpu_at_start))
    _forget_broker_and_cache()
    app.conf.task_default_queue = INPROCESS_QUEUE
    alice, acme = _prepare()
    clock = HandlerClock()
    clock.install()
    example = {"project_id": "apollo"}

    _timed_runs(alice, acme, clock, count=WARM_UP_RUNS, metadata=example)
    profiler = cProfile.Profile() if PROFILE else None
    floor = Floor()
    summed = ("ingest", "execute", "handler", "events", "tool_calls")
    measured = {key: 0 for key in summed}
    measured.update(run_ids=[], statuses=set())
    chunk_ratios = []
    for chunk in range(FLOOR_CHUNKS):
        count = RUNS // FLOOR_CHUNKS + (chunk < RUNS % FLOOR_CHUNKS)
        if not count:
            continue
        if profiler:
            profiler.enable()
        part = _timed_runs(alice, acme, clock, count=count, metadata=example)
        if profiler:
            profiler.disable()
        # Per tool call on both sides: the chunk's overhead over the floor of its rows.
        floor_seconds = floor.write(part["run_ids"])
        chunk_ratios.append((part["ingest"] + part["execute"] - part["handler"]) / floor_seconds)
        for key in summed:
            measured[key] += part[key]
        measured["run_ids"] += part["run_ids"]
        measured["statuses"] |= part["statuses"]
    floor.close()
    if measured["statuses"] != {RunStatus.WAITING_APPROVAL}:
        sys.exit(f"The running example did not wait for approval: {measured['statuses']}")
    overhead = measured["ingest"] + measured["execute"] - measured["handler"]
    tool_calls, events = measured["tool_calls"], measured["events"]
    overhead_per_tool_call = overhead / tool_calls
    print()
    print(f"1. In process: {RUNS} runs of the running example (ingest + run_execute), each")
    print("   to WAITING_APPROVAL; overhead = wall time - the tool handlers' own time")
    _figure("tool calls per run", f"{tool_calls / RUNS:.2f}")
    _figure("events per run", f"{events / RUNS:.2f}")
    sent = _round_trips_per_run(alice, acme)
    _figure("SQL statements per run (not the tools')", f"{sent['statements']:.1f}")
    _figure("  transactions (each also a BEGIN and a COMMIT)", f"{sent['transactions']:.1f}")
    _figure("Redis commands per run", f"{sent['redis']:.1f}")
    _figure("ingest per run (ms)", _ms(measured["ingest"] / RUNS))
    _figure("run_execute per run (ms)", _ms(measured["execute"] / RUNS))
    _figure("tool handlers' own work per run (ms)", _ms(measured["handler"] / RUNS))
    _figure("governance overhead per run (ms)", _ms(overhead / RUNS))
    _figure("governance overhead per tool call (ms)", _ms(overhead_per_tool_call))

    floor_rows, floor_seconds = floor.rows, floor.seconds
    floor_per_tool_call = floor_seconds / tool_calls
    print()
    print(f"2. Floor: the same {floor_rows} event rows, raw psycopg, one INSERT + COMMIT each,")
    print(f"   written after each of the {FLOOR_CHUNKS} chunks of (1) wrote them")
    _figure("per row (ms)", _ms(floor_seconds / floor_rows))
    _figure("per run (ms)", _ms(floor_seconds / RUNS))
    _figure("per tool call (ms)", _ms(floor_per_tool_call))
    _figure(
        "ratio overhead / floor, per tool call",
        f"{overhead_per_tool_call / floor_per_tool_call:.2f}",
    )
    median_ratio = statistics.median(chunk_ratios)
    _figure(f"  median of the {len(chunk_ratios)} chunks' ratios", f"{median_ratio:.2f}")

    agents = _read_agents_publish(acme)
    rounds = max(40, RUNS // 2)
    overhead = dict.fromkeys(range(1, MAX_TOOLS + 1), 0.0)
    round_slopes = []
    for agent in agents:
        _timed_runs(
            alice,
            acme,
            clock,
            count=WARM_UP_RUNS,
            metadata={"project_id": "apollo", "agent": agent},
        )
    for _ in range(rounds):
        this_round = {}
        for count, agent in enumerate(agents, start=1):
            metadata = {"project_id": "apollo", "agent": agent}
            result = _timed_runs(alice, acme, clock, count=1, metadata=metadata)
            if result["statuses"] != {RunStatus.COMPLETED}:
                sys.exit(f"The {count}-tool agent did not complete: {result['statuses']}")
            if result["tool_calls"] != count:
                sys.exit(f"The {count}-tool agent made {result['tool_calls']} tool calls.")
            this_round[count] = result["ingest"] + result["execute"] - result["handler"]
            overhead[count] += this_round[count]
        round_slopes.append(_slope(list(this_round.items())))
    by_count = {count: seconds / rounds for count, seconds in overhead.items()}
    print()
    print(f"3. Marginal cost of a tool call: {rounds} runs each of a read-only agent whose")
    print("   skill pins k read tools (one model turn calls all k, in parallel when k > 1),")
    print(f"   one run of each k = 1..{MAX_TOOLS} in turn, so that drift spreads evenly")
    for count, per_run in by_count.items():
        _figure(f"k={count}: governance overhead per run (ms)", _ms(per_run))
    _figure("one more tool call, k=1 -> k=2 (ms)", _ms(by_count[2] - by_count[1]))
    _figure(
        f"one more tool call, slope over k=1..{MAX_TOOLS} (ms)", _ms(_slope(list(by_count.items())))
    )
    _figure(f"  median of the {rounds} rounds' slopes (ms)", _ms(statistics.median(round_slopes)))

    _forget_broker_and_cache()
    result = _end_to_end(alice, acme)
    print()
    print(f"4. End to end: {RUNS} messages through the ingress service, advanced by a real")
    print(f"   Celery worker (prefork, concurrency {CONCURRENCY}) until each waits for approval")
    _figure("statuses", result["statuses"])
    _figure("ingest of all messages (s)", f"{result['ingest_seconds']:.2f}")
    _figure("wall time, first message to last approval wait (s)", f"{result['seconds']:.2f}")
    _figure("runs/s", f"{RUNS / result['seconds']:.1f}")
    if result["statuses"] != {RunStatus.WAITING_APPROVAL: RUNS}:
        sys.exit("Not every run reached WAITING_APPROVAL in time.")

    _forget_broker_and_cache()
    backlog = _backlog(alice, acme)
    print()
    print(f"5. The worker alone: {RUNS} messages ingested first, then drained by the same worker")
    print("   (the part of (4) the ingress does not share the cores with)")
    _figure("statuses", backlog["statuses"])
    _figure("wall time, worker ready to last approval wait (s)", f"{backlog['seconds']:.2f}")
    _figure("runs/s", f"{RUNS / backlog['seconds']:.1f}")
    if backlog["statuses"] != {RunStatus.WAITING_APPROVAL: RUNS}:
        sys.exit("Not every run of the backlog reached WAITING_APPROVAL in time.")

    print()
    _figure("CPU check at the end (ms)", f"{_ms(_cpu_check())} (start: {_ms(cpu_at_start)})")

    if profiler:
        output = io.StringIO()
        stats = pstats.Stats(profiler, stream=output).sort_stats("cumulative")
        stats.print_stats(60)
        stats.sort_stats("tottime").print_stats(25)
        print()
        print("Profile of step 1 (cumulative):")
        print(output.getvalue())


if __name__ == "__main__":
    try:
        main()
    finally:
        connection.close()
        _forget_broker_and_cache(bindings=True)
        if not KEEP_DATABASE:
            SCRATCH.drop()
