from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from config.credentials import credential_refusal, url_secret_refusal
from registry.choices import AdapterKind
from registry.errors import ToolDefinitionChanged, ValidationFailed
from registry.models import McpServer, Tenant, Tool, ToolVersion
from registry.schemas import raise_if_errors, tool_version_errors
from registry.selectors import mcp_drift, mcp_server_of
from registry.services import lifecycle
from registry.services.common import audited_save, audited_unique_save, full_clean_or_raise

TOOL_CONTENT_FIELDS = (
    "description",
    "when_not_to_use",
    "returns",
    "input_schema",
    "result_contract",
    "risk",
    "timeout_s",
    "retry_policy",
    "rate_limit",
    "concurrency_cap",
    "circuit_breaker",
    "is_idempotent",
    "supports_dry_run",
    "approval_rule",
    "data_classification",
    "adapter_kind",
    "adapter_config",
)


def tool_version_create(
    *,
    actor: AbstractBaseUser,
    tenant: Tenant | None,
    name: str,
    version: str,
    namespace: str = "core",
    **content: Any,
) -> ToolVersion:
    """A new draft version of a tool (the tool itself is created on first use of its name).

    Drafts are held to the same content contract as published versions, so a bad input
    schema is refused when it is written, not when someone tries to publish it."""
    with transaction.atomic():
        tool = lifecycle.definition_get_or_create(
            Tool, actor=actor, tenant=tenant, name=name, namespace=namespace
        )
        lifecycle.require_publisher(actor=actor, definition=tool)
        tool_version = ToolVersion(tool=tool, version=version, created_by=actor, **content)
        tool_version_check(tool_version)
        audited_unique_save(tool_version, actor=actor, reason="draft created")
    return tool_version


def tool_version_update(
    *, tool_version: ToolVersion, actor: AbstractBaseUser, **content: Any
) -> ToolVersion:
    """Edit a draft. Published versions are frozen: a change is a new version."""
    lifecycle.require_publisher(actor=actor, definition=tool_version.tool)
    with transaction.atomic():
        lifecycle.draft_locked(tool_version)
        for field, value in content.items():
            setattr(tool_version, field, value)
        tool_version_check(tool_version)
        audited_save(tool_version, actor=actor, reason="draft edited")
    return tool_version


def tool_version_check(tool_version: ToolVersion) -> None:
    """The model's checks, then the tool contract's. The contract alone judges the input
    schema: the model called an empty one (`[]`, `""`, `{}`) blank, where the contract says
    what a schema must be."""
    full_clean_or_raise(tool_version, exclude=["input_schema"])
    tool_version_validate(tool_version)


def tool_version_validate(tool_version: ToolVersion) -> None:
    values = {field: getattr(tool_version, field) for field in TOOL_CONTENT_FIELDS}
    values["version"] = tool_version.version
    errors = tool_version_errors(values)
    config = tool_version.adapter_config
    if isinstance(config, dict) and "adapter_config" not in errors:
        reference = config.get("credential_ref")
        refusal = (
            isinstance(reference, str)
            and credential_refusal(reference, owner=tool_version.tool.tenant)
        ) or (isinstance(config.get("url"), str) and url_secret_refusal(config["url"]))
        if refusal:
            errors["adapter_config"] = [refusal]
    raise_if_errors(errors, f"{tool_version.qualified_name} breaks the tool contract: see details.")


def mcp_version_publish_check(tool_version: ToolVersion) -> None:
    """A version is published only against the definition its server serves now."""
    config = tool_version.adapter_config
    server = mcp_server_of(tool_version)
    if server is not None:
        # Locked until the version is published: a change of its endpoint, or its deletion,
        # waits, and then sees the version that calls it.
        server = McpServer.objects.select_for_update().filter(pk=server.pk).first()
    if server is None:
        raise ValidationFailed(
            f"No MCP server named {config.get('server')} belongs to the tool's owner."
        )
    reason = mcp_drift([tool_version]).get(str(tool_version.pk))
    if reason:
        raise ToolDefinitionChanged(
            f"{server} no longer serves the definition this draft was made from "
            f"({reason.lower().replace('_', ' ')}); discover again and review the new draft.",
            details={"reason": reason},
        )


def _publish_validate(tool_version: ToolVersion) -> None:
    tool_version_validate(tool_version)
    if tool_version.adapter_kind == AdapterKind.MCP:
        mcp_version_publish_check(tool_version)


def tool_version_publish(*, tool_version: ToolVersion, actor: AbstractBaseUser) -> ToolVersion:
    """Publishing an MCP tool also needs its server to serve the reviewed definition now."""
    return lifecycle.version_publish(version=tool_version, actor=actor, validate=_publish_validate)


def tool_version_deprecate(
    *, tool_version: ToolVersion, actor: AbstractBaseUser, reason: str = ""
) -> ToolVersion:
    return lifecycle.version_deprecate(version=tool_version, actor=actor, reason=reason)


def tool_version_revoke(
    *, tool_version: ToolVersion, actor: AbstractBaseUser, reason: str = ""
) -> ToolVersion:
    return lifecycle.version_revoke(version=tool_version, actor=actor, reason=reason)


def tool_rollback(*, tool_version: ToolVersion, actor: AbstractBaseUser) -> ToolVersion:
    return lifecycle.version_rollback(version=tool_version, actor=actor)
