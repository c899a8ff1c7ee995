from django.db import models

from config.ids import time_ordered_id


class Span(models.Model):
    """One timed stage of a run (ingress, routing, a model turn, a tool call, the approval
    wait, an action), in the run's trace. The root span (`run`) is written when the run ends;
    the others name it, or another span, as parent. Attributes are redacted before they are
    stored (runs.redaction)."""

    class Status(models.TextChoices):
        OK = "ok", "OK"
        ERROR = "error", "Error"

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    # Indexed by (run, started_at), which leads with it.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, related_name="spans", db_index=False
    )
    session_id = models.UUIDField()
    trace_id = models.CharField(max_length=32)
    span_id = models.CharField(max_length=16)
    parent_span_id = models.CharField(max_length=16, blank=True)
    name = models.CharField(max_length=64)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField()
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.OK)
    attributes = models.JSONField(default=dict)

    class Meta:
        ordering = ["run_id", "started_at"]
        indexes = [models.Index(fields=["run", "started_at"])]
        constraints = [
            models.UniqueConstraint(fields=["trace_id", "span_id"], name="span_unique_id")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.duration_ms} ms)"
