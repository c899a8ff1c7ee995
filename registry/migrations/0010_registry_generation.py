"""The registry's generation (PostgreSQL): a transaction that writes a table a capability
snapshot is resolved from sets `registry_registrygeneration.value` to a new number from a
sequence when it commits (a deferred constraint trigger, run once per transaction), so the
row is locked only while its writer commits, never while it works. Until then the writer's
own transaction is marked (`registry.changed`, a transaction-local setting) and reads no
generation: what it sees is not the committed registry. A TRUNCATE moves it at once. A value
is never seen twice, and a rolled-back change moves nothing.

Left out: the history tables, API tokens and memberships (a run's roles are read on every
request and are part of what a cached snapshot is kept under). A test says which registry
tables have the triggers, so a new one is not forgotten."""

from django.db import migrations, models

TABLES = (
    "registry_agentconfig",
    "registry_agentconfig_skills",
    "registry_mcpprompt",
    "registry_mcpremotetool",
    "registry_mcpresource",
    "registry_mcpserver",
    "registry_mcpserver_granted_tenants",
    "registry_mcptooldefinition",
    "registry_modelconfig",
    "registry_policy",
    "registry_rolloutflag",
    "registry_rolloutflag_tenants",
    "registry_skill",
    "registry_skilltooldependency",
    "registry_skillversion",
    "registry_tenant",
    "registry_tool",
    "registry_toolversion",
    "guardian_groupobjectpermission",
)

FUNCTIONS = """
CREATE SEQUENCE registry_generation_seq;
CREATE FUNCTION registry_generation_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('registry.changed', 'on', true);
    RETURN NULL;
END
$$;
CREATE FUNCTION registry_generation_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'TRUNCATE' AND current_setting('registry.bumped', true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('registry.bumped', 'on', true);
    INSERT INTO registry_registrygeneration (id, value)
    VALUES (1, nextval('registry_generation_seq'))
    ON CONFLICT (id) DO UPDATE SET value = EXCLUDED.value;
    RETURN NULL;
END
$$;
"""
TRIGGERS = (
    "CREATE TRIGGER registry_generation_mark AFTER INSERT OR UPDATE OR DELETE ON {table} "
    "FOR EACH STATEMENT EXECUTE FUNCTION registry_generation_mark()",
    "CREATE CONSTRAINT TRIGGER registry_generation_bump AFTER INSERT OR UPDATE OR DELETE "
    "ON {table} DEFERRABLE INITIALLY DEFERRED "
    "FOR EACH ROW EXECUTE FUNCTION registry_generation_bump()",
    "CREATE TRIGGER registry_generation_truncate AFTER TRUNCATE ON {table} "
    "FOR EACH STATEMENT EXECUTE FUNCTION registry_generation_bump()",
)
TRIGGER_NAMES = (
    "registry_generation_mark",
    "registry_generation_bump",
    "registry_generation_truncate",
)


def _install(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTIONS)
    for table in TABLES:
        for trigger in TRIGGERS:
            schema_editor.execute(trigger.format(table=schema_editor.quote_name(table)))


def _remove(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in TABLES:
        for name in TRIGGER_NAMES:
            schema_editor.execute(f"DROP TRIGGER {name} ON {schema_editor.quote_name(table)}")
    schema_editor.execute("DROP FUNCTION registry_generation_bump()")
    schema_editor.execute("DROP FUNCTION registry_generation_mark()")
    schema_editor.execute("DROP SEQUENCE registry_generation_seq")


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0009_tenant_sandbox_adversarial_planner"),
        ("guardian", "0003_remove_groupobjectpermission_guardian_gr_content_ae6aec_idx_and_more"),
    ]

    operations = [
        migrations.CreateModel(
            name="RegistryGeneration",
            fields=[
                (
                    "id",
                    models.PositiveSmallIntegerField(
                        default=1, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("value", models.BigIntegerField()),
            ],
        ),
        migrations.RunPython(_install, reverse_code=_remove),
    ]
