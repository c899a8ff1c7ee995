import copy
import io
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date

import pytest
import redis
from django.conf import settings
from django.core import signals
from django.core.cache import cache
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connections
from django.db.backends.postgresql import operations as postgresql_operations
from django.test import override_settings
from django.utils import timezone
from pytest_django.fixtures import validate_django_db
from rest_framework.test import APIClient

from registry import generation, selectors
from registry.choices import Role
from registry.demo import seed_demo
from registry.services import skills, tools
from registry.services.tenancy import api_token_issue, membership_add
from runs import capability
from runs.tools import threads
from tests.celery_worker import (  # noqa: F401 (real-worker and broker fixtures)
    broker,
    celery_queue,
    start_worker,
)
from tests.faults import FAULT_TABLE, FaultRow, fault_report, fault_table_lines
from tests.registry.factories import (
    PASSWORD,
    TenantFactory,
    UserFactory,
    skill_content,
    tool_content,
)
from tests.security.fuzzing import FUZZ_COUNTS, fuzz_count_lines


@pytest.fixture
def private_root(settings, tmp_path):
    """Attachments go to a directory of this test, never into the repository."""
    root = tmp_path / "private" / "attachments"
    storages = copy.deepcopy(settings.STORAGES)
    storages["attachments"]["OPTIONS"]["location"] = str(root)
    settings.STORAGES = storages
    settings.PRIVATE_STORAGE_ROOT = root
    return root


@pytest.fixture(scope="session")
def django_db_modify_db_settings():
    """A test database of this process's own, so two test sessions never share one."""
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("postgresql"):
        database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_{os.getpid()}"


@pytest.fixture(scope="session", autouse=True)
def _tool_threads_stopped_before_the_database_is_dropped(django_db_setup):
    """The parallel tool-call threads keep database connections; they end first."""
    yield
    threads.stop(abandoned_wait_s=ABANDONED_HANDLERS_WAIT_SECONDS)


# How long the end of the session waits for handlers that tests abandoned to return.
ABANDONED_HANDLERS_WAIT_SECONDS = 30


def _rolled_back(item) -> bool:
    """Whether the test runs inside a transaction that is rolled back (the `db` fixture)."""
    marker = item.get_closest_marker("django_db")
    if marker is None and "db" not in item.fixturenames:
        return False
    transactional = marker is not None and validate_django_db(marker)[0]
    return not (
        transactional
        or "transactional_db" in item.fixturenames
        or "live_server" in item.fixturenames
    )


FAST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass(frozen=True)
class DemoDatabase:
    """The seeded copy: its name, the test database's, and the day it was seeded."""

    name: str
    plain: str
    seeded_on: date


DEMO_DATABASE = pytest.StashKey[DemoDatabase]()


@pytest.fixture(scope="session", autouse=True)
def demo_database(request, django_db_setup, django_db_blocker) -> Iterator[DemoDatabase | None]:
    """A copy of the empty test database with the running example seeded and committed, made
    once per session on PostgreSQL (None elsewhere). Seeding takes some 400 statements, which
    a test of the running example would otherwise repeat in its own transaction. It is made
    before any test runs: copying a database needs it to have no other connection."""
    connection = connections[DEFAULT_DB_ALIAS]
    if connection.vendor != "postgresql":
        yield None
        return
    with django_db_blocker.unblock():
        connection.creation.clone_test_db(suffix="demo", verbosity=0)
        database = DemoDatabase(
            name=connection.creation.get_test_db_clone_settings("demo")["NAME"],
            plain=connection.settings_dict["NAME"],
            seeded_on=timezone.localdate(),
        )
        _connect(database.name)
        try:
            with override_settings(PASSWORD_HASHERS=FAST_PASSWORD_HASHERS):
                seed_demo()
            seeded = _table_digests()
        finally:
            _connect(database.plain)
    request.session.stash[DEMO_DATABASE] = database
    yield database
    del request.session.stash[DEMO_DATABASE]
    with django_db_blocker.unblock():
        _connect(database.name)
        try:
            changed = sorted(
                table for table, digest in _table_digests().items() if seeded.get(table) != digest
            )
        finally:
            _connect(database.plain)
        with connection._nodb_cursor() as cursor:
            cursor.execute(f"DROP DATABASE {connection.ops.quote_name(database.name)} WITH (FORCE)")
    assert not changed, f"A test committed a change to the seeded copy, in {changed}."


@pytest.fixture(scope="session", autouse=True)
def _flush_deletes_rows():
    """A transactional test's database is emptied after it (Django's flush) with DELETE on
    PostgreSQL, not TRUNCATE: a TRUNCATE of every table gives each new files, some 0.4 s a
    test, where deleting the few rows a test left takes a tenth of that. The foreign keys are
    checked when the flush commits, with no row left."""

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return ["SET CONSTRAINTS ALL DEFERRED"] + [
            f"DELETE FROM {self.quote_name(table)}" for table in tables
        ]

    truncate = postgresql_operations.DatabaseOperations.sql_flush
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(postgresql_operations.DatabaseOperations, "sql_flush", sql_flush)
        yield


def _connect(name: str) -> None:
    """The default connection, closed, opens on database `name` next."""
    connection = connections[DEFAULT_DB_ALIAS]
    connection.close()
    connection.settings_dict["NAME"] = name


def _table_digests() -> dict[str, str]:
    """Each table's rows, as one digest of their text."""
    connection = connections[DEFAULT_DB_ALIAS]
    with connection.cursor() as cursor:
        digests = {}
        for table in connection.introspection.table_names(cursor):
            cursor.execute(
                "SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) "
                f"FROM {connection.ops.quote_name(table)} t"
            )
            digests[table] = cursor.fetchone()[0]
    return digests


def _process_caches_forgotten() -> None:
    """What a process keeps of versions by id, forgotten as a test on the seeded copy starts:
    the copy gives every such test the same ids, and a test may change a version's row behind
    the model layer. Elsewhere ids are new in each test, and the generation's values are kept
    by database name."""
    with selectors._frozen_versions_lock:
        selectors._frozen_versions.clear()
    capability._input_schema_hash.cache_clear()
    with generation._lock:
        generation._generation, generation._values = None, {}


def _on_demo_database(item) -> bool:
    """Whether `item` runs on the seeded copy (`demo_database`): a test of the running example
    whose transaction is rolled back, on the day the copy was seeded (the example's updates
    are dated by weekday of the current week). Every other test of it seeds the example."""
    copy = item.session.stash.get(DEMO_DATABASE, None)
    return (
        copy is not None
        and "demo" in item.fixturenames
        and _rolled_back(item)
        and copy.seeded_on == timezone.localdate()
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test on the seeded copy connects to it before any fixture opens its transaction."""
    if _on_demo_database(item):
        _connect(item.session.stash[DEMO_DATABASE].name)
        _process_caches_forgotten()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's fixtures are torn down, back to the test database."""
    try:
        return (yield)
    finally:
        copy = item.session.stash.get(DEMO_DATABASE, None)
        if copy is not None and connections[DEFAULT_DB_ALIAS].settings_dict["NAME"] == copy.name:
            _connect(copy.plain)


@pytest.fixture(autouse=True)
def _handler_threads_see_a_rolled_back_test(request, monkeypatch):
    """A Python tool handler runs on a handler thread with a database connection of its own,
    which does not see the rows of a test that is never committed. In such a test, the
    handler threads use the test's connection for their call, while the test waits; tests
    with `transaction=True` keep each thread's own connection, as in production."""
    if not _rolled_back(request.node):
        yield
        return
    test_connection = connections[DEFAULT_DB_ALIAS]
    call_within = threads.call_within

    def on_test_connection(function, *arguments):
        own = connections[DEFAULT_DB_ALIAS]
        connections[DEFAULT_DB_ALIAS] = test_connection
        try:
            return function(*arguments)
        finally:
            connections[DEFAULT_DB_ALIAS] = own

    def sharing(function, *arguments, seconds):
        test_connection.inc_thread_sharing()
        try:
            return call_within(on_test_connection, function, *arguments, seconds=seconds)
        finally:
            test_connection.dec_thread_sharing()

    monkeypatch.setattr(threads, "call_within", sharing)
    yield


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """The production hasher costs ~0.3 s per user; the tests do not measure it."""
    settings.PASSWORD_HASHERS = FAST_PASSWORD_HASHERS


# Modules of the tests' own tool handlers, installed for tools besides the example ones.
TEST_HANDLER_MODULES = [
    "tests.runs.test_loop",
    "tests.runs.test_handler_timeout",
    "tests.reliability.gated_tool",
]


@pytest.fixture(scope="session", autouse=True)
def _test_tool_handlers_installed():
    modules = [*settings.PYTHON_TOOL_HANDLER_MODULES, *TEST_HANDLER_MODULES]
    with override_settings(PYTHON_TOOL_HANDLER_MODULES=modules):
        yield


@pytest.fixture(scope="session", autouse=True)
def _own_cache_namespace():
    """Cache keys of this process's own, so two test sessions never share throttle state."""
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["KEY_PREFIX"] = f"test{os.getpid()}"
    with override_settings(CACHES=caches):
        yield


def _clear_own_cache() -> None:
    if not settings.REDIS_URL:
        cache.clear()
        return
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter(match=f"{settings.CACHES['default']['KEY_PREFIX']}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(autouse=True)
def _empty_cache():
    """Throttles and rate limits live in the cache (Redis under `make test`): start empty."""
    _clear_own_cache()
    yield
    _clear_own_cache()


@pytest.fixture
def requests_keep_connection(db):
    """Requests sent to the project's WSGI or ASGI application keep the test's database
    connection, as Django's test client does (the handlers would close it after each request,
    inside the test's transaction)."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def console() -> io.StringIO:
    """What the log's console handler writes during the test."""
    handler = next(
        handler
        for handler in logging.getLogger().handlers
        if type(handler) is logging.StreamHandler
    )
    written = io.StringIO()
    previous = handler.setStream(written)
    try:
        yield written
    finally:
        handler.setStream(previous)


@pytest.fixture
def acme(db):
    return TenantFactory(slug="acme", name="Acme")


@pytest.fixture
def globex(db):
    return TenantFactory(slug="globex", name="Globex")


@pytest.fixture
def platform_admin(db):
    return UserFactory(username="root", is_staff=True, is_superuser=True)


def _member(username: str, tenant, role: Role, **extra):
    user = UserFactory(username=username, **extra)
    membership_add(actor=None, user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def publisher(acme):
    return _member("dave", acme, Role.PUBLISHER, is_staff=True)


@pytest.fixture
def member(acme):
    return _member("alice", acme, Role.MEMBER)


@pytest.fixture
def auditor(acme):
    return _member("carol", acme, Role.AUDITOR)


@pytest.fixture
def globex_member(globex):
    return _member("erin", globex, Role.MEMBER)


@pytest.fixture
def globex_publisher(globex):
    return _member("gus", globex, Role.PUBLISHER, is_staff=True)


@pytest.fixture
def make_tool_version(publisher, acme):
    """A draft tool version of acme, created by the publisher."""

    def make(name: str = "project_search", version: str = "1.0.0", **overrides):
        return tools.tool_version_create(
            actor=overrides.pop("actor", publisher),
            tenant=overrides.pop("tenant", acme),
            name=name,
            version=version,
            **tool_content(**overrides),
        )

    return make


@pytest.fixture
def make_skill_version(publisher, acme):
    """A draft skill version of acme, created by the publisher."""

    def make(name: str = "weekly-summary", version: str = "1.0.0", tool_versions=(), **overrides):
        return skills.skill_version_create(
            actor=overrides.pop("actor", publisher),
            tenant=overrides.pop("tenant", acme),
            name=name,
            version=version,
            tool_versions=tool_versions,
            **skill_content(**overrides),
        )

    return make


@pytest.fixture
def api():
    """An API client; `api.as_user(user, tenant)` authenticates it with a fresh token."""

    client = APIClient()

    def as_user(user, tenant=None):
        _, key = api_token_issue(
            username=user.username, password=PASSWORD, tenant_slug=tenant.slug if tenant else None
        )
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        return client

    client.as_user = as_user
    return client


# Tests that start processes of their own (Celery workers, a browser, a web server, Django in
# a subprocess) run one after another on one xdist worker, never two at once on the machine's
# two cores; the other tests spread over both.
PROCESS_FIXTURES = frozenset({"start_worker", "live_server", "browser"})
PROCESS_MODULES = frozenset({"test_settings.py", "test_periodic_run.py"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if (
            PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
            or item.path.name in PROCESS_MODULES
            or item.path.parent.name == "reliability"
        ):
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_sessionfinish(session):
    """Under xdist, a worker hands its fault rows and fuzz counts to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fault_table"] = [
            {**vars(row), "statuses": dict(row.statuses)} for row in FAULT_TABLE
        ]
        output["fuzz_counts"] = dict(FUZZ_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    for row in output.get("fault_table", []):
        fault_report(FaultRow(**{**row, "statuses": Counter(row["statuses"])}))
    FUZZ_COUNTS.update(output.get("fuzz_counts", {}))


def pytest_terminal_summary(terminalreporter):
    """The fault-injection table (tests/faults.py) and the fuzzer's counts, when they ran."""
    if FAULT_TABLE:
        terminalreporter.section("fault injection")
        for line in fault_table_lines():
            terminalreporter.write_line(line)
    if FUZZ_COUNTS:
        terminalreporter.section("API fuzzing")
        for line in fuzz_count_lines():
            terminalreporter.write_line(line)
