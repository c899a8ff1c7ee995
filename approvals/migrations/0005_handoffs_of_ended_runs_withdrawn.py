"""Requests left to people whose run ended before a run's end withdrew them (approvals 0004)
are withdrawn now, with the reason their run ended and when: they no longer wait in the
human queue, where handling one was refused already. Their change history gets no record
(a data migration writes none), and their runs' logs no event."""

from django.db import migrations
from django.db.models import OuterRef, Subquery

# What runs 0023 knows as a run that has not ended (runs.choices.ACTIVE_STATUSES).
ACTIVE_STATUSES = ("QUEUED", "RUNNING", "WAITING_APPROVAL")


def withdraw(apps, schema_editor) -> None:
    Handoff = apps.get_model("approvals", "Handoff")
    Run = apps.get_model("runs", "Run")
    ended = Run.objects.filter(pk=OuterRef("run_id"))
    Handoff.objects.filter(status="open").exclude(run__status__in=ACTIVE_STATUSES).update(
        status="withdrawn",
        status_reason=Subquery(ended.values("reason_code")[:1]),
        resolved_at=Subquery(ended.values("finished_at")[:1]),
    )


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0004_handoff_withdrawn"),
        ("runs", "0023_row_ids_time_ordered"),
    ]

    operations = [migrations.RunPython(withdraw, reverse_code=migrations.RunPython.noop)]
