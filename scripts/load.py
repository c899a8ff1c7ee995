"""`make load`: the message ingress under a steady load on loopback, on PostgreSQL and Redis.

It works in a scratch database, `agentgov_load` (dropped and created afresh, never the
development or a test database), migrated and loaded with `seed_demo`, with LOAD_ACTORS members
of acme holding API tokens, and on Redis cache keys and a queue of its own. The platform is
served by uvicorn (LOAD_WEB_WORKERS processes) as in production. For LOAD_SECONDS the generator
sends `POST /api/v1/messages` at LOAD_RATE requests a second (open loop: a request is due at
its time whether or not earlier ones have answered; at most LOAD_IN_FLIGHT at once), spread
over the actors; LOAD_DUPLICATES of the deliveries repeat an earlier one (same
Idempotency-Key, same body), as a client retrying would. One more actor sends LOAD_NOISY_RATE
a second, above the per-actor limit. It prints throughput, latency percentiles, responses and
errors by class, then checks: no 5xx, every duplicate answered with its first run and no second
run made, the noisy actor held to its limit. Exit status 1 when a check fails.

No worker advances the runs: the queue is counted and dropped. The load is the ingress: token
authentication, validation, rate limits, idempotency, the run and its first events, the
enqueue.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from scratch_database import ScratchDatabase

BASE_DIR = Path(__file__).resolve().parent.parent
RATE = float(os.environ.get("LOAD_RATE", "20"))
SECONDS = float(os.environ.get("LOAD_SECONDS", "60"))
DUPLICATES = float(os.environ.get("LOAD_DUPLICATES", "0.10"))
ACTORS = int(os.environ.get("LOAD_ACTORS", "40"))
NOISY_RATE = float(os.environ.get("LOAD_NOISY_RATE", "4"))
IN_FLIGHT = int(os.environ.get("LOAD_IN_FLIGHT", "64"))
WEB_WORKERS = int(os.environ.get("LOAD_WEB_WORKERS", "2"))
ACTOR_RATE_PER_MINUTE = 120
QUEUE = f"agentgov-load-{os.getpid()}"
CACHE_PREFIX = f"agentgov-load-{os.getpid()}"
EXAMPLE_TEXT = "Summarise this week's project status and mail it to the R&D lead."

SCRATCH = ScratchDatabase("agentgov_load")
if not os.environ.get("REDIS_URL"):
    sys.exit("make load needs REDIS_URL (rate limits and the queue live in Redis).")
SCRATCH.recreate()
SERVER_ENV = {
    **os.environ,
    "DATABASE_URL": SCRATCH.url,
    "CACHE_KEY_PREFIX": CACHE_PREFIX,
    "CELERY_QUEUE": QUEUE,
    "INGRESS_ACTOR_RATE": f"{ACTOR_RATE_PER_MINUTE}/min",
    # The tenant's limit is sized for the whole load; the per-actor limit is the one tested.
    "INGRESS_TENANT_RATE": f"{int(RATE * 60 * 2 + NOISY_RATE * 60)}/min",
    "LOG_LEVEL": "WARNING",
    "ALLOWED_HOSTS": "127.0.0.1",
}
os.environ.update({key: SERVER_ENV[key] for key in ("DATABASE_URL", "CACHE_KEY_PREFIX")})
os.environ["CELERY_QUEUE"] = QUEUE
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
sys.path.insert(0, str(BASE_DIR))

import logging  # noqa: E402

import django  # noqa: E402

django.setup()
logging.getLogger("httpx").setLevel(logging.WARNING)

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402

from registry.choices import Role  # noqa: E402
from registry.demo import seed_demo  # noqa: E402
from registry.models import Tenant  # noqa: E402
from registry.services.tenancy import api_token_issue, membership_add  # noqa: E402
from runs.models import Run  # noqa: E402

PASSWORD = "load-only-password"


def _prepare() -> tuple[list[str], str]:
    """Migrate, seed, and issue a token to each load actor and to the noisy one."""
    call_command("migrate", verbosity=0)
    seed_demo()
    # Only this process checks passwords (to issue tokens); the server never does.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    acme = Tenant.objects.get(slug="acme")
    keys = []
    for index in range(ACTORS + 1):
        username = f"load-{index}" if index < ACTORS else "load-noisy"
        user = get_user_model().objects.create_user(username=username, password=PASSWORD)
        membership_add(actor=None, user=user, tenant=acme, role=Role.MEMBER)
        keys.append(api_token_issue(username=username, password=PASSWORD, tenant_slug="acme")[1])
    return keys[:-1], keys[-1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "uvicorn"),
            "config.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(WEB_WORKERS),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        cwd=BASE_DIR,
        env=SERVER_ENV,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/schema/", timeout=2)
            return process
        except httpx.TransportError:
            time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    sys.exit("uvicorn did not answer within 60 s.")


class Load:
    def __init__(self, base_url: str, actor_keys: list[str], noisy_key: str):
        self.actor_keys = actor_keys
        self.noisy_key = noisy_key
        self.random = random.Random(20261130)
        self.lock = threading.Lock()
        self.sent: list[tuple[str, str, dict]] = []  # first deliveries: (token, key, body)
        self.results: list[dict] = []
        self.client = httpx.Client(
            base_url=base_url,
            timeout=30,
            limits=httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT),
        )

    def delivery(self) -> tuple[str, str, dict, bool]:
        """The next request: a new message of one actor, or a repeat of an earlier one."""
        with self.lock:
            if self.sent and self.random.random() < DUPLICATES:
                return (*self.random.choice(self.sent), True)
            token = self.actor_keys[len(self.sent) % len(self.actor_keys)]
            key = f"load-{uuid.uuid4()}"
            body = {
                "channel": "api",
                "parts": [{"type": "text", "text": EXAMPLE_TEXT}],
                "metadata": {"project_id": "apollo"},
            }
            self.sent.append((token, key, body))
            return token, key, body, False

    def send(self, token: str, key: str, body: dict, *, duplicate: bool, noisy: bool) -> None:
        started = time.perf_counter()
        outcome: dict = {"duplicate": duplicate, "noisy": noisy, "key": key}
        try:
            response = self.client.post(
                "/api/v1/messages",
                content=json.dumps(body),
                headers={
                    "Authorization": f"Token {token}",
                    "Idempotency-Key": key,
                    "Content-Type": "application/json",
                },
            )
            outcome["status"] = response.status_code
            if response.status_code in (200, 202):
                outcome["run_id"] = response.json()["run_id"]
            elif response.status_code == 429:
                outcome["retry_after"] = response.headers.get("Retry-After")
        except httpx.HTTPError as error:
            outcome["error"] = type(error).__name__
        outcome["ms"] = (time.perf_counter() - started) * 1000
        with self.lock:
            self.results.append(outcome)

    def run(self) -> float:
        """Send for SECONDS at RATE (and the noisy actor at NOISY_RATE); returns the time
        taken until the last answer."""
        schedule = sorted(
            [(index / RATE, False) for index in range(int(SECONDS * RATE))]
            + [(index / NOISY_RATE, True) for index in range(int(SECONDS * NOISY_RATE))]
        )
        in_flight = threading.BoundedSemaphore(IN_FLIGHT)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
            for due, noisy in schedule:
                delay = started + due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                in_flight.acquire()
                if noisy:
                    token, key, body, duplicate = (
                        self.noisy_key,
                        f"noisy-{uuid.uuid4()}",
                        {"channel": "api", "parts": [{"type": "text", "text": EXAMPLE_TEXT}]},
                        False,
                    )
                else:
                    token, key, body, duplicate = self.delivery()

                def task(token=token, key=key, body=body, duplicate=duplicate, noisy=noisy):
                    try:
                        self.send(token, key, body, duplicate=duplicate, noisy=noisy)
                    finally:
                        in_flight.release()

                pool.submit(task)
        return time.monotonic() - started


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def _error_class(outcome: dict) -> str:
    if "error" in outcome:
        return f"connection: {outcome['error']}"
    status = outcome["status"]
    if status == 429:
        return "429 rate limited"
    if status >= 500:
        return f"{status} server error"
    if status >= 400:
        return f"{status} client error"
    return ""


def _busiest_minute(username: str) -> int:
    """The most runs of an actor created within any 60 s (by the server's clock)."""
    times = sorted(
        Run.objects.filter(actor__username=username).values_list("created_at", flat=True)
    )
    busiest, start = 0, 0
    for end, created in enumerate(times):
        while (created - times[start]).total_seconds() >= 60:
            start += 1
        busiest = max(busiest, end - start + 1)
    return busiest


def _report(load: Load, elapsed: float) -> list[str]:
    results = load.results
    steady = [outcome for outcome in results if not outcome["noisy"]]
    noisy = [outcome for outcome in results if outcome["noisy"]]
    answered = [outcome for outcome in steady if outcome.get("status") in (200, 202)]
    latencies = [outcome["ms"] for outcome in results]
    print(
        f"requests: {len(results)} in {elapsed:.1f} s (target {RATE:g}/s + noisy {NOISY_RATE:g}/s)"
    )
    throughput = len(results) / elapsed
    accepted_rate = len(answered) / elapsed
    print(f"throughput: {throughput:.1f} responses/s, {accepted_rate:.1f} accepted/s")
    print(
        "latency ms: "
        f"p50 {_percentile(latencies, 0.50):.1f}, p95 {_percentile(latencies, 0.95):.1f}, "
        f"p99 {_percentile(latencies, 0.99):.1f}, max {max(latencies, default=0):.1f}"
    )
    print("responses:", dict(sorted(Counter(o.get("status", "none") for o in results).items())))
    errors = Counter(_error_class(outcome) for outcome in results)
    errors.pop("", None)
    print("errors by class:", dict(errors) or "none")

    failures = []
    server_errors = sum(
        1 for outcome in results if "error" in outcome or outcome.get("status", 0) >= 500
    )
    if server_errors:
        failures.append(f"{server_errors} requests got a 5xx or no answer")
    refused = sum(1 for outcome in results if 400 <= outcome.get("status", 0) < 500) - sum(
        1 for outcome in results if outcome.get("status") == 429
    )
    if refused:
        failures.append(f"{refused} well-formed requests were refused (4xx other than 429)")
    first_runs: dict[str, str] = {}
    for outcome in sorted(answered, key=lambda o: o["duplicate"]):
        first_runs.setdefault(outcome["key"], outcome["run_id"])
    duplicates = [outcome for outcome in answered if outcome["duplicate"]]
    mismatched = [o for o in duplicates if first_runs[o["key"]] != o["run_id"]]
    runs_made = Run.objects.filter(ingress__idempotency_key__startswith="load-").count()
    print(
        f"duplicates: {sum(o['duplicate'] for o in steady)} sent, "
        f"{len(duplicates) - len(mismatched)} answered with their first delivery's run, "
        f"{len(mismatched)} with another; runs made {runs_made} for "
        f"{len(first_runs)} distinct keys accepted"
    )
    if mismatched or runs_made != len(first_runs):
        failures.append("a duplicate delivery made a second run")
    accepted_noisy = sum(outcome.get("status") == 202 for outcome in noisy)
    limited_noisy = sum(outcome.get("status") == 429 for outcome in noisy)
    busiest = _busiest_minute("load-noisy")
    print(
        f"noisy actor: {len(noisy)} sent at {NOISY_RATE:g}/s, {accepted_noisy} accepted, "
        f"{limited_noisy} refused 429; most runs made in any 60 s: {busiest} "
        f"(limit {ACTOR_RATE_PER_MINUTE})"
    )
    if busiest > ACTOR_RATE_PER_MINUTE:
        failures.append("the per-actor rate limit did not hold")
    if any(o.get("status") == 429 and not o.get("retry_after") for o in results):
        failures.append("a 429 without Retry-After")
    return failures


def main() -> int:
    actor_keys, noisy_key = _prepare()
    port = _free_port()
    server = _serve(port)
    try:
        load = Load(f"http://127.0.0.1:{port}", actor_keys, noisy_key)
        elapsed = load.run()
        failures = _report(load, elapsed)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        client = redis.Redis.from_url(settings.REDIS_URL)
        print(f"queued run tasks dropped: {client.llen(QUEUE)}")
        client.delete(QUEUE)
        for key in client.scan_iter(match=f"{CACHE_PREFIX}:*"):
            client.delete(key)
        client.close()
        from django.db import connections

        connections.close_all()
        SCRATCH.drop()
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
