from django.db import migrations, models

from registry.canonical import canonical_hash

HELP = (
    "sha256 of the suite's cases when the run started: a suite whose cases changed since is "
    "not what this run measured."
)
CASE_FIELDS = (
    "key",
    "messages",
    "metadata",
    "session_state",
    "fixture",
    "expected",
    "vector",
    "payload",
    "forbidden",
)


def hash_suites_as_they_are(apps, schema_editor):
    """Runs made before the hash was kept measured their suite as it is now, as far as
    anything can tell: they keep counting for the gate until the suite changes."""
    EvalRun = apps.get_model("evaluations", "EvalRun")
    EvalSuite = apps.get_model("evaluations", "EvalSuite")
    for suite in EvalSuite.objects.filter(runs__isnull=False).distinct():
        content = canonical_hash(
            {
                "kind": suite.kind,
                "cases": [
                    {field: getattr(case, field) for field in CASE_FIELDS}
                    for case in suite.cases.order_by("key")
                ],
            }
        )
        EvalRun.objects.filter(suite=suite).update(suite_content_hash=content)


class Migration(migrations.Migration):
    dependencies = [("evaluations", "0002_history_change_reason_text")]

    operations = [
        migrations.AddField(
            model_name="evalrun",
            name="suite_content_hash",
            field=models.CharField(default="", editable=False, help_text=HELP, max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="historicalevalrun",
            name="suite_content_hash",
            field=models.CharField(default="", editable=False, help_text=HELP, max_length=64),
            preserve_default=False,
        ),
        migrations.RunPython(hash_suites_as_they_are, migrations.RunPython.noop),
    ]
