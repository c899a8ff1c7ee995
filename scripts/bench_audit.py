"""`make bench` (second part): how fast the auditor pages stay with a large history.

In a scratch database (`agentgov_bench_audit`, dropped afterwards) it runs the running example
once, clones that run into BENCH_AUDIT_RUNS runs (100,000) with BENCH_AUDIT_EVENTS_PER_RUN
events each (10: 1,000,000 events) in SQL, gives one run 200 events, and then, as acme's
auditor through Django's test client, times BENCH_AUDIT_REQUESTS requests of:

- the history's first page, and a deep page (a cursor half way through the history);
- the run page of the run with 200 events.

The baseline, measured in the same invocation: the same rows read by one raw SQL query each
(the page's runs; the run's events). It prints p50 and p95 of both, their ratio, and how many
SQL queries each page made.
"""

import os
import statistics
import sys
import time
from pathlib import Path

from scratch_database import ScratchDatabase

BASE_DIR = Path(__file__).resolve().parent.parent
DATABASE = "agentgov_bench_audit"
RUNS = int(os.environ.get("BENCH_AUDIT_RUNS", "100000"))
EVENTS_PER_RUN = int(os.environ.get("BENCH_AUDIT_EVENTS_PER_RUN", "10"))
REQUESTS = int(os.environ.get("BENCH_AUDIT_REQUESTS", "40"))
RUN_PAGE_EVENTS = 200
GOAL_P95_MS = 150
GOAL_QUERIES = 10

SCRATCH = ScratchDatabase(DATABASE)
SCRATCH.recreate()
os.environ["DATABASE_URL"] = SCRATCH.url
os.environ["ALLOWED_HOSTS"] = "testserver"
os.environ.setdefault("LOG_LEVEL", "WARNING")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.pop("REDIS_URL", None)
sys.path.insert(0, str(BASE_DIR))

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.signals import request_finished, request_started  # noqa: E402
from django.db import close_old_connections, connection  # noqa: E402
from django.test import Client  # noqa: E402

from registry.demo import seed_demo  # noqa: E402
from registry.models import Tenant  # noqa: E402
from runs.audit import PAGE_SIZE, encode_cursor  # noqa: E402
from runs.loop import run_execute  # noqa: E402
from runs.models import Run, RunEvent  # noqa: E402
from runs.services.ingress import message_ingest  # noqa: E402

STATUSES = ["COMPLETED", "NEEDS_CLARIFICATION", "REFUSED", "FAILED_FINAL", "WAITING_APPROVAL"]


def _template_run() -> Run:
    seed_demo()
    run = message_ingest(
        actor=get_user_model().objects.get(username="alice"),
        tenant=Tenant.objects.get(slug="acme"),
        idempotency_key="bench-audit-template",
        channel="api",
        parts=[{"type": "text", "text": "Summarise this week's project status."}],
        metadata={"project_id": "apollo"},
    ).run
    run_execute(run_id=str(run.pk))
    return Run.objects.get(pk=run.pk)


def _columns(model) -> list[str]:
    return [field.column for field in model._meta.concrete_fields]


def _seed(template: Run) -> Run:
    """Clone the template into RUNS runs, one second apart, and give each EVENTS_PER_RUN
    events; then give the newest clone RUN_PAGE_EVENTS events."""
    run_columns = _columns(Run)
    copied = {
        "id": "gen_random_uuid()",
        "created_at": "t.created_at - (i * interval '1 second')",
        "updated_at": "t.created_at - (i * interval '1 second')",
        "trace_id": "md5(i::text)",
        "status": f"(ARRAY{STATUSES})[1 + mod(i, {len(STATUSES)})]",
        "last_event_seq": str(EVENTS_PER_RUN),
    }
    select = ", ".join(copied.get(column, f"t.{column}") for column in run_columns)
    event_types = [
        "message.received",
        "message.normalized",
        "session.loaded",
        "capability.resolved",
        "route.selected",
        "tool.requested",
        "tool.completed",
        "model.requested",
        "model.responded",
        "run.finished",
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO runs_run ({', '.join(run_columns)}) SELECT {select} "
            "FROM runs_run t, generate_series(1, %s) i WHERE t.id = %s",
            [RUNS, template.pk],
        )
        cursor.execute(
            "INSERT INTO runs_runevent (id, run_id, seq, type, payload, created_at) "
            "SELECT gen_random_uuid(), r.id, s, "
            f"(ARRAY{event_types})[1 + mod(s - 1, {len(event_types)})], "
            "jsonb_build_object('step', s, 'note', 'seeded'), r.created_at + s * interval '1 ms' "
            "FROM runs_run r, generate_series(1, %s) s WHERE r.id <> %s",
            [EVENTS_PER_RUN, template.pk],
        )
        page_run = Run.objects.exclude(pk=template.pk).order_by("-created_at").only("id").first()
        cursor.execute(
            "INSERT INTO runs_runevent (id, run_id, seq, type, payload, created_at) "
            "SELECT gen_random_uuid(), %s, s, 'tool.completed', "
            "jsonb_build_object('step', s, 'name', 'project_search@2.0.0'), "
            "now() + s * interval '1 ms' FROM generate_series(%s, %s) s",
            [page_run.pk, EVENTS_PER_RUN + 1, RUN_PAGE_EVENTS],
        )
        cursor.execute(
            "UPDATE runs_run SET last_event_seq = %s WHERE id = %s",
            [RUN_PAGE_EVENTS, page_run.pk],
        )
        cursor.execute("VACUUM ANALYZE")
    return page_run


def _queries(call) -> int:
    """SQL statements one call makes."""
    statements = []

    def counting(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(counting):
        call()
    return len(statements)


def _timed(call, count: int) -> list[float]:
    call()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def _p(times: list[float], fraction: float) -> float:
    ordered = sorted(times)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]


def _report(label: str, page: list[float], baseline: list[float], queries: int) -> bool:
    print(f"  {label}")
    print(f"    page      p50 {_p(page, 0.5):7.1f} ms   p95 {_p(page, 0.95):7.1f} ms")
    print(f"    raw SQL   p50 {_p(baseline, 0.5):7.1f} ms   p95 {_p(baseline, 0.95):7.1f} ms")
    ratio = statistics.median(page) / max(statistics.median(baseline), 0.001)
    print(f"    ratio of medians page / raw SQL: {ratio:.1f}   SQL queries: {queries}")
    return _p(page, 0.95) < GOAL_P95_MS and queries <= GOAL_QUERIES


def main() -> None:
    call_command("migrate", verbosity=0, interactive=False)
    started = time.monotonic()
    template = _template_run()
    page_run = _seed(template)
    runs, events = Run.objects.count(), RunEvent.objects.count()
    print(
        f"bench (audit pages): {runs} runs, {events} events, seeded in "
        f"{time.monotonic() - started:.1f} s"
    )
    # As a server keeping its connections (CONN_MAX_AGE) would: no reconnect per request.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    client = Client()
    client.force_login(get_user_model().objects.get(username="carol"))
    tenant_id = Tenant.objects.get(slug="acme").pk
    deep = Run.objects.order_by("-created_at", "-pk")[RUNS // 2]
    cursor = encode_cursor(deep)
    history_sql = (
        "SELECT r.id, r.status, r.reason_code, r.skill, r.created_at, u.username "
        "FROM runs_run r JOIN auth_user u ON u.id = r.actor_id WHERE r.tenant_id = %s {} "
        "ORDER BY r.created_at DESC, r.id DESC LIMIT %s"
    )

    def raw(sql: str, params: list) -> None:
        with connection.cursor() as raw_cursor:
            raw_cursor.execute(sql, params)
            raw_cursor.fetchall()

    pages = {
        "history, first page": (
            lambda: client.get("/runs/"),
            lambda: raw(history_sql.format(""), [tenant_id, PAGE_SIZE + 1]),
        ),
        f"history, deep page ({RUNS // 2} runs in)": (
            lambda: client.get("/runs/", {"before": cursor}),
            lambda: raw(
                history_sql.format("AND (r.created_at, r.id) < (%s, %s)"),
                [tenant_id, deep.created_at, deep.pk, PAGE_SIZE + 1],
            ),
        ),
        f"run page, {RUN_PAGE_EVENTS} events": (
            lambda: client.get(f"/runs/{page_run.pk}/"),
            lambda: raw(
                "SELECT * FROM runs_runevent WHERE run_id = %s ORDER BY seq", [page_run.pk]
            ),
        ),
    }
    met = True
    for label, (page, baseline) in pages.items():
        response = page()
        if response.status_code != 200:
            sys.exit(f"{label}: HTTP {response.status_code}")
        met &= _report(label, _timed(page, REQUESTS), _timed(baseline, REQUESTS), _queries(page))
    print(
        f"  goal (p95 < {GOAL_P95_MS} ms, at most {GOAL_QUERIES} queries): "
        f"{'met' if met else 'NOT met'}"
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        connection.close()
        SCRATCH.drop()
