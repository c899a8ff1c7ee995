"""The registry's generation: every write to a table a capability snapshot is resolved from
gives it a value never seen before, in the writer's transaction (PostgreSQL triggers)."""

import importlib

import pytest
from django.apps import apps
from django.db import connection, transaction

from registry.models import RegistryGeneration, Tenant
from registry.selectors import user_roles_and_generation
from registry.services.tenancy import definition_grant

MIGRATION = importlib.import_module("registry.migrations.0010_registry_generation")
# What a snapshot is never resolved from, or is read on every request and kept under.
NOT_TRACKED = {"registry_apitoken", "registry_membership", "registry_registrygeneration"}


def _generation() -> int | None:
    return RegistryGeneration.objects.values_list("value", flat=True).first()


def test_every_table_a_snapshot_is_resolved_from_moves_the_generation(db):
    registry_tables = {
        model._meta.db_table
        for model in apps.get_app_config("registry").get_models(include_auto_created=True)
        if not model._meta.db_table.startswith("registry_historical")
    }
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname = %s",
            ["registry_generation_bump"],
        )
        triggered = {table for (table,) in cursor.fetchall()}

    assert registry_tables - NOT_TRACKED == set(MIGRATION.TABLES) - {
        "guardian_groupobjectpermission"
    }
    assert triggered == set(MIGRATION.TABLES)


def test_each_write_gives_a_new_generation_read_with_the_roles(
    member, acme, publish_tool, platform_admin
):
    roles, before = user_roles_and_generation(user=member, tenant=acme)
    Tenant.objects.filter(pk=acme.pk).update(name="Acme Corporation")
    _, updated = user_roles_and_generation(user=member, tenant=acme)
    web_fetch = publish_tool("web_fetch", actor=platform_admin, tenant=None)
    _, published = user_roles_and_generation(user=member, tenant=acme)
    definition_grant(actor=platform_admin, definition=web_fetch.tool, tenant=acme)
    _, granted = user_roles_and_generation(user=member, tenant=acme)

    assert roles == {"member"}
    assert None not in (before, updated, published, granted)
    assert len({before, updated, published, granted}) == 4


def test_a_rolled_back_generation_is_never_seen_again(acme):
    before = _generation()
    with pytest.raises(RuntimeError), transaction.atomic():
        Tenant.objects.filter(pk=acme.pk).update(name="Acme (renamed)")
        rolled_back = _generation()
        raise RuntimeError("rolled back")

    assert _generation() == before
    Tenant.objects.filter(pk=acme.pk).update(name="Acme Corporation")
    assert _generation() not in (before, rolled_back)


def test_a_membership_is_not_a_registry_change(member, acme, add_member):
    _, before = user_roles_and_generation(user=member, tenant=acme)

    frank = add_member("frank", "member")

    assert user_roles_and_generation(user=frank, tenant=acme) == (frozenset({"member"}), before)
