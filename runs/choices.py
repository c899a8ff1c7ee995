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
    # FAILED_FINAL: a run whose first step keeps failing (runs.tasks.STEP_FAILURES_MAX).
    RunStatus.QUEUED: frozenset(
        {RunStatus.RUNNING, RunStatus.REFUSED, RunStatus.CANCELLED, RunStatus.FAILED_FINAL}
    ),
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


# Channels a client may post a message on. Scheduled tasks start their runs on the server,
# with a goal, project and recipient the client cannot supply.
CLIENT_CHANNELS = [(value, label) for value, label in Channel.choices if value != Channel.TASK]


class OccurrenceStatus(models.TextChoices):
    """Where one firing of a scheduled task stands: `pending` until its run exists, then
    following that run (`runs.services.occurrences.OCCURRENCE_STATUS_OF_RUN`)."""

    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    WAITING_APPROVAL = "waiting_approval", "Waiting for approval"
    COMPLETED = "completed", "Completed"
    NEEDS_OWNER = "needs_owner", "Needs its owner"
    REFUSED = "refused", "Refused"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    DEADLINE_PASSED = "deadline_passed", "Deadline passed"


OCCURRENCE_ACTIVE = frozenset(
    {OccurrenceStatus.PENDING, OccurrenceStatus.RUNNING, OccurrenceStatus.WAITING_APPROVAL}
)
OCCURRENCE_TERMINAL = frozenset(set(OccurrenceStatus) - OCCURRENCE_ACTIVE)

OCCURRENCE_TRANSITIONS: dict[str, frozenset[str]] = {
    OccurrenceStatus.PENDING: frozenset({OccurrenceStatus.RUNNING, *OCCURRENCE_TERMINAL}),
    OccurrenceStatus.RUNNING: frozenset({OccurrenceStatus.WAITING_APPROVAL, *OCCURRENCE_TERMINAL}),
    OccurrenceStatus.WAITING_APPROVAL: frozenset({OccurrenceStatus.RUNNING, *OCCURRENCE_TERMINAL}),
    **{status: frozenset() for status in OCCURRENCE_TERMINAL},
}
