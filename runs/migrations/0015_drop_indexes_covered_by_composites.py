"""The run foreign keys of the log tables (and the tenant of a run) lose their own index: a
composite index leading with the same column serves every lookup by it, and each index is one
more write per row. Only the indexes are dropped; the foreign-key constraints stay as they
are (altering the fields on the database would drop and revalidate them)."""

import django.db.models.deletion
from django.db import migrations, models

INDEXES = [
    ("runs_run", "runs_run_tenant_id_45914888", "tenant_id"),
    ("runs_runevent", "runs_runevent_run_id_8bd13aa7", "run_id"),
    ("runs_source", "runs_source_run_id_fded3538", "run_id"),
    ("runs_span", "runs_span_run_id_d74572e2", "run_id"),
    ("runs_toolcall", "runs_toolcall_run_id_d2fbb3a3", "run_id"),
]


def _run_fk(related_name):
    return models.ForeignKey(
        db_index=False,
        on_delete=django.db.models.deletion.PROTECT,
        related_name=related_name,
        to="runs.run",
    )


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0009_tenant_sandbox_adversarial_planner"),
        ("runs", "0014_scheduled_tasks"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{name}"',
                    reverse_sql=f'CREATE INDEX "{name}" ON "{table}" ("{column}")',
                )
                for table, name, column in INDEXES
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="run",
                    name="tenant",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="runs",
                        to="registry.tenant",
                    ),
                ),
                migrations.AlterField(
                    model_name="runevent", name="run", field=_run_fk("events")
                ),
                migrations.AlterField(
                    model_name="source", name="run", field=_run_fk("sources")
                ),
                migrations.AlterField(model_name="span", name="run", field=_run_fk("spans")),
                migrations.AlterField(
                    model_name="toolcall", name="run", field=_run_fk("tool_calls")
                ),
            ],
        )
    ]
