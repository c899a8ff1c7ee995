"""A run's large values (transcript, capability, state, result, message; the envelopes of its
tool calls, the payloads of its events, the content of its sources, the attributes of its
spans) are compressed with lz4 where PostgreSQL keeps them out of line, instead of pglz: a
step rewrites its run's transcript, and lz4 compresses it several times faster (a tenth of
a millisecond less per step for a transcript of four tool results). Values written before
keep their compression until they are written again. A server built without lz4 keeps pglz."""

from django.db import migrations

COLUMNS = {
    "runs_run": ("message", "capability", "result", "state", "transcript"),
    "runs_toolcall": ("arguments", "envelope"),
    "runs_runevent": ("payload",),
    "runs_source": ("content",),
    "runs_span": ("attributes",),
}


def _compression(method: str):
    def apply(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        statements = " ".join(
            f"ALTER TABLE {table} "
            + ", ".join(f"ALTER COLUMN {column} SET COMPRESSION {method}" for column in columns)
            + ";"
            for table, columns in COLUMNS.items()
        )
        schema_editor.execute(
            f"DO $$ BEGIN {statements} EXCEPTION WHEN feature_not_supported THEN NULL; END $$"
        )

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0019_history_change_reason_text"),
    ]

    operations = [
        migrations.RunPython(_compression("lz4"), reverse_code=_compression("pglz")),
    ]
