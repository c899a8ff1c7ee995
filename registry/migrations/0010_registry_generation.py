"""The registry's generation (PostgreSQL): every statement that writes a table a capability
snapshot is resolved from sets `registry_registrygeneration.value` to a new number from a
sequence, in the writer's transaction. A reader that sees a value sees the registry as it
was when that value was set (or later); a rolled-back change's value is never seen again.

Left out: the history tables, API tokens and memberships (a run's roles are read on every
request and are part of what a cached snapshot is kept under). A test says which registry
tables have the trigger, so a new one is not forgotten."""

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

BUMP = """
CREATE SEQUENCE registry_generation_seq;
CREATE FUNCTION registry_generation_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO registry_registrygeneration (id, value)
    VALUES (1, nextval('registry_generation_seq'))
    ON CONFLICT (id) DO UPDATE SET value = EXCLUDED.value;
    RETURN NULL;
END
$$;
"""
TRIGGER = (
    "CREATE TRIGGER registry_generation_bump "
    "AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table} "
    "FOR EACH STATEMENT EXECUTE FUNCTION registry_generation_bump()"
)


def _install(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(BUMP)
    for table in TABLES:
        schema_editor.execute(TRIGGER.format(table=schema_editor.quote_name(table)))


def _remove(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in TABLES:
        schema_editor.execute(
            f"DROP TRIGGER registry_generation_bump ON {schema_editor.quote_name(table)}"
        )
    schema_editor.execute("DROP FUNCTION registry_generation_bump()")
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
