"""Enums of the control plane and their groupings."""

from django.db import models


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    PUBLISHER = "publisher", "Publisher"
    APPROVER = "approver", "Approver"
    AUDITOR = "auditor", "Auditor"
    MEMBER = "member", "Member"
    SERVICE = "service", "Service account"


class Action(models.TextChoices):
    """What a role may do inside its tenant; checked by `registry.selectors.user_can`."""

    REGISTRY_VIEW = "registry.view", "View published tools and skills"
    REGISTRY_VIEW_UNPUBLISHED = "registry.view_unpublished", "View drafts and revoked versions"
    REGISTRY_PUBLISH = "registry.publish", "Create, publish, deprecate, revoke, roll back"
    RUN_CREATE = "run.create", "Start runs"
    RUN_VIEW_ALL = "run.view_all", "View every run of the tenant"
    RUN_VIEW_SENSITIVE = "run.view_sensitive", "See emails and sensitive fields in runs unmasked"
    APPROVAL_DECIDE = "approval.decide", "Decide approvals"
    TENANT_ADMIN = "tenant.admin", "Administer the tenant"


ROLE_ACTIONS: dict[str, frozenset[str]] = {
    Role.ADMIN: frozenset(Action.values),
    Role.PUBLISHER: frozenset(
        {Action.REGISTRY_VIEW, Action.REGISTRY_VIEW_UNPUBLISHED, Action.REGISTRY_PUBLISH}
    ),
    Role.APPROVER: frozenset({Action.REGISTRY_VIEW, Action.APPROVAL_DECIDE}),
    Role.AUDITOR: frozenset(
        {Action.REGISTRY_VIEW, Action.REGISTRY_VIEW_UNPUBLISHED, Action.RUN_VIEW_ALL}
    ),
    Role.MEMBER: frozenset({Action.REGISTRY_VIEW, Action.RUN_CREATE}),
    Role.SERVICE: frozenset({Action.REGISTRY_VIEW, Action.RUN_CREATE}),
}


class VersionStatus(models.TextChoices):
    DRAFT = "draft", "Draft"
    PUBLISHED = "published", "Published"
    DEPRECATED = "deprecated", "Deprecated"
    REVOKED = "revoked", "Revoked"


VERSION_TRANSITIONS: dict[str, frozenset[str]] = {
    VersionStatus.DRAFT: frozenset({VersionStatus.PUBLISHED}),
    VersionStatus.PUBLISHED: frozenset({VersionStatus.DEPRECATED, VersionStatus.REVOKED}),
    VersionStatus.DEPRECATED: frozenset({VersionStatus.REVOKED}),
    VersionStatus.REVOKED: frozenset(),
}

# Versions whose content is frozen: they were published once.
FROZEN_STATUSES = frozenset(
    {VersionStatus.PUBLISHED, VersionStatus.DEPRECATED, VersionStatus.REVOKED}
)
# Versions a run may call: a deprecated one still serves the skills that pin it.
CALLABLE_STATUSES = frozenset({VersionStatus.PUBLISHED, VersionStatus.DEPRECATED})
# Versions a client may see without the right to view unpublished work.
LISTED_STATUSES = frozenset({VersionStatus.PUBLISHED, VersionStatus.DEPRECATED})


class Risk(models.TextChoices):
    READ = "read", "Read"
    READ_SENSITIVE = "read_sensitive", "Read sensitive data"
    INTERNAL_WRITE = "internal_write", "Internal write"
    EXTERNAL_SIDE_EFFECT = "external_side_effect", "External side effect"
    DESTRUCTIVE = "destructive", "Destructive"
    FINANCIAL = "financial", "Financial"


READ_RISKS = frozenset({Risk.READ, Risk.READ_SENSITIVE})


class ApprovalRule(models.TextChoices):
    NONE = "none", "No approval"
    REQUIRED = "required", "Human approval of the call"
    WORKFLOW_SNAPSHOT_REQUIRED = (
        "workflow_snapshot_required",
        "Approval of a frozen workflow snapshot",
    )


class DataClassification(models.TextChoices):
    """Ordered from least to most sensitive; `LEVELS` gives the order."""

    PUBLIC = "public", "Public"
    INTERNAL = "internal", "Internal"
    CONFIDENTIAL = "confidential", "Confidential"
    RESTRICTED = "restricted", "Restricted"


DATA_CLASSIFICATION_LEVELS: tuple[str, ...] = tuple(DataClassification.values)
# Data more sensitive than internal: a memory item is kept so only with its user's consent,
# and a viewer of a run without clearance does not see it (`runs.selectors.memory_hidden`).
ABOVE_INTERNAL = frozenset(
    DATA_CLASSIFICATION_LEVELS[DATA_CLASSIFICATION_LEVELS.index(DataClassification.INTERNAL) + 1 :]
)


class AdapterKind(models.TextChoices):
    PYTHON = "python", "Python handler"
    HTTP = "http", "HTTP service"
    MCP = "mcp", "MCP server tool"


class ModelProvider(models.TextChoices):
    OPENAI_COMPATIBLE = "openai_compatible", "OpenAI-compatible Chat Completions"
    ANTHROPIC = "anthropic", "Anthropic Messages"
    OFFLINE = "offline", "Offline deterministic planner"
    ADVERSARIAL = "adversarial", "Adversarial planner (obeys instructions found in data)"


class SkillAssembly(models.TextChoices):
    """How a run's skill is chosen (seed 000, stage 6)."""

    STATIC = "static", "Static: the agent's bound skills"
    RETRIEVAL = "retrieval", "Retrieval: recalled from the registry by the request"


class NoSkillMatched(models.TextChoices):
    """What a retrieval agent does when no skill scores above its threshold."""

    ANSWER = "answer", "Answer directly, without tools"
    CLARIFY = "clarify", "Ask the user what they need"
