"""Settings come from the environment: each case runs in a fresh interpreter with a controlled
environment, so nothing leaks in from the test run's own variables."""

import json
import os
import secrets
import string
import subprocess
import sys
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parents[2]

# Prints what the embedded default decides: the database engine and Celery's configuration as
# the Celery app itself sees it.
SHOW_SETTINGS = """
import json, django
django.setup()
from django.conf import settings
from config.celery import app
print(json.dumps({
    "engine": settings.DATABASES["default"]["ENGINE"],
    "eager": settings.CELERY_TASK_ALWAYS_EAGER,
    "broker": settings.CELERY_BROKER_URL,
    "app_eager": app.conf.task_always_eager,
    "app_broker": app.conf.broker_url,
    "cache": settings.CACHES["default"]["BACKEND"],
}))
"""


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Python with only PATH and `env` set (no DATABASE_URL, REDIS_URL... unless given), and
    no local .env file: these tests are about the settings' own defaults."""
    environment = {
        "PATH": os.environ["PATH"],
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "ENV_FILE": "/nonexistent/.env",
        **env,
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=BASE_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _random_secret_key() -> str:
    alphabet = string.ascii_letters + string.digits + "!@#%^&*(-_=+)"
    return "".join(secrets.choice(alphabet) for _ in range(60))


def test_settings_refuse_to_load_without_a_secret_key_when_debug_is_off():
    result = _run("-c", "import config.settings", DEBUG="0")

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "SECRET_KEY" in result.stderr


def test_settings_refuse_an_empty_secret_key_when_debug_is_off():
    result = _run("-c", "import config.settings", DEBUG="0", SECRET_KEY="")

    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


@pytest.mark.parametrize(
    "key",
    ["short", "a" * 60, "django-insecure-" + "x1y2z3w4v5" * 5],
    ids=["short", "one-character", "django-insecure"],
)
def test_settings_refuse_a_weak_secret_key_when_debug_is_off(key):
    result = _run("-c", "import config.settings", DEBUG="0", SECRET_KEY=key)

    assert result.returncode != 0
    assert "SECRET_KEY is weak" in result.stderr
    assert key not in result.stderr


def test_tenant_credentials_are_read_as_json_and_refused_in_any_other_shape():
    show = "from django.conf import settings; print(settings.TENANT_CREDENTIALS)"
    granted = _run(
        "-c",
        "import django; django.setup(); " + show,
        DEBUG="1",
        TENANT_CREDENTIALS='{"acme": ["FETCH_TOKEN"]}',
    )
    refused = _run("-c", "import config.settings", DEBUG="1", TENANT_CREDENTIALS='["FETCH_TOKEN"]')

    assert granted.stdout.strip() == "{'acme': ['FETCH_TOKEN']}", granted.stderr
    assert refused.returncode != 0
    assert "TENANT_CREDENTIALS is a JSON object" in refused.stderr


@pytest.mark.parametrize("hours", ["0", "-24"])
def test_an_api_token_lifetime_of_no_hours_is_refused(hours):
    # every token issued would be expired already: no client could use the API
    result = _run("-c", "import config.settings", DEBUG="1", API_TOKEN_TTL_HOURS=hours)

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "API_TOKEN_TTL_HOURS must be at least 1" in result.stderr


def test_an_api_token_lifetime_is_read_in_hours():
    show = "from django.conf import settings; print(settings.API_TOKEN_TTL_HOURS)"

    result = _run(
        "-c", "import django; django.setup(); " + show, DEBUG="1", API_TOKEN_TTL_HOURS="1"
    )

    assert result.stdout.strip() == "1", result.stderr


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"RUN_TASK_SECONDS": "540"}, "RUN_TASK_SECONDS"),
        ({"EVAL_TASK_SECONDS": "600"}, "EVAL_TASK_SECONDS"),
        ({"CELERY_TASK_SOFT_TIME_LIMIT": "600"}, "CELERY_TASK_SOFT_TIME_LIMIT"),
    ],
    ids=["run-task-at-the-soft-limit", "eval-task-past-it", "soft-limit-at-the-hard-limit"],
)
def test_a_task_s_time_that_leaves_its_step_no_time_before_the_limit_is_refused(limits, named):
    # a task that starts a step at its soft time limit has it interrupted mid-step, its work
    # lost, and a tool call would never be tried again (no time left for another try)
    result = _run("-c", "import config.settings", DEBUG="1", **limits)

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert named in result.stderr


SHOW_CONCURRENCY = (
    "import json, os, django; django.setup(); from config.celery import app; "
    "print(json.dumps([app.conf.worker_concurrency, os.cpu_count()]))"
)


def test_a_worker_runs_two_pool_processes_per_core_unless_told_otherwise():
    # a run's task spends about half its time waiting (on PostgreSQL, Redis, a handler
    # thread; a provider's answer for seconds): one process per core would leave the cores
    # idle while they wait
    default = _run("-c", SHOW_CONCURRENCY, DEBUG="1")
    chosen = _run("-c", SHOW_CONCURRENCY, DEBUG="1", CELERY_WORKER_CONCURRENCY="6")
    refused = _run("-c", "import config.settings", DEBUG="1", CELERY_WORKER_CONCURRENCY="0")

    concurrency, cores = json.loads(default.stdout)
    assert concurrency == 2 * cores, default.stderr
    assert json.loads(chosen.stdout)[0] == 6, chosen.stderr
    assert refused.returncode != 0
    assert "CELERY_WORKER_CONCURRENCY" in refused.stderr


def test_a_context_budget_too_small_for_any_turn_is_refused_at_start():
    # the rules, the task and the tool schemas are never cut: a budget below what they take
    # would only be overrun by every turn
    show = "from django.conf import settings; print(settings.CONTEXT_MAX_TOKENS)"
    refused = _run("-c", "import config.settings", DEBUG="1", CONTEXT_MAX_TOKENS="200")
    smallest = _run(
        "-c", "import django; django.setup(); " + show, DEBUG="1", CONTEXT_MAX_TOKENS="1000"
    )

    assert refused.returncode != 0
    assert "CONTEXT_MAX_TOKENS (200) is below 1000" in refused.stderr
    assert smallest.stdout.strip() == "1000", smallest.stderr


@pytest.mark.parametrize(
    "root",
    [str(BASE_DIR / "staticfiles"), str(BASE_DIR / "staticfiles" / "attachments"), "staticfiles/x"],
    ids=["static-root", "inside-static-root", "relative-inside-static-root"],
)
def test_attachments_may_not_be_stored_where_static_files_are_served(root):
    # every file under STATIC_ROOT is served to anyone at /static/, unauthenticated
    result = _run("-c", "import config.settings", DEBUG="1", PRIVATE_STORAGE_ROOT=root)

    assert result.returncode != 0
    assert "PRIVATE_STORAGE_ROOT" in result.stderr
    assert "must lie outside STATIC_ROOT" in result.stderr


def test_attachments_may_be_stored_beside_the_static_files():
    show = "from django.conf import settings; print(settings.STORAGES['attachments'])"
    root = BASE_DIR / "staticfiles-private"

    result = _run(
        "-c", "import django; django.setup(); " + show, DEBUG="1", PRIVATE_STORAGE_ROOT=str(root)
    )

    assert result.returncode == 0, result.stderr
    assert f"'location': '{root}'" in result.stdout


def test_debug_is_off_unless_asked_for():
    # given no DEBUG at all, a secret key is still required: DEBUG defaults to off
    result = _run("-c", "import config.settings")

    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


def test_a_local_env_file_fills_in_what_the_environment_leaves_unset(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("DEBUG=1\nALLOWED_HOSTS=from-file.example\n")
    code = "from django.conf import settings; print(settings.DEBUG, settings.ALLOWED_HOSTS)"

    from_file = _run("-c", f"import django; django.setup(); {code}", ENV_FILE=str(env_file))
    overridden = _run(
        "-c",
        f"import django; django.setup(); {code}",
        ENV_FILE=str(env_file),
        ALLOWED_HOSTS="from-env.example",
    )

    assert from_file.stdout.split() == ["True", "['from-file.example']"]
    assert overridden.stdout.split() == ["True", "['from-env.example']"]


def test_deploy_check_passes_with_production_settings():
    # given DEBUG off, a strong secret key and a host, on the embedded database
    result = _run(
        "manage.py",
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        DEBUG="0",
        SECRET_KEY=_random_secret_key(),
        ALLOWED_HOSTS="example.com",
    )

    # then Django's deployment checklist raises nothing, not even a warning
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


# What a request that says it came over HTTPS (X-Forwarded-Proto: https) on plain HTTP gets:
# whether it counts as secure, and the HTTPS redirect's status (301) or none (the page's own).
SHOW_FORWARDED_PROTO = """
import json, django
django.setup()
from django.test import Client, RequestFactory
request = RequestFactory().get("/", HTTP_X_FORWARDED_PROTO="https")
response = Client().get("/accounts/login/", HTTP_X_FORWARDED_PROTO="https")
print(json.dumps([request.is_secure(), response.status_code]))
"""


def test_a_client_s_own_forwarded_proto_header_does_not_make_its_request_secure():
    # given production settings and no proxy said to set X-Forwarded-Proto
    production = {"DEBUG": "0", "SECRET_KEY": _random_secret_key(), "ALLOWED_HOSTS": "testserver"}

    # when a client on plain HTTP sends X-Forwarded-Proto: https itself
    result = _run("-c", SHOW_FORWARDED_PROTO, **production)

    # then its request is not secure, and it is still sent to HTTPS
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [False, 301]


def test_a_trusted_proxy_s_forwarded_proto_header_makes_the_request_secure():
    # given production settings behind a proxy that sets X-Forwarded-Proto
    production = {"DEBUG": "0", "SECRET_KEY": _random_secret_key(), "ALLOWED_HOSTS": "testserver"}

    # when the proxy says the request came over HTTPS
    result = _run("-c", SHOW_FORWARDED_PROTO, TRUSTED_PROXY_SSL_HEADER="1", **production)

    # then the request is secure and not redirected
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [True, 200]


def test_embedded_default_uses_sqlite_and_eager_celery():
    result = _run("-c", SHOW_SETTINGS, DEBUG="1")

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "engine": "django.db.backends.sqlite3",
        "eager": True,
        "broker": "memory://localhost/",
        "app_eager": True,
        "app_broker": "memory://localhost/",
        "cache": "django.core.cache.backends.locmem.LocMemCache",
    }


def test_empty_service_urls_mean_the_embedded_default():
    # `make run` sets DATABASE_URL= and REDIS_URL= (empty): same as unset
    result = _run("-c", SHOW_SETTINGS, DEBUG="1", DATABASE_URL="", REDIS_URL="")

    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)
    assert (settings["engine"], settings["eager"], settings["broker"]) == (
        "django.db.backends.sqlite3",
        True,
        "memory://localhost/",
    )


def test_service_urls_switch_to_postgresql_and_a_redis_broker():
    redis_url = "redis://127.0.0.1:6379/3"

    result = _run(
        "-c",
        SHOW_SETTINGS,
        DEBUG="1",
        DATABASE_URL="postgres://agents:secret@db.internal:5432/agentgov",
        REDIS_URL=redis_url,
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "engine": "django.db.backends.postgresql",
        "eager": False,
        "broker": redis_url,
        "app_eager": False,
        "app_broker": redis_url,
        "cache": "django.core.cache.backends.redis.RedisCache",
    }


SHOW_PREPARE_THRESHOLD = """
import json, django
django.setup()
from django.conf import settings
options = settings.DATABASES["default"].get("OPTIONS", {})
print(json.dumps(options.get("prepare_threshold", "unset")))
"""


def test_prepared_statements_follow_db_prepare_threshold_and_an_empty_one_turns_them_off():
    postgresql = {"DEBUG": "1", "DATABASE_URL": "postgres://agents@db.internal:5432/agentgov"}

    default = _run("-c", SHOW_PREPARE_THRESHOLD, **postgresql)
    fewer = _run("-c", SHOW_PREPARE_THRESHOLD, DB_PREPARE_THRESHOLD="2", **postgresql)
    off = _run("-c", SHOW_PREPARE_THRESHOLD, DB_PREPARE_THRESHOLD="", **postgresql)
    sqlite = _run("-c", SHOW_PREPARE_THRESHOLD, DEBUG="1")

    outputs = [json.loads(result.stdout) for result in (default, fewer, off, sqlite)]
    assert outputs == [5, 2, None, "unset"]


RUNNING_EXAMPLE = """
import json, uuid, django
django.setup()
from django.contrib.auth import get_user_model
from django.core.management import call_command
from registry.models import Tenant
from runs.models import Run, Session
from runs.services.ingress import message_ingest
call_command("migrate", verbosity=0)
call_command("seed_demo", verbosity=0)
run = message_ingest(
    actor=get_user_model().objects.get(username="alice"),
    tenant=Tenant.objects.get(slug="acme"),
    idempotency_key=str(uuid.uuid4()),
    channel="api",
    parts=[{"type": "text", "text": "Summarise this week's project status for the R&D lead."}],
    metadata={"project_id": "apollo"},
).run
run.refresh_from_db()
state = Session.objects.get(pk=run.session_id).state
print(json.dumps({
    "status": run.status,
    "seq": list(run.events.order_by("seq").values_list("seq", flat=True))
    == list(range(1, run.last_event_seq + 1)),
    "action": bool(run.result.get("action", {}).get("payload_hash")),
    "project_id": state.get("project_id"),
    "drafts": [draft["run_id"] for draft in state.get("drafts", [])] == [str(run.pk)],
}))
"""


def test_embedded_default_takes_the_running_example_to_approval(tmp_path):
    # `make run`: SQLite, Celery eager, the demo data and the offline planner
    result = _run(
        "-c",
        RUNNING_EXAMPLE,
        DEBUG="1",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "status": "WAITING_APPROVAL",
        "seq": True,
        "action": True,
        "project_id": "apollo",
        "drafts": True,
    }
