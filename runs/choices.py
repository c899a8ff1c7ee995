"""Run statuses, event types and channels of the data plane."""

from django.db import models


class RunStatus(models.TextChoices):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    WAITING_APPROVAL = "WAITING_APPROVAL"
    COMPLETED = "COMPLETED"
    NEEDS_CLARIFICATION = "NEEDS_CLARIFICATION"
    REFUSED = "REFUSED"
    PARTIAL = "PARTIAL"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_FINAL = "FAILED_FINAL"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    CANCELLED = "CANCELLED"


ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_APPROVAL})
TERMINAL_STATUSES = frozenset(set(RunStatus) - ACTIVE_STATUSES)

RUN_TRANSITIONS: dict[str, frozenset[str]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.REFUSED, RunStatus.CANCELLED}),
    RunStatus.RUNNING: frozenset({RunStatus.WAITING_APPROVAL, *TERMINAL_STATUSES}),
    RunStatus.WAITING_APPROVAL: frozenset(
        {RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.REFUSED, RunStatus.FAILED_FINAL}
    ),
    **{status: frozenset() for status in TERMINAL_STATUSES},
}


class EventType(models.TextChoices):
    MESSAGE_RECEIVED = "message.received"
    MESSAGE_NORMALIZED = "message.normalized"
    SESSION_LOADED = "session.loaded"
    ROUTE_SELECTED = "route.selected"
    CAPABILITY_RESOLVED = "capability.resolved"
    SKILL_ACTIVATED = "skill.activated"
    TOOLS_ASSEMBLED = "tools.assembled"
    CONTEXT_BUILT = "context.built"
    MODEL_REQUESTED = "model.requested"
    MODEL_RESPONDED = "model.responded"
    TOOL_REQUESTED = "tool.requested"
    TOOL_REJECTED = "tool.rejected"
    TOOL_COMPLETED = "tool.completed"
    TOOL_FAILED = "tool.failed"
    DRAFT_CREATED = "draft.created"
    APPROVAL_REQUIRED = "approval.required"
    APPROVAL_GRANTED = "approval.granted"
    APPROVAL_REJECTED = "approval.rejected"
    APPROVAL_INVALIDATED = "approval.invalidated"
    RUN_RESUMED = "run.resumed"
    ACTION_EXECUTING = "action.executing"
    ACTION_SUCCEEDED = "action.succeeded"
    ACTION_FAILED = "action.failed"
    ACTION_UNKNOWN = "action.unknown"
    ACTION_RECONCILED = "action.reconciled"
    HANDOFF_REQUESTED = "handoff.requested"
    HANDOFF_RESOLVED = "handoff.resolved"
    RUN_FINISHED = "run.finished"


class Channel(models.TextChoices):
    API = "api", "API"
    CHAT = "chat", "Chat"
    WEB = "web", "Web"
    IM = "im", "Enterprise IM"
    TASK = "task", "Scheduled task"
