"""The schedule of an unknown action's reconciliation, kept on the action: the attempts made
and when the next is due. Actions already unknown had theirs only in the broker, where it may
have been lost: each is due now, so the actions sweep sends its reconciliation (an action
settled meanwhile is not asked again; one still unknown after the attempts is left to a
person, as before)."""

from django.db import migrations, models
from django.utils import timezone


def schedule_unknown(apps, schema_editor) -> None:
    BusinessAction = apps.get_model("approvals", "BusinessAction")
    BusinessAction.objects.filter(status="unknown").update(reconcile_due_at=timezone.now())


class Migration(migrations.Migration):

    dependencies = [
        ('approvals', '0005_handoffs_of_ended_runs_withdrawn'),
    ]

    operations = [
        migrations.AddField(
            model_name='businessaction',
            name='reconcile_attempts',
            field=models.PositiveSmallIntegerField(default=0, help_text='The reconciliations of its outcome made so far.'),
        ),
        migrations.AddField(
            model_name='businessaction',
            name='reconcile_due_at',
            field=models.DateTimeField(blank=True, help_text='When the next reconciliation of an unknown outcome is due; empty when none is (settled, or no attempts left: it is left to a person).', null=True),
        ),
        migrations.AddField(
            model_name='historicalbusinessaction',
            name='reconcile_attempts',
            field=models.PositiveSmallIntegerField(default=0, help_text='The reconciliations of its outcome made so far.'),
        ),
        migrations.AddField(
            model_name='historicalbusinessaction',
            name='reconcile_due_at',
            field=models.DateTimeField(blank=True, help_text='When the next reconciliation of an unknown outcome is due; empty when none is (settled, or no attempts left: it is left to a person).', null=True),
        ),
        migrations.AddIndex(
            model_name='businessaction',
            index=models.Index(condition=models.Q(('status', 'unknown')), fields=['reconcile_due_at'], name='action_reconcile_due'),
        ),
        migrations.RunPython(schedule_unknown, reverse_code=migrations.RunPython.noop),
    ]
