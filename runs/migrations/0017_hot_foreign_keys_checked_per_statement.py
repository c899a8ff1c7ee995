"""The foreign keys of the tables every step writes are checked when each statement ends
(DEFERRABLE INITIALLY IMMEDIATE, PostgreSQL) rather than all at commit: the same checks,
cheaper while the statement's state is at hand. A step writes a row together with the rows
it refers to, in one statement, so no write depends on waiting for commit; a transaction that
must can still `SET CONSTRAINTS ... DEFERRED`. Django creates foreign keys initially deferred:
a migration that recreates one of these puts it back, and a test says so."""

from django.db import migrations

TABLES = (
    "runs_session",
    "runs_run",
    "runs_ingressrecord",
    "runs_runevent",
    "runs_span",
    "runs_toolcall",
    "runs_source",
    "approvals_businessaction",
    "approvals_historicalbusinessaction",
)


def _initially(when: str):
    def apply(apps, schema_editor) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT conrelid::regclass::text, conname FROM pg_constraint "
                "WHERE contype = 'f' AND condeferrable AND conrelid::regclass::text = ANY(%s)",
                [list(TABLES)],
            )
            constraints = cursor.fetchall()
        for table, name in constraints:
            schema_editor.execute(
                f"ALTER TABLE {schema_editor.quote_name(table)} "
                f"ALTER CONSTRAINT {schema_editor.quote_name(name)} DEFERRABLE INITIALLY {when}"
            )

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0016_run_active_index_and_fillfactor"),
        ("approvals", "0002_handoffs"),
    ]

    operations = [
        migrations.RunPython(_initially("IMMEDIATE"), reverse_code=_initially("DEFERRED")),
    ]
