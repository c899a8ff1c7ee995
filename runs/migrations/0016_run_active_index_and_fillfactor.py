"""The sweep's index holds the active runs and no longer their lease, and a run's heap pages
keep room (fillfactor 70, PostgreSQL): a step that changes no indexed column (a model or tool
turn: state, transcript, counters, lease) updates the row in place (a HOT update) instead of
adding an entry to each of the table's indexes."""

from django.conf import settings
from django.db import migrations, models


def _fillfactor(percent: int):
    def apply(apps, schema_editor) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE runs_run SET (fillfactor = {percent})")

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0009_tenant_sandbox_adversarial_planner"),
        ("runs", "0015_drop_indexes_covered_by_composites"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="run",
            name="runs_run_status_ab3a90_idx",
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("status__in", ["QUEUED", "RUNNING"])),
                fields=["status"],
                name="run_active",
            ),
        ),
        migrations.RunPython(_fillfactor(70), reverse_code=_fillfactor(100)),
    ]
