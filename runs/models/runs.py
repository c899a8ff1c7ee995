from django.conf import settings
from django.db import models
from django.utils import timezone

from config.ids import time_ordered_id
from runs.choices import Channel, RunStatus


class Run(models.Model):
    """One governed execution of a message, bound to an immutable capability snapshot.

    `message` is the normalised internal event; `capability` and `capability_hash` never change
    after creation; `status` moves only through `runs.services.runs.run_transition`. The users
    it names (its actor, who cancelled it) are protected, as an approval's approver is: an
    account that acted in a run cannot be deleted (deactivate it), so its audit trail keeps
    naming it.
    """

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    # Indexed by the history indexes below, which lead with it.
    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="runs", db_index=False
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="runs"
    )
    session = models.ForeignKey("runs.Session", on_delete=models.PROTECT, related_name="runs")
    agent_config = models.ForeignKey(
        "registry.AgentConfig",
        on_delete=models.PROTECT,
        related_name="runs",
        null=True,
        blank=True,
    )
    channel = models.CharField(max_length=16, choices=Channel.choices)
    skill = models.CharField(
        max_length=140, blank=True, help_text="name@version of the skill the run activates."
    )
    status = models.CharField(max_length=24, choices=RunStatus.choices, default=RunStatus.QUEUED)
    reason_code = models.CharField(max_length=64, blank=True)
    message = models.JSONField(help_text="The normalised internal message event.")
    capability = models.JSONField(default=dict)
    capability_hash = models.CharField(max_length=64, blank=True)
    result = models.JSONField(default=dict, blank=True)
    trace_id = models.CharField(max_length=32)
    last_event_seq = models.PositiveIntegerField(default=0)
    state = models.JSONField(
        default=dict, blank=True, help_text="Checkpoint: workflow node, inputs, draft."
    )
    transcript = models.JSONField(
        default=list, blank=True, help_text="Model turns with their call ids, then results."
    )
    steps = models.PositiveIntegerField(default=0)
    tool_call_count = models.PositiveIntegerField(default=0)
    tokens_used = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Steps that failed (raised) in a row since the last one that saved (`runs.tasks`).
    attempts = models.PositiveIntegerField(default=0)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.CharField(
        max_length=64,
        blank=True,
        help_text="The reason code a run whose cancellation was requested ends with.",
    )
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        related_name="cancelled_runs",
        null=True,
        blank=True,
        db_index=False,
        help_text="Who asked first for the run to be cancelled; empty when the platform "
        "stopped it (a scheduled task's deadline, an approval that expired or was rejected).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["tenant", "-created_at", "-id"], name="run_tenant_history"),
            models.Index(fields=["tenant", "status", "-created_at"]),
            models.Index(fields=["tenant", "actor", "-created_at"]),
            # The sweep's index: the active runs, whatever their lease (it changes every
            # step, and a step that changes no indexed column updates the row in place), and
            # those waiting for people, whose requester's standing it checks.
            models.Index(
                fields=["status"],
                condition=models.Q(
                    status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_APPROVAL]
                ),
                name="run_active",
            ),
            models.Index(fields=["tenant", "skill", "-created_at"]),
            # Only the runs a user cancelled: deleting a user looks theirs up (PROTECT), and
            # no other run adds an entry.
            models.Index(
                fields=["cancelled_by"],
                condition=models.Q(cancelled_by__isnull=False),
                name="run_cancelled_by",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.id} ({self.status})"


class IngressRecord(models.Model):
    """One accepted message per (tenant, actor, Idempotency-Key): a retried request finds the
    run its first attempt created; the same key with another body is refused."""

    tenant = models.ForeignKey("registry.Tenant", on_delete=models.CASCADE, related_name="+")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    idempotency_key = models.CharField(max_length=200)
    request_hash = models.CharField(max_length=64)
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="ingress")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "actor", "idempotency_key"], name="ingress_unique_key"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.idempotency_key} → {self.run_id}"


class CancelRequest(models.Model):
    """A cancel asked for while a step held the run's row: a step keeps it locked until it
    commits, which may be a long model call, so the request waits here, beside the run, and
    the request returns after a short wait (RUN_CANCEL_LOCK_WAIT_MS, PostgreSQL). The next
    step boundary, or the sweep for a run that paused, takes it in
    (`runs.services.runs.cancel_requests_take_in`)."""

    run = models.OneToOneField(
        Run, on_delete=models.CASCADE, primary_key=True, related_name="cancel_request"
    )
    reason = models.CharField(max_length=64)
    requested_at = models.DateTimeField(default=timezone.now)
    # Null only for a request kept before requesters were recorded.
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )

    def __str__(self) -> str:
        return f"cancel {self.run_id} ({self.reason})"
