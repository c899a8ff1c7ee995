"""The registry's generation: a committed write to a table a capability snapshot is resolved
from gives it a value never seen before; the writer's own transaction reads none; the row is
locked only while a writer commits (PostgreSQL triggers)."""

import importlib
import threading

import pytest
from django.apps import apps
from django.db import close_old_connections, connection, transaction

from registry.choices import Role
from registry.models import Tenant
from registry.selectors import user_roles_and_generation
from registry.services.tenancy import definition_grant

MIGRATION = importlib.import_module("registry.migrations.0010_registry_generation")
# What a snapshot is never resolved from, or is read on every request and kept under.
NOT_TRACKED = {"registry_apitoken", "registry_membership", "registry_registrygeneration"}


def _generation(member, acme) -> int | None:
    return user_roles_and_generation(user=member, tenant=acme)[1]


def test_every_table_a_snapshot_is_resolved_from_has_the_triggers(db):
    registry_tables = {
        model._meta.db_table
        for model in apps.get_app_config("registry").get_models(include_auto_created=True)
        if not model._meta.db_table.startswith("registry_historical")
    }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE tgname = ANY(%s)",
            [list(MIGRATION.TRIGGER_NAMES)],
        )
        triggered = {(name, table) for name, table in cursor.fetchall()}

    assert registry_tables - NOT_TRACKED == set(MIGRATION.TABLES) - {
        "guardian_groupobjectpermission"
    }
    assert triggered == {
        (name, table) for name in MIGRATION.TRIGGER_NAMES for table in MIGRATION.TABLES
    }


@pytest.mark.django_db(transaction=True)
def test_each_committed_write_gives_a_new_generation(member, acme, publish_tool, platform_admin):
    before = _generation(member, acme)
    Tenant.objects.filter(pk=acme.pk).update(name="Acme Corporation")
    updated = _generation(member, acme)
    web_fetch = publish_tool("web_fetch", actor=platform_admin, tenant=None)
    published = _generation(member, acme)
    definition_grant(actor=platform_admin, definition=web_fetch.tool, tenant=acme)
    granted = _generation(member, acme)

    assert None not in (before, updated, published, granted)
    assert len({before, updated, published, granted}) == 4


@pytest.mark.django_db(transaction=True)
def test_a_transaction_that_changes_the_registry_reads_none_and_a_rollback_moves_nothing(
    member, acme
):
    before = _generation(member, acme)
    with pytest.raises(RuntimeError), transaction.atomic():
        Tenant.objects.filter(pk=acme.pk).update(name="Acme (renamed)")
        assert user_roles_and_generation(user=member, tenant=acme) == ({"member"}, None)
        raise RuntimeError("rolled back")

    assert _generation(member, acme) == before
    Tenant.objects.filter(pk=acme.pk).update(name="Acme Corporation")
    assert _generation(member, acme) not in (before, None)


@pytest.mark.django_db(transaction=True)
def test_a_writer_holds_the_generation_only_while_it_commits(member, acme, globex):
    # given a transaction that changed the registry and is still at work
    working, done = threading.Event(), threading.Event()

    def slow_writer() -> None:
        try:
            with transaction.atomic():
                Tenant.objects.filter(pk=acme.pk).update(name="Acme (slow)")
                working.set()
                done.wait(timeout=30)
        finally:
            close_old_connections()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    assert working.wait(timeout=30)
    try:
        before = _generation(member, acme)

        # when another writer changes the registry and commits meanwhile
        with transaction.atomic():
            connection.cursor().execute("SET LOCAL lock_timeout = '5s'")
            Tenant.objects.filter(pk=globex.pk).update(name="Globex Corporation")
        concurrent = _generation(member, acme)
    finally:
        done.set()
        writer.join(timeout=30)

    # then it did not wait for the first, and each commit moved the generation
    assert concurrent not in (before, None)
    assert _generation(member, acme) not in (before, concurrent, None)


@pytest.mark.django_db(transaction=True)
def test_a_membership_is_not_a_registry_change(member, acme, add_member):
    before = _generation(member, acme)

    frank = add_member("frank", Role.MEMBER)

    assert before is not None
    assert user_roles_and_generation(user=frank, tenant=acme) == (frozenset({"member"}), before)
