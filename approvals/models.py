import uuid
from typing import Any

from django.conf import settings
from django.db import models

from approvals.choices import ActionStatus, Decision, HandoffStatus
from approvals.errors import ActionFrozen
from config.history import history_records

# What the freeze fixed: never written again after the action is created.
FROZEN_FIELDS = frozenset({"payload", "payload_hash", "idempotency_key", "run", "kind"})


class BusinessAction(models.Model):
    """A side effect of a run, frozen as RFC 8785 canonical JSON with its sha256, waiting for a
    human, then executed once under `idempotency_key` (`run_id:kind:payload_hash`)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="business_actions"
    )
    run = models.OneToOneField("runs.Run", on_delete=models.PROTECT, related_name="action")
    requester = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="requested_actions"
    )
    kind = models.CharField(max_length=64, help_text="The tool that performs it, e.g. mail_send.")
    risk = models.CharField(max_length=32)
    status = models.CharField(
        max_length=24, choices=ActionStatus.choices, default=ActionStatus.PROPOSED
    )
    status_reason = models.CharField(max_length=64, blank=True)
    payload = models.JSONField(help_text="The frozen payload: exactly what will be done.")
    payload_hash = models.CharField(max_length=64)
    idempotency_key = models.CharField(max_length=200, unique=True)
    tool_version = models.ForeignKey(
        "registry.ToolVersion", on_delete=models.PROTECT, related_name="actions"
    )
    skill_version = models.ForeignKey(
        "registry.SkillVersion",
        on_delete=models.PROTECT,
        related_name="actions",
        null=True,
        blank=True,
    )
    policy = models.JSONField(help_text="The approval policy of the run's snapshot.")
    expires_at = models.DateTimeField()
    external_id = models.CharField(max_length=255, blank=True, help_text="E.g. the message id.")
    outcome = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    executed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    reconciled_at = models.DateTimeField(null=True, blank=True)
    reconcile_attempts = models.PositiveSmallIntegerField(
        default=0, help_text="The reconciliations of its outcome made so far."
    )
    reconcile_due_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the next reconciliation of an unknown outcome is due; empty when none "
        "is (settled, or no attempts left: it is left to a person).",
    )

    history = history_records()

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["tenant", "status", "-created_at"]),
            models.Index(
                fields=["reconcile_due_at"],
                condition=models.Q(status=ActionStatus.UNKNOWN),
                name="action_reconcile_due",
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(payload_hash__regex=r"^[0-9a-f]{64}$"),
                name="action_payload_hash_sha256",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} for run {self.run_id} ({self.status})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            update_fields = kwargs.get("update_fields")
            if update_fields is None or FROZEN_FIELDS & set(update_fields):
                raise ActionFrozen("A business action's frozen payload is never changed.")
        super().save(*args, **kwargs)


class ApprovalDecision(models.Model):
    """The one decision on an action: who decided, what, and on which payload hash."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    action = models.OneToOneField(BusinessAction, on_delete=models.PROTECT, related_name="decision")
    approver = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="approval_decisions"
    )
    decision = models.CharField(max_length=8, choices=Decision.choices)
    payload_hash = models.CharField(max_length=64)
    comment = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.decision} by {self.approver} on {self.action_id}"


class Handoff(models.Model):
    """A request the route sends to people instead of the agent (execution mode
    `human_queue`): the run waits until someone with an approver role of the tenant handles
    or declines it, and ends with what they wrote. A run that ends otherwise withdraws it,
    with the run's reason code."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("registry.Tenant", on_delete=models.PROTECT, related_name="handoffs")
    run = models.OneToOneField("runs.Run", on_delete=models.PROTECT, related_name="handoff")
    requester = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="requested_handoffs"
    )
    skill = models.CharField(max_length=200, help_text="The skill the route chose, name@version.")
    risks = models.JSONField(help_text="The tool risks the policy leaves to people.")
    request = models.TextField(help_text="What the requester asked, as they wrote it.")
    status = models.CharField(
        max_length=16, choices=HandoffStatus.choices, default=HandoffStatus.OPEN
    )
    status_reason = models.CharField(
        max_length=64, blank=True, help_text="Why it was withdrawn: the reason its run ended."
    )
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        related_name="resolved_handoffs",
        null=True,
        blank=True,
    )
    note = models.TextField(blank=True, help_text="What was done, or why not.")
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)

    history = history_records()

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["tenant", "status", "created_at"])]

    def __str__(self) -> str:
        return f"{self.skill} for {self.requester_id} ({self.status})"
