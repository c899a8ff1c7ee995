from django.db import migrations, models

HELP = (
    "The suite's cases when the run started, the ones its content hash was taken of: those it "
    "runs, a case added since being left to the next run."
)


def cases_of_runs_under_way(apps, schema_editor):
    """A queued or running eval run made before its cases were kept goes on with the cases
    its suite has now, as it did; a finished one runs none again."""
    EvalRun = apps.get_model("evaluations", "EvalRun")
    for eval_run in EvalRun.objects.filter(status__in=["queued", "running"]).select_related(
        "suite"
    ):
        eval_run.cases.set(eval_run.suite.cases.all())


class Migration(migrations.Migration):
    dependencies = [("evaluations", "0006_eval_run_skill_version_changed")]

    operations = [
        migrations.AddField(
            model_name="evalrun",
            name="cases",
            field=models.ManyToManyField(
                blank=True,
                editable=False,
                help_text=HELP,
                related_name="+",
                to="evaluations.evalcase",
            ),
        ),
        migrations.RunPython(cases_of_runs_under_way, migrations.RunPython.noop),
    ]
