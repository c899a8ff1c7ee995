"""Prepared queries give what their queryset gives, compiled once, with each call's values."""

import uuid
from datetime import date
from unittest import mock

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.db.models.functions import Length
from django.db.models.sql.compiler import SQLCompiler
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

from config.queries import PreparedQuery
from examples.models import Project, ProjectUpdate
from registry.choices import Role
from registry.models import Membership
from runs.models import Session
from tests.registry.factories import MembershipFactory, TenantFactory, UserFactory

MEMBERS = PreparedQuery(
    lambda tenant_id: (
        Membership.objects.filter(tenant_id=tenant_id)
        .select_related("tenant", "user")
        .order_by("user__username")
    ),
    tenant_id=int,
)


@pytest.fixture
def memberships(acme, globex):
    return [
        MembershipFactory(tenant=acme, user=UserFactory(username="zoe"), role=Role.AUDITOR),
        MembershipFactory(tenant=acme, user=UserFactory(username="adam"), role=Role.MEMBER),
        MembershipFactory(tenant=globex, user=UserFactory(username="gus"), role=Role.MEMBER),
    ]


def _described(members: list[Membership]) -> list[tuple]:
    return [(m.pk, m.user.username, m.tenant.slug, m.role) for m in members]


def test_instances_and_their_related_rows_come_back_as_the_queryset_gives_them(
    acme, memberships, django_assert_num_queries
):
    with django_assert_num_queries(1):
        prepared = _described(MEMBERS(tenant_id=acme.pk))
    expected = _described(
        Membership.objects.filter(tenant=acme)
        .select_related("tenant", "user")
        .order_by("user__username")
    )
    assert prepared == expected
    assert [username for _, username, _, _ in prepared] == ["adam", "zoe"]


def test_instances_carry_their_annotations(acme, memberships):
    def build(tenant_id):
        return (
            Membership.objects.filter(tenant_id=tenant_id)
            .annotate(name_length=Length("user__username"))
            .order_by("user__username")
        )

    prepared = PreparedQuery(build, tenant_id=int)(tenant_id=acme.pk)

    assert [(m.user_id, m.name_length) for m in prepared] == [
        (m.user_id, m.name_length) for m in build(acme.pk)
    ]
    assert [m.name_length for m in prepared] == [4, 3]


def test_a_second_call_sends_the_compiled_sql_with_its_own_values(acme, globex, memberships):
    empty = TenantFactory()
    assert [m.user.username for m in MEMBERS(tenant_id=acme.pk)] == ["adam", "zoe"]
    with mock.patch.object(SQLCompiler, "as_sql", side_effect=AssertionError("compiled again")):
        assert [m.user.username for m in MEMBERS(tenant_id=globex.pk)] == ["gus"]
        assert MEMBERS(tenant_id=empty.pk) == []


def test_values_tuples_and_flat_values_keep_the_querysets_shape(acme, memberships):
    queryset = Membership.objects.filter(tenant_id=acme.pk).order_by("user__username")
    shapes = {
        "values": lambda tenant_id: queryset.filter(tenant_id=tenant_id).values(
            "role", "tenant__slug"
        ),
        "tuples": lambda tenant_id: queryset.filter(tenant_id=tenant_id).values_list(
            "user__username", "role"
        ),
        "flat": lambda tenant_id: queryset.filter(tenant_id=tenant_id).values_list(
            "user__username", flat=True
        ),
    }
    for build in shapes.values():
        assert PreparedQuery(build, tenant_id=int)(tenant_id=acme.pk) == list(build(acme.pk))
    assert PreparedQuery(shapes["values"], tenant_id=int)(tenant_id=acme.pk) == [
        {"role": Role.MEMBER, "tenant__slug": "acme"},
        {"role": Role.AUDITOR, "tenant__slug": "acme"},
    ]


def test_a_json_key_and_a_uuid_given_as_text_reach_the_sql(acme, member):
    session = Session.objects.create(
        tenant=acme, actor=member, channel="api", state={"project": {"id": "apollo"}}
    )
    project = PreparedQuery(
        lambda session_id: Session.objects.filter(pk=session_id).values_list(
            "state__project__id", flat=True
        ),
        session_id=uuid.UUID,
    )
    assert project(session_id=str(session.pk)) == ["apollo"]
    assert project(session_id=uuid.uuid4()) == []


@pytest.mark.django_db(transaction=True)
def test_a_locking_query_outside_a_transaction_is_refused(acme):
    locked = PreparedQuery(
        lambda tenant_id: Membership.objects.select_for_update().filter(tenant_id=tenant_id),
        tenant_id=int,
    )
    with transaction.atomic():
        assert locked(tenant_id=acme.pk) == []
    with pytest.raises(TransactionManagementError):
        locked(tenant_id=acme.pk)


def test_a_parameter_that_does_not_reach_the_sql_unchanged_is_refused(db):
    contains = PreparedQuery(
        lambda name: Membership.objects.filter(user__username__contains=name), name=str
    )
    with pytest.raises(ImproperlyConfigured, match=r"\['name'\]"):
        contains(name="ad")


def test_postgresql_prepares_a_prepared_query_once_it_has_run_a_few_times(
    acme, memberships, settings
):
    threshold = settings.DATABASES["default"]["OPTIONS"]["prepare_threshold"]
    assert threshold == 5

    def prepared_on_the_server() -> list[str]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT statement FROM pg_prepared_statements WHERE statement LIKE %s",
                ['%"registry_membership"%'],
            )
            return [row[0] for row in cursor.fetchall()]

    for _ in range(threshold):
        assert [m.user.username for m in MEMBERS(tenant_id=acme.pk)] == ["adam", "zoe"]
    assert prepared_on_the_server() == []

    assert [m.user.username for m in MEMBERS(tenant_id=acme.pk)] == ["adam", "zoe"]

    [statement] = prepared_on_the_server()
    assert "$1" in statement  # bound by the server: the same statement for every tenant
    assert MEMBERS(tenant_id=acme.pk + 10_000) == []
    assert len(prepared_on_the_server()) == 1


def test_a_kept_cursor_logs_its_queries_only_while_query_logging_is_on(
    acme, memberships, django_assert_num_queries
):
    with django_assert_num_queries(1):
        MEMBERS(tenant_id=acme.pk)
    logged = len(connection.queries_log)

    MEMBERS(tenant_id=acme.pk)
    assert len(connection.queries_log) == logged

    with django_assert_num_queries(1):
        assert [m.user.username for m in MEMBERS(tenant_id=acme.pk)] == ["adam", "zoe"]


def test_a_prepared_query_logs_its_sql_every_time_while_query_logging_is_on(acme, memberships):
    """Before, a statement the server had prepared was logged without its SQL (None) from its
    sixth run on a connection, so a test reading the logged SQL missed it, or failed on it,
    depending on what ran before it on the connection."""
    threshold = connection.settings_dict["OPTIONS"]["prepare_threshold"]

    with CaptureQueriesContext(connection) as queries:
        for _ in range(threshold + 2):
            MEMBERS(tenant_id=acme.pk)

    logged = [query["sql"] for query in queries.captured_queries]
    assert len(logged) == threshold + 2
    assert all('FROM "registry_membership"' in sql for sql in logged)


@pytest.mark.django_db(transaction=True)
def test_a_prepared_query_after_a_reconnect_runs_on_the_new_connection(acme, memberships):
    MEMBERS(tenant_id=acme.pk)
    connection.close()

    assert [m.user.username for m in MEMBERS(tenant_id=acme.pk)] == ["adam", "zoe"]


def test_dates_reach_the_sql_as_a_range(acme):
    project = Project.objects.create(tenant=acme, key="apollo", name="Apollo")
    for day in (1, 3, 5):
        ProjectUpdate.objects.create(
            project=project,
            kind=ProjectUpdate.Kind.TASK,
            title=f"day {day}",
            status="done",
            occurred_on=date(2026, 11, day),
        )
    between = PreparedQuery(
        lambda start, end: ProjectUpdate.objects.filter(occurred_on__range=(start, end)),
        start=date,
        end=date,
    )

    assert [u.title for u in between(start=date(2026, 11, 2), end=date(2026, 11, 5))] == [
        "day 3",
        "day 5",
    ]
    assert between(start=date(2026, 11, 6), end=date(2026, 11, 30)) == []
