import hashlib

from django.db import models
from django.utils import timezone

from config.ids import time_ordered_id
from runs.tools.envelope import ErrorCategory


class ToolCall(models.Model):
    """One tool call of a run: requested by the model (or the workflow), checked by the eight
    gates, and either rejected, completed or failed. `call_id` pairs it with the model's
    request in the transcript."""

    class Status(models.TextChoices):
        REQUESTED = "requested"
        REJECTED = "rejected"
        COMPLETED = "completed"
        FAILED = "failed"

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    # Indexed by (run, call_id), which leads with it.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, related_name="tool_calls", db_index=False
    )
    call_id = models.CharField(max_length=128)
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=128)
    tool_version = models.ForeignKey(
        "registry.ToolVersion",
        on_delete=models.PROTECT,
        related_name="calls",
        null=True,
        blank=True,
    )
    arguments = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.REQUESTED)
    error_category = models.CharField(max_length=24, choices=ErrorCategory.choices, blank=True)
    envelope = models.JSONField(default=dict)
    attempts = models.PositiveSmallIntegerField(default=0)
    started_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "step", "started_at"]
        constraints = [
            models.UniqueConstraint(fields=["run", "call_id"], name="toolcall_unique_call_id"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.call_id}) {self.status}"


# What evidence a draft may cite is marked with this use.
EVIDENCE_USE = "summarize"
# The longest reference a Source keeps, and how a longer one is kept distinct from others
# that start the same: its start, then a digest of the whole.
REFERENCE_MAX_CHARS = 300
REFERENCE_DIGEST_CHARS = 12


def source_reference(reference: str) -> str:
    """How a Source, and everything that names it, refers to `reference`: as it is, or, when
    it is longer than REFERENCE_MAX_CHARS, its start followed by "…#" and the first hex digits
    of its sha256, so that two long references that start alike stay two."""
    if len(reference) <= REFERENCE_MAX_CHARS:
        return reference
    digest = hashlib.sha256(reference.encode()).hexdigest()[:REFERENCE_DIGEST_CHARS]
    return f"{reference[: REFERENCE_MAX_CHARS - REFERENCE_DIGEST_CHARS - 2]}…#{digest}"


class Source(models.Model):
    """Evidence a tool returned, or what was read of an MCP resource or an attachment of the
    message: where it came from, when, its content hash and what it may be used for. The model
    cites it by `reference`; the content never enters a context whole."""

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    # Indexed by (run, reference), which leads with it.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, related_name="sources", db_index=False
    )
    tool_call = models.ForeignKey(
        ToolCall,
        on_delete=models.PROTECT,
        related_name="sources",
        null=True,
        blank=True,
        help_text="Empty for an MCP resource or an attachment of the message.",
    )
    origin = models.CharField(
        max_length=200,
        help_text='The tool version or MCP server that returned it, or "attachment".',
    )
    reference = models.CharField(max_length=REFERENCE_MAX_CHARS)
    fetched_at = models.DateTimeField(auto_now_add=True)
    content_hash = models.CharField(max_length=64)
    allowed_use = models.CharField(max_length=64, default=EVIDENCE_USE)
    content = models.TextField(blank=True)

    class Meta:
        ordering = ["run_id", "fetched_at"]
        indexes = [models.Index(fields=["run", "reference"])]

    def __str__(self) -> str:
        return self.reference
