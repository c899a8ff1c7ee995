"""Settings, all from the environment.

With no DATABASE_URL and no REDIS_URL the platform runs on the embedded default: SQLite and
Celery in eager mode. DEBUG is off unless asked for, and then SECRET_KEY must be given.
"""

import os
from pathlib import Path

import environ
from csp.constants import NONE, SELF, UNSAFE_INLINE
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
# A local .env (made from .env.example by `make install`) fills in what the environment
# leaves unset; real environment variables always win.
ENV_FILE = Path(env.str("ENV_FILE", default=str(BASE_DIR / ".env")))
if ENV_FILE.is_file():
    environ.Env.read_env(ENV_FILE)

DEBUG = env.bool("DEBUG", default=False)

SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = "insecure-development-key-used-only-with-debug-on-never-in-production"
elif not DEBUG and (
    len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5 or SECRET_KEY.startswith("django-insecure-")
):
    # What Django's deploy check (security.W009) calls weak: sessions, CSRF tokens and
    # password resets are signed with it.
    raise ImproperlyConfigured(
        "SECRET_KEY is weak: use 50 characters or more, of 5 different ones at least, e.g. "
        "python -c 'import secrets; print(secrets.token_urlsafe(50))'."
    )

# Recorded in every run's capability snapshot: development, staging, production, ...
ENVIRONMENT = env.str("ENVIRONMENT", default="development")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "guardian",
    "simple_history",
    "django_celery_beat",
    "registry",
    "runs",
    "approvals",
    "evaluations",
    "examples",
]

MIDDLEWARE = [
    "config.middleware.UnreadableContentTypeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "config.middleware.ApiBodySizeLimitMiddleware",
    "config.middleware.NulQueryRefusalMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "config.middleware.PrivateResponsesMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "simple_history.middleware.HistoryRequestMiddleware",
]

ROOT_URLCONF = "config.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

DATABASE_URL = env.str("DATABASE_URL", default="") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
DATABASES = {"default": environ.Env.db_url_config(DATABASE_URL)}
DATABASES["default"]["ATOMIC_REQUESTS"] = False
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=0)
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Hot statements (config.queries.prepared_cursor) are prepared on a connection once they
    # have run this many times on it; empty turns preparing off (a pooler in transaction
    # mode that cannot keep prepared statements).
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = (
        int(threshold) if (threshold := env.str("DB_PREPARE_THRESHOLD", default="5")) else None
    )
# A Celery worker process keeps its connection between tasks for this many seconds (checked
# before each task), where the web serves ASGI and keeps DB_CONN_MAX_AGE (config/celery.py).
WORKER_DB_CONN_MAX_AGE = env.int("WORKER_DB_CONN_MAX_AGE", default=300)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# The path the ASGI application serves STATIC_ROOT at (config/asgi.py): STATIC_URL without the
# script prefix, which Django adds to STATIC_URL once, when it is first read.
STATIC_ROUTE = "/" + STATIC_URL
STATIC_ROOT = BASE_DIR / "staticfiles"

# Uploaded attachments live here, outside STATIC_ROOT and with no URL: no web server serves
# them, and the platform reads them only through the "attachments" storage.
PRIVATE_STORAGE_ROOT = Path(
    env.str("PRIVATE_STORAGE_ROOT", default=str(BASE_DIR / "var" / "attachments"))
).resolve()
if PRIVATE_STORAGE_ROOT.is_relative_to(STATIC_ROOT.resolve()):
    raise ImproperlyConfigured(
        f"PRIVATE_STORAGE_ROOT ({PRIVATE_STORAGE_ROOT}) must lie outside STATIC_ROOT "
        f"({STATIC_ROOT}): every file there is served to anyone under {STATIC_ROUTE}."
    )

STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "attachments": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {
            "location": str(PRIVATE_STORAGE_ROOT),
            "file_permissions_mode": 0o600,
            "directory_permissions_mode": 0o700,
        },
    },
}

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "approvals:queue"

# Redis: Celery broker, cache (rate limits, throttles, circuit state). Absent: embedded default.
REDIS_URL = env.str("REDIS_URL", default="")

if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": env.str("CACHE_KEY_PREFIX", default="agentgov"),
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# In memory (the embedded default); the host is named so that kombu does not warn it is missing.
CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
# Plain Redis goes through kombu's transport with one client for what a channel sends.
CELERY_BROKER_TRANSPORT = "config.broker:Transport" if REDIS_URL.startswith("redis://") else None
# The queue tasks are sent to (and workers consume with `--queues`), by default "celery".
CELERY_TASK_DEFAULT_QUEUE = env.str("CELERY_QUEUE", default="celery")
CELERY_TASK_ALWAYS_EAGER = not REDIS_URL
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Pool processes of a worker started without --concurrency: two per core, as a run's task
# spends about half its time waiting (PostgreSQL, Redis, a tool handler's thread, and a
# provider's answer for seconds), which one process per core would leave the cores idle for.
CELERY_WORKER_CONCURRENCY = env.int("CELERY_WORKER_CONCURRENCY", default=2 * (os.cpu_count() or 1))
if CELERY_WORKER_CONCURRENCY < 1:
    raise ImproperlyConfigured(
        f"CELERY_WORKER_CONCURRENCY must be at least 1 (it is {CELERY_WORKER_CONCURRENCY})."
    )
# Celery's Django fixup closes every database connection around each task, so each task
# would start a PostgreSQL backend, unless it reuses them: then it closes them only every
# this many tasks, and WORKER_DB_CONN_MAX_AGE decides (config/celery.py).
CELERY_DB_REUSE_MAX = 10_000
CELERY_TASK_TIME_LIMIT = env.int("CELERY_TASK_TIME_LIMIT", default=600)
CELERY_TASK_SOFT_TIME_LIMIT = env.int("CELERY_TASK_SOFT_TIME_LIMIT", default=540)
# Longer than the longest task, so a slow task is never redelivered while it still runs.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_TASK_TIME_LIMIT * 2}
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Discovery of every enabled MCP server (drafts for review, drift marked) runs this often.
MCP_DISCOVERY_INTERVAL_SECONDS = env.int("MCP_DISCOVERY_INTERVAL_SECONDS", default=3600)
# An eval task runs cases for this long, then continues in a new task; a running eval run
# whose lease lapsed (its worker died mid-case) is advanced again by the sweep.
EVAL_TASK_SECONDS = env.int("EVAL_TASK_SECONDS", default=240)
EVAL_CASE_LEASE_SECONDS = env.int("EVAL_CASE_LEASE_SECONDS", default=360)
CELERY_BEAT_SCHEDULE = {
    "runs-sweep": {"task": "runs.tasks.runs_sweep", "schedule": 30.0},
    "actions-sweep": {"task": "approvals.tasks.actions_sweep", "schedule": 60.0},
    "memories-expire": {"task": "runs.tasks.memories_expire", "schedule": 3600.0},
    "attachment-orphans-remove": {
        "task": "runs.tasks.attachment_orphans_remove",
        "schedule": 3600.0,
    },
    "scheduled-tasks-sweep": {"task": "runs.tasks.scheduled_tasks_sweep", "schedule": 30.0},
    "eval-runs-sweep": {"task": "evaluations.tasks.eval_runs_sweep", "schedule": 60.0},
    "mcp-discover": {
        "task": "registry.tasks.mcp_servers_discover",
        "schedule": float(MCP_DISCOVERY_INTERVAL_SECONDS),
    },
}

# The embedded default (no EMAIL_HOST) writes each mail to a file under var/mail, which the
# demo shows; with EMAIL_HOST set, mail goes to that SMTP server.
EMAIL_BACKEND = env.str(
    "EMAIL_BACKEND",
    default="django.core.mail.backends.smtp.EmailBackend"
    if env.str("EMAIL_HOST", default="")
    else "django.core.mail.backends.filebased.EmailBackend",
)
EMAIL_FILE_PATH = env.str("EMAIL_FILE_PATH", default=str(BASE_DIR / "var" / "mail"))
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", default=False)
EMAIL_TIMEOUT = env.int("EMAIL_TIMEOUT", default=10)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="agents@localhost")
# The domain of the Message-IDs the mail tool derives from its idempotency keys, and an
# optional function (dotted path: message_id -> True | False | None) that asks the mail
# server whether it accepted a message, for reconciling interrupted deliveries.
MAIL_MESSAGE_ID_DOMAIN = env.str("MAIL_MESSAGE_ID_DOMAIN", default="agentgov.local")
MAIL_DELIVERY_LOOKUP = env.str("MAIL_DELIVERY_LOOKUP", default="")
# An SMTP exchange whose worker died is over after this long: if the server says it never
# accepted the message, reconciliation sends it (each of its steps may wait EMAIL_TIMEOUT).
MAIL_ATTEMPT_SECONDS = env.int("MAIL_ATTEMPT_SECONDS", default=EMAIL_TIMEOUT * 10)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["registry.authentication.ApiTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["registry.api.permissions.IsTenantMember"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "config.api.ContentNegotiation",
    "DEFAULT_PARSER_CLASSES": ["config.api.StrictJSONParser"],
    "DEFAULT_FILTER_BACKENDS": ["config.api.FilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "config.api.Pagination",
    "DEFAULT_SCHEMA_CLASS": "config.schema.AutoSchema",
    "EXCEPTION_HANDLER": "config.api.exception_handler",
    "DEFAULT_THROTTLE_RATES": {
        "auth_token": env.str("AUTH_TOKEN_RATE", default="30/min"),
        "auth_account": env.str("AUTH_ACCOUNT_RATE", default="60/hour"),
        "ingress_actor": env.str("INGRESS_ACTOR_RATE", default="120/min"),
        "ingress_tenant": env.str("INGRESS_TENANT_RATE", default="1200/min"),
    },
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    # The client a throttle counts is the peer's address, unless this many proxies of ours
    # stand in front and append to X-Forwarded-For: a header the client sends itself would
    # otherwise give it a new identity, and new tries, with each request.
    "NUM_PROXIES": env.int("NUM_PROXIES", default=0),
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Agent Governance Platform API",
    "DESCRIPTION": (
        "Versioned tools and skills, governed agent runs, hash-bound approvals. "
        'Every error has the body {"error": {"code", "message", "details"}}.'
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "VersionStatusEnum": "registry.choices.VersionStatus",
        "RunStatusEnum": "runs.choices.RunStatus",
        "DataClassificationEnum": "registry.choices.DataClassification",
        "SuiteKindEnum": "evaluations.choices.SuiteKind",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "config.api.add_error_responses",
    ],
}

# The largest JSON body the API reads; larger ones are refused with 413 before being read.
API_MAX_BODY_BYTES = env.int("API_MAX_BODY_BYTES", default=1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES

# POST /api/v1/attachments: the largest file and the media types accepted (the part's declared
# type must be the type its content shows). Its body is bounded by ATTACHMENT_MAX_BYTES plus
# ATTACHMENT_MULTIPART_OVERHEAD_BYTES (boundary, part headers) instead of API_MAX_BODY_BYTES.
ATTACHMENT_MAX_BYTES = env.int("ATTACHMENT_MAX_BYTES", default=10 * 1024 * 1024)
ATTACHMENT_MULTIPART_OVERHEAD_BYTES = 16 * 1024
ATTACHMENT_MEDIA_TYPES = [
    "text/plain",
    "text/csv",
    "application/json",
    "application/pdf",
    "image/png",
    "image/jpeg",
]
# When a run starts, the text of its message's attachments (text, CSV, JSON, a PDF's first
# ATTACHMENT_PDF_MAX_PAGES pages) is read, at most this many bytes for all of them together.
ATTACHMENT_EXCERPT_MAX_BYTES = env.int("ATTACHMENT_EXCERPT_MAX_BYTES", default=8 * 1024)
ATTACHMENT_PDF_MAX_PAGES = env.int("ATTACHMENT_PDF_MAX_PAGES", default=20)
# Extracting a PDF's text stops after this long, and the model is told it was not read.
ATTACHMENT_PDF_MAX_SECONDS = env.float("ATTACHMENT_PDF_MAX_SECONDS", default=10.0)
# A stored file no Attachment row names (its upload died before the row, or the row was rolled
# back) is removed by the hourly sweep once it is this old: longer than any upload, with the
# transaction around it, takes, so a file whose row is still to commit is never touched.
ATTACHMENT_ORPHAN_GRACE_SECONDS = env.int("ATTACHMENT_ORPHAN_GRACE_SECONDS", default=3600)

# Tool execution: calls of one step run in parallel up to this many; a result envelope
# larger than this is cut (the full evidence stays in the run's sources).
TOOL_PARALLELISM = env.int("TOOL_PARALLELISM", default=4)
TOOL_RESULT_MAX_BYTES = env.int("TOOL_RESULT_MAX_BYTES", default=16 * 1024)
# A tool call's arguments larger than this (as compact JSON) are refused at gate 2 and kept
# only as a note of their size, in the transcript, the events and the call's record.
TOOL_CALL_ARGUMENTS_MAX_BYTES = env.int("TOOL_CALL_ARGUMENTS_MAX_BYTES", default=64 * 1024)
# A call keeps this many of the sources its tool returned (the envelope says it was cut).
TOOL_RESULT_MAX_SOURCES = env.int("TOOL_RESULT_MAX_SOURCES", default=100)
# An HTTP tool's answer larger than this fails the call (UPSTREAM_ERROR) as it arrives, as
# does an MCP tool's (its texts and structured content) once received.
TOOL_RESPONSE_MAX_BYTES = env.int("TOOL_RESPONSE_MAX_BYTES", default=4 * 1024 * 1024)
# The most a model provider's answer may hold (read as it arrives, never inflated).
MODEL_RESPONSE_MAX_BYTES = env.int("MODEL_RESPONSE_MAX_BYTES", default=4 * 1024 * 1024)
# The modules a `python` tool's handler may come from: a tool names code of this process, so
# a publisher chooses among handlers installed for tools, never any importable callable.
PYTHON_TOOL_HANDLER_MODULES = env.list("PYTHON_TOOL_HANDLER_MODULES", default=["examples.handlers"])
# The environment variables an object of a tenant (model config, MCP server, HTTP tool) may
# name as its credential, by tenant slug: {"acme": ["FETCH_TOKEN"]} (config/credentials.py).
TENANT_CREDENTIALS = env.json("TENANT_CREDENTIALS", default={})
if not isinstance(TENANT_CREDENTIALS, dict) or not all(
    isinstance(names, list) and all(isinstance(name, str) for name in names)
    for names in TENANT_CREDENTIALS.values()
):
    raise ImproperlyConfigured('TENANT_CREDENTIALS is a JSON object: {"tenant-slug": ["NAME"]}.')
# MCP servers: a worker lists a server's tools again (the drift check before a call) when its
# copy is older than this; a resource attached to a run keeps at most this much text.
MCP_DEFINITION_CACHE_SECONDS = env.int("MCP_DEFINITION_CACHE_SECONDS", default=30)
MCP_RESOURCE_MAX_BYTES = env.int("MCP_RESOURCE_MAX_BYTES", default=64 * 1024)

# The model context's token budget per turn (estimated locally, see runs/tokens.py). A
# message may take three quarters of it; the rest holds what is never cut (the platform's own
# rules and a task's inputs alone take some 200 tokens, then the skill and the tool schemas):
# below CONTEXT_MAX_TOKENS_MIN a turn with a skill and a tool would overrun it.
CONTEXT_MAX_TOKENS_MIN = 1000
CONTEXT_MAX_TOKENS = env.int("CONTEXT_MAX_TOKENS", default=8000)
if CONTEXT_MAX_TOKENS < CONTEXT_MAX_TOKENS_MIN:
    raise ImproperlyConfigured(
        f"CONTEXT_MAX_TOKENS ({CONTEXT_MAX_TOKENS}) is below {CONTEXT_MAX_TOKENS_MIN}: the "
        "rules, the task and the tool schemas are never cut, and would not fit."
    )
# How long a recipient the user chose stays confirmed in their session (seed 000, step 3).
RECIPIENT_CONFIRMATION_SECONDS = env.int("RECIPIENT_CONFIRMATION_SECONDS", default=7 * 24 * 3600)
# A running step renews its lease this long; the sweeper re-enqueues runs whose lease lapsed.
RUN_LEASE_SECONDS = env.int("RUN_LEASE_SECONDS", default=120)
# A run's task starts no step after this long and hands the run to a new task: far enough
# within the task's soft time limit for a step begun just before (a slow model turn) to end.
RUN_TASK_SECONDS = env.int("RUN_TASK_SECONDS", default=240)
# Each needs time left before the soft limit for the step (or case) begun just before it, and
# a tool call's retries are bounded by that time (runs/tools/executor.py `tries_deadline`).
for _name, _seconds in (
    ("RUN_TASK_SECONDS", RUN_TASK_SECONDS),
    ("EVAL_TASK_SECONDS", EVAL_TASK_SECONDS),
    ("CELERY_TASK_SOFT_TIME_LIMIT", CELERY_TASK_SOFT_TIME_LIMIT),
):
    _limit, _limit_name = (
        (CELERY_TASK_TIME_LIMIT, "CELERY_TASK_TIME_LIMIT")
        if _name == "CELERY_TASK_SOFT_TIME_LIMIT"
        else (CELERY_TASK_SOFT_TIME_LIMIT, "CELERY_TASK_SOFT_TIME_LIMIT")
    )
    if not 0 < _seconds < _limit:
        raise ImproperlyConfigured(
            f"{_name} must be more than 0 and less than {_limit_name} ({_limit}), "
            f"it is {_seconds}: a task would be stopped in the middle of its work."
        )
# A cancel waits this long for a run another transaction holds (PostgreSQL; 0: not at all):
# a short writer (an approval decision, a session's next message) lets go within it; a step
# asking a model does not, and the cancel is kept beside the run for the step's boundary.
RUN_CANCEL_LOCK_WAIT_MS = env.int("RUN_CANCEL_LOCK_WAIT_MS", default=250)
# An approved action's send starts before the action expires; one approved in its last
# minutes has this long after the decision (the actions sweep resends a lost resume within
# about six minutes). A send that could not start by then is not made (APPROVAL_STALE).
APPROVAL_RESUME_GRACE_SECONDS = env.int("APPROVAL_RESUME_GRACE_SECONDS", default=15 * 60)
# A scheduled task's occurrence holds a lease this long while its run is started; a start
# whose lease lapsed is taken over by the sweep (runs.services.scheduler).
SCHEDULED_TASK_LEASE_SECONDS = env.int("SCHEDULED_TASK_LEASE_SECONDS", default=60)

# A run's event stream closes after this long; the client reconnects with Last-Event-ID.
RUN_STREAM_MAX_SECONDS = env.int("RUN_STREAM_MAX_SECONDS", default=300)

# An API token stops working this long after it was issued.
API_TOKEN_TTL_HOURS = env.int("API_TOKEN_TTL_HOURS", default=24 * 30)
if API_TOKEN_TTL_HOURS < 1:
    raise ImproperlyConfigured(
        f"API_TOKEN_TTL_HOURS must be at least 1 (it is {API_TOKEN_TTL_HOURS}): every token "
        "issued would be expired already."
    )

# History is evidence: it is browsed, never used to revert a row (a published version is frozen).
SIMPLE_HISTORY_REVERT_DISABLED = True
# Why a row changed is kept whole (a revoke or deprecate reason, a publish override), not cut
# to a column of 100 characters.
SIMPLE_HISTORY_HISTORY_CHANGE_REASON_USE_TEXT_FIELD = True

GUARDIAN_RAISE_403 = False
ANONYMOUS_USER_NAME = None

# Addresses no tool, model provider or MCP server call may reach (config/egress.py): the
# link-local networks, where clouds serve instance metadata and credentials, and Alibaba
# Cloud's metadata address.
EGRESS_DENIED_NETWORKS = env.list(
    "EGRESS_DENIED_NETWORKS",
    default=["169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "100.100.100.200/32"],
)

SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# Pages show what tools and models returned: should any of it ever get past escaping, no
# script but the platform's own files runs, and nothing is sent or loaded anywhere else.
# Styles may be inline (the pages' own style blocks and the trace waterfall's widths).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF, UNSAFE_INLINE],
        "img-src": [SELF, "data:"],
        "font-src": [SELF, "data:"],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [NONE],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    }
}
SESSION_COOKIE_HTTPONLY = True
if not DEBUG:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    # X-Forwarded-Proto says a request came over HTTPS only when a proxy of ours sets it and
    # no client reaches the platform past that proxy: otherwise a client sending the header
    # itself would be taken as on HTTPS, past the redirect.
    if env.bool("TRUSTED_PROXY_SSL_HEADER", default=False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=60 * 60 * 24 * 365)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True

# Long-term memory (runs.services.memory): the longest value kept, each kind's lifetime in
# days, the most items a task retrieves.
MEMORY_VALUE_MAX_CHARS = env.int("MEMORY_VALUE_MAX_CHARS", default=500)
MEMORY_TTL_DAYS = {"preference": 365, "fact": 180, "task_state": 30}
MEMORY_RETRIEVE_MAX = env.int("MEMORY_RETRIEVE_MAX", default=20)
# Items kept per user and tenant: a new key beyond it is refused (replacing one is not).
MEMORY_ITEMS_MAX = env.int("MEMORY_ITEMS_MAX", default=200)

# Run spans also go to an OpenTelemetry collector over OTLP/HTTP when this is set (the
# exporter reads the other standard OTEL_EXPORTER_OTLP_* variables itself); off by default.
OTEL_EXPORTER_OTLP_ENDPOINT = env.str("OTEL_EXPORTER_OTLP_ENDPOINT", default="")
OTEL_SERVICE_NAME = env.str("OTEL_SERVICE_NAME", default="agentgov")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {"suspicious_request": {"()": "config.log_filters.SuspiciousRequestAsWarning"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["suspicious_request"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    # At DEBUG the MCP SDK logs whole protocol messages (tool results included), the model
    # SDKs their requests, and httpcore every header of every answer (an upstream may echo a
    # credential): never kept.
    # pypdf's warnings and errors quote a PDF's own dictionaries (an uploaded attachment's
    # words): never kept; a PDF that cannot be read is logged by the kind of its fault.
    "loggers": {
        **{
            name: {"level": "INFO"}
            for name in ("mcp", "openai", "anthropic", "httpcore", "httpcore2", "hpack")
        },
        "pypdf": {"level": "CRITICAL"},
    },
}
