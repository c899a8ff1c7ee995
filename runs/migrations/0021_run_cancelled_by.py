"""A run records who cancelled it, and a cancel request kept beside a run who asked for it.
The run's new foreign key is checked as each statement ends, as its others are (runs 0017):
Django creates it initially deferred."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def _initially(when: str):
    def apply(apps, schema_editor) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT conname FROM pg_constraint WHERE contype = 'f' AND condeferrable "
                "AND conrelid = 'runs_run'::regclass AND conkey = ARRAY["
                "(SELECT attnum FROM pg_attribute WHERE attrelid = 'runs_run'::regclass "
                "AND attname = 'cancelled_by_id')]"
            )
            constraints = [name for (name,) in cursor.fetchall()]
        for name in constraints:
            schema_editor.execute(
                f"ALTER TABLE runs_run ALTER CONSTRAINT {schema_editor.quote_name(name)} "
                f"DEFERRABLE INITIALLY {when}"
            )

    return apply


class Migration(migrations.Migration):

    dependencies = [
        ('registry', '0011_history_change_reason_text'),
        ('runs', '0020_run_data_compressed_with_lz4'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='cancelrequest',
            name='requested_by',
            field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='run',
            name='cancelled_by',
            field=models.ForeignKey(blank=True, db_index=False, help_text="Who asked first for the run to be cancelled; empty when the platform stopped it (a scheduled task's deadline, an approval that expired or was rejected).", null=True, on_delete=django.db.models.deletion.PROTECT, related_name='cancelled_runs', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('cancelled_by__isnull', False)), fields=['cancelled_by'], name='run_cancelled_by'),
        ),
        migrations.RunPython(_initially("IMMEDIATE"), reverse_code=_initially("DEFERRED")),
    ]
