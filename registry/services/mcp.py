"""MCP servers: registration, discovery into reviewable drafts, and drift bookkeeping.

Discovery never makes anything callable: each remote tool becomes (or refreshes) a *draft*
ToolVersion in the server's namespace, with the remote definition's hash pinned in its adapter
config and the risk the annotations propose as the floor a publisher may only raise. A
published version keeps serving only while the server serves exactly the definition it was
reviewed against.
"""

import functools
import json
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from config import jsontext
from config.errors import error_text
from registry.choices import READ_RISKS, AdapterKind, ApprovalRule, VersionStatus
from registry.errors import (
    McpServerUnavailable,
    NotFound,
    PermissionDenied,
    ValidationFailed,
)
from registry.mcp.connections import (
    McpRemoteError,
    McpTimeout,
    McpUnavailable,
    ToolListing,
    connections,
    endpoint_for,
)
from registry.mcp.review import (
    ambiguity,
    listed_ambiguously,
    local_tool_name,
    nested_too_deep,
    poisoning_flags,
    proposed_risk,
    served_hash,
)
from registry.models import (
    McpPrompt,
    McpRemoteTool,
    McpResource,
    McpServer,
    McpToolDefinition,
    Tool,
    ToolVersion,
)
from registry.selectors import mcp_drift, mcp_server_callers
from registry.services.common import (
    audited_delete,
    audited_save,
    full_clean_or_raise,
    registry_object_save,
)
from registry.services.tools import tool_version_check
from runs.redaction import known_secrets_replaced, secrets_removed

logger = logging.getLogger(__name__)

UNREACHABLE = (McpUnavailable, McpTimeout, McpRemoteError)


def mcp_server_save(
    *, server: McpServer, actor: AbstractBaseUser, reason: str = "saved"
) -> McpServer:
    """A stdio server runs its command on every worker: only platform admins register one."""
    if server.transport == McpServer.Transport.STDIO and not actor.is_superuser:
        raise PermissionDenied(
            "Only platform admins may register stdio servers; they run a command on the host."
        )
    if server._state.adding and server.created_by_id is None:
        server.created_by = actor
    with transaction.atomic():
        # Checked with the server locked: a tool version published meanwhile (it locks its
        # server, `mcp_version_publish_check`) is seen, and waits for this save.
        if not server._state.adding:
            list(McpServer.objects.select_for_update().filter(pk=server.pk).values_list("pk"))
        return registry_object_save(instance=server, actor=actor, reason=reason)


def mcp_server_delete(
    *, server: McpServer, actor: AbstractBaseUser, reason: str = "deleted"
) -> None:
    """Delete a server with what discovery recorded on it (its remote tool definitions, prompts
    and resources); its history keeps who deleted it. Refused while published or deprecated
    tool versions call it: they would call nothing, or whatever server took its name next.
    The drafts made from it stay, unpublishable until a server of its name serves them."""
    with transaction.atomic():
        locked = McpServer.objects.select_for_update().filter(pk=server.pk).first()
        if locked is None:
            raise NotFound("No such MCP server.")
        callers = [str(version) for version in mcp_server_callers(locked)]
        if callers:
            raise ValidationFailed(
                f"Published tool versions call {locked}: revoke them (deprecated ones too) "
                "before deleting the server.",
                details={"tool_versions": callers},
            )
        audited_delete(locked, actor=actor, reason=reason)


@dataclass
class DiscoveryReport:
    server: str
    drafted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    prompts: int = 0
    resources: int = 0

    def summary(self) -> str:
        parts = [
            f"{len(self.drafted)} drafted",
            f"{len(self.unchanged)} unchanged",
            f"{len(self.drifted)} changed since publish",
            f"{len(self.removed)} removed",
            f"{len(self.flagged)} flagged for review",
            f"{self.prompts} prompts",
            f"{self.resources} resources",
        ]
        if self.skipped:
            parts.append(f"skipped: {', '.join(f'{k} ({v})' for k, v in self.skipped.items())}")
        return f"{self.server}: " + ", ".join(parts) + "."


def _health(server: McpServer, health: str, detail: str = "", **extra: Any) -> None:
    """Health is observed state, not configuration: updated without a history row."""
    McpServer.objects.filter(pk=server.pk).update(
        health=health, health_detail=detail[:300], health_checked_at=timezone.now(), **extra
    )


# The remote tools a server still lists: served, or listed ambiguously (seen when, or after,
# it stopped serving one definition: `McpRemoteTool.is_listed_ambiguously`).
STILL_LISTED = Q(removed_at__isnull=True) | Q(removed_at__lte=F("last_seen_at"))
REMOTE_NAME_MAX = McpRemoteTool._meta.get_field("remote_name").max_length
ECHOED_CREDENTIAL_FLAG = {
    "code": "ECHOES_CREDENTIAL",
    "field": "definition",
    "excerpt": "The server's listing quoted a credential it was given; it is kept redacted.",
}


def _without_secrets(value: Any, secrets: tuple[str, ...]) -> Any:
    """What a server lists, as kept and shown: its own credentials, should it quote them,
    replaced, and any other its text holds (`secrets_removed`: a key, a bearer token, a
    password), and text PostgreSQL stores (no NUL) at a depth a run keeps."""

    def text(found: str) -> str:
        return jsontext.storable_text(secrets_removed(known_secrets_replaced(found, secrets)))

    return jsontext.storable(value, text=text)


def mcp_definitions_sync(
    *,
    server: McpServer,
    listing: ToolListing,
    skipped: dict[str, str] | None = None,
    secrets: tuple[str, ...] = (),
) -> dict[str, McpToolDefinition]:
    """Record what the server serves now (each new definition kept by its hash, with its
    proposed risk and review flags) and mark the tools it stopped serving as removed, and
    those it lists more than once with different definitions: which of them it runs is not
    known, so none is reviewed, and a version published of the name is no longer served. A
    definition nesting deeper than the registry keeps is recorded cut, and not reviewed.
    Safe to run concurrently: rows are created under savepoints."""
    now = timezone.now()
    skipped = {} if skipped is None else skipped
    ambiguous = []
    for remote_name in listing.ambiguous:
        shown = _without_secrets(remote_name, secrets)[:REMOTE_NAME_MAX]
        problem = _name_problem(McpRemoteTool, "remote_name", remote_name, secrets)
        skipped[shown] = problem or ambiguity(listing.ambiguous, remote_name)
        if problem is None:
            ambiguous.append(remote_name)
    current: dict[str, McpToolDefinition] = {}
    listed = []
    for remote_name, definition in listing.definitions.items():
        if (
            problem := _name_problem(McpRemoteTool, "remote_name", remote_name, secrets)
        ) is not None:
            skipped[_without_secrets(remote_name, secrets)[:REMOTE_NAME_MAX]] = problem
            continue
        listed.append(remote_name)
        # Hashed as served, so that drift shows and a call compares the same hash (a
        # definition served again is the same row); kept and shown without the credentials
        # the server echoes, nor any other its text or schemas hold (a default, an example,
        # an enum entry), and in text PostgreSQL stores.
        hashed, canonical = served_hash(definition)
        shown = _without_secrets(definition, secrets)
        flags = poisoning_flags(shown)
        served_text = json.dumps(definition, ensure_ascii=False, default=str)
        if known_secrets_replaced(served_text, secrets) != served_text:
            flags.append(ECHOED_CREDENTIAL_FLAG)
        row, _ = McpToolDefinition.objects.get_or_create(
            server=server,
            definition_hash=hashed,
            defaults={
                "remote_name": remote_name,
                "definition": shown,
                "proposed_risk": proposed_risk(definition.get("annotations") or {}),
                "review_flags": flags,
            },
        )
        McpRemoteTool.objects.update_or_create(
            server=server,
            remote_name=remote_name,
            defaults={"current": row, "last_seen_at": now, "removed_at": None},
        )
        if not canonical:
            skipped[remote_name] = "holds numbers that cannot be hashed canonically"
            continue
        if jsontext.deeper_than(definition):
            # Kept cut (a published version of the name shows the change), never drafted.
            skipped[remote_name] = nested_too_deep([remote_name])
            continue
        current[remote_name] = row
    # A name skipped above is no stored tool's (nor a query's parameter PostgreSQL takes).
    # One listed ambiguously is seen, not served: it keeps when it stopped being served.
    McpRemoteTool.objects.filter(server=server, remote_name__in=ambiguous).update(
        last_seen_at=now, removed_at=Coalesce("removed_at", now)
    )
    McpRemoteTool.objects.filter(STILL_LISTED, server=server).exclude(
        remote_name__in=[*listed, *ambiguous]
    ).update(removed_at=now)
    return current


def _next_version(versions: list[ToolVersion]) -> str:
    latest = max((version.semver for version in versions), default=None)
    return "1.0.0" if latest is None else str(latest.bump_minor())


def _text_without_credentials(text: str) -> str:
    return jsontext.storable_text(secrets_removed(text))


def _draft_content(server: McpServer, row: McpToolDefinition) -> dict[str, Any]:
    """The draft of a listed definition. Its description and input schema are what every
    model call is shown: they lose the credentials a server put in them (a version holding
    one is refused, and the server's text is not the publisher's to edit)."""
    definition = row.definition
    schema = dict(definition.get("inputSchema") or {})
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    schema["additionalProperties"] = False
    output_schema = definition.get("outputSchema")
    return {
        "description": secrets_removed(
            definition.get("description")
            or f"{row.remote_name} on the MCP server {server.name} (no description given)."
        ),
        "returns": "Structured content as the output schema says." if output_schema else "",
        "input_schema": jsontext.storable(schema, text=_text_without_credentials),
        "result_contract": {"output_schema": output_schema} if output_schema else {},
        "risk": row.proposed_risk,
        "approval_rule": ApprovalRule.NONE
        if row.proposed_risk in READ_RISKS
        else ApprovalRule.REQUIRED,
        "adapter_kind": AdapterKind.MCP,
        "adapter_config": {
            "server": server.name,
            "remote_name": row.remote_name,
            "definition_hash": row.definition_hash,
            "proposed_risk": row.proposed_risk,
        },
    }


def _draft(*, server: McpServer, row: McpToolDefinition, actor: AbstractBaseUser | None) -> str:
    """Make sure a version of this definition exists for review. Returns what happened:
    'unchanged', 'drafted' or 'skipped: …'. A draft of an older definition is rewritten
    (its review starts over). Periodic discovery (no actor) creates drafts in the name of
    whoever registered the server; their history shows no user."""
    creator = actor or server.created_by
    name = local_tool_name(row.remote_name)
    tool = Tool.objects.filter(tenant=server.tenant, namespace=server.name, name=name).first()
    versions = [] if tool is None else list(tool.versions.all())
    if any(v.adapter_config.get("remote_name") != row.remote_name for v in versions):
        return f"skipped: {name} already names another tool"
    if any(v.adapter_config.get("definition_hash") == row.definition_hash for v in versions):
        return "unchanged"
    content = _draft_content(server, row)
    draft = next((v for v in versions if v.status == VersionStatus.DRAFT), None)
    try:
        # A tool is made with its first draft or not at all: a skipped draft leaves no
        # tool without versions in the registry.
        with transaction.atomic():
            if tool is None:
                tool = Tool(
                    tenant=server.tenant, namespace=server.name, name=name, created_by=creator
                )
                full_clean_or_raise(tool, exclude=["current_version"])
                audited_save(tool, actor=actor, reason=f"discovered on MCP server {server}")
            if draft is None:
                draft = ToolVersion(tool=tool, version=_next_version(versions), created_by=creator)
                reason = f"discovered on MCP server {server}"
            else:
                reason = f"definition changed on MCP server {server}"
            for field_name, value in content.items():
                setattr(draft, field_name, value)
            tool_version_check(draft)
            audited_save(draft, actor=actor, reason=reason)
    except ValidationFailed as error:
        return f"skipped: {error_text(error)}"
    return "drafted"


def mcp_server_discover(*, server: McpServer, actor: AbstractBaseUser | None) -> DiscoveryReport:
    """List the server's tools (every page), prompts and resources and record them."""
    report = DiscoveryReport(server=str(server))
    secrets: tuple[str, ...] = ()
    try:
        endpoint = endpoint_for(server)
        secrets = endpoint.secrets
        listing = connections.tools(endpoint)
        prompts = connections.prompts(endpoint)
        resources = connections.resources(endpoint)
    except UNREACHABLE as error:
        # The server's own error message may quote the credential it was sent.
        detail = _without_secrets(str(error), secrets)
        _health(server, McpServer.Health.UNHEALTHY, detail)
        raise McpServerUnavailable(detail) from error
    now = timezone.now()
    with transaction.atomic():
        server = McpServer.objects.select_for_update().get(pk=server.pk)
        previous = set(
            McpRemoteTool.objects.filter(STILL_LISTED, server=server).values_list(
                "remote_name", flat=True
            )
        )
        current = mcp_definitions_sync(
            server=server, listing=listing, skipped=report.skipped, secrets=endpoint.secrets
        )
        report.removed = sorted(previous - set(listing.definitions) - set(listing.ambiguous))
        # A remote name that is already a local name keeps it: drafted before the names
        # that normalise to it.
        for remote_name, row in sorted(
            current.items(), key=lambda item: (local_tool_name(item[0]) != item[0], item[0])
        ):
            outcome = _draft(server=server, row=row, actor=actor)
            if outcome == "drafted":
                report.drafted.append(remote_name)
            elif outcome == "unchanged":
                report.unchanged.append(remote_name)
            else:
                report.skipped[remote_name] = outcome.removeprefix("skipped: ")
            if row.review_flags:
                report.flagged.append(remote_name)
        report.drifted = sorted(mcp_drift_of_server(server))
        report.prompts = _prompts_record(server, prompts, now, endpoint.secrets, report.skipped)
        report.resources = _resources_record(
            server, resources, now, endpoint.secrets, report.skipped
        )
        _health(server, McpServer.Health.HEALTHY, report.summary(), last_discovered_at=now)
    return report


def _fits(model: type, fields: dict[str, str]) -> str | None:
    """Why these values do not fit the model's columns, if they do not."""
    for name, value in fields.items():
        if jsontext.storable_text(value) != value:
            return f"its {name} holds a NUL or half a surrogate pair, which cannot be stored"
        longest = model._meta.get_field(name).max_length
        if longest is not None and len(value) > longest:
            return f"its {name} is longer than {longest} characters"
    return None


def _name_problem(model: type, field_name: str, value: str, secrets: tuple[str, ...]) -> str | None:
    """Why a name the server is sent back exactly as it listed it (a tool's remote name, a
    prompt's name, a resource's URI or name) is not kept: it is kept and shown as served, or
    not at all, for altered (a credential replaced, a NUL made U+FFFD) it names nothing, or
    something else."""
    if known_secrets_replaced(value, secrets) != value:
        return f"its {field_name} quotes a credential it was given"
    if secrets_removed(value) != value:
        return f"its {field_name} holds a credential"
    return _fits(model, {field_name: value})


def _prompts_record(
    server: McpServer, prompts: list[Any], now: Any, secrets: tuple[str, ...], skipped: dict
) -> int:
    ambiguous = listed_ambiguously(
        (prompt.name, prompt.model_dump(mode="json")) for prompt in prompts
    )
    kept: set[str] = set()
    for prompt in prompts:
        shown = _without_secrets(
            {
                "name": prompt.name,
                "title": prompt.title or "",
                "description": prompt.description or "",
                "arguments": [a.model_dump(exclude_none=True) for a in prompt.arguments or []],
            },
            secrets,
        )
        problem = (
            _name_problem(McpPrompt, "name", prompt.name, secrets)
            or _fits(McpPrompt, {"title": shown["title"]})
            or ambiguity(ambiguous, prompt.name)
        )
        if problem is not None:
            skipped[f"prompt {shown['name'][:REMOTE_NAME_MAX]}"] = problem
            continue
        McpPrompt.objects.update_or_create(
            server=server,
            name=shown["name"],
            defaults={
                "title": shown["title"],
                "description": shown["description"],
                "arguments": shown["arguments"],
                "review_flags": poisoning_flags(
                    {"name": shown["name"], "description": shown["description"]}
                ),
                "last_seen_at": now,
            },
        )
        kept.add(shown["name"])
    McpPrompt.objects.filter(server=server).exclude(name__in=kept).delete()
    return len(kept)


def _resources_record(
    server: McpServer, resources: list[Any], now: Any, secrets: tuple[str, ...], skipped: dict
) -> int:
    ambiguous = listed_ambiguously(
        (str(resource.uri), resource.model_dump(mode="json")) for resource in resources
    )
    kept: set[str] = set()
    for resource in resources:
        shown = _without_secrets(
            {
                "uri": str(resource.uri),
                "name": resource.name or "",
                "title": resource.title or "",
                "description": resource.description or "",
                "mime_type": resource.mimeType or "",
            },
            secrets,
        )
        problem = (
            _name_problem(McpResource, "uri", str(resource.uri), secrets)
            or _name_problem(McpResource, "name", resource.name or "", secrets)
            or _fits(McpResource, {name: shown[name] for name in ("title", "mime_type")})
            or ambiguity(ambiguous, str(resource.uri))
        )
        if problem is not None:
            skipped[f"resource {shown['uri'][:REMOTE_NAME_MAX]}"] = problem
            continue
        McpResource.objects.update_or_create(
            server=server,
            uri=shown["uri"],
            defaults={key: value for key, value in shown.items() if key != "uri"}
            | {"last_seen_at": now},
        )
        kept.add(shown["uri"])
    McpResource.objects.filter(server=server).exclude(uri__in=kept).delete()
    return len(kept)


def mcp_drift_of_server(server: McpServer) -> dict[str, str]:
    """Released versions on this server that no longer match it: remote name → reason."""
    return mcp_drift_of_servers([server])[server.pk]


def mcp_drift_of_servers(servers: Sequence[McpServer]) -> dict[Any, dict[str, str]]:
    """`mcp_drift_of_server` for each server, by server id, in two queries."""
    drifted: dict[Any, dict[str, str]] = {server.pk: {} for server in servers}
    if not servers:
        return drifted
    by_namespace = {(server.tenant_id, server.name): server.pk for server in servers}
    released = list(
        ToolVersion.objects.filter(
            functools.reduce(
                operator.or_,
                (
                    Q(tool__tenant_id=tenant_id, tool__namespace=name)
                    for tenant_id, name in by_namespace
                ),
            ),
            adapter_kind=AdapterKind.MCP,
            status__in=[VersionStatus.PUBLISHED, VersionStatus.DEPRECATED],
        ).select_related("tool")
    )
    drift = mcp_drift(released)
    for version in released:
        if str(version.pk) in drift:
            server = by_namespace[(version.tool.tenant_id, version.tool.namespace)]
            remote_name = version.adapter_config.get("remote_name", "")
            drifted[server][remote_name] = drift[str(version.pk)]
    return drifted


def mcp_servers_discover_all(*, actor: AbstractBaseUser | None = None) -> list[str]:
    """Discover every enabled server; one unreachable server does not stop the others."""
    summaries = []
    for server in McpServer.objects.filter(is_enabled=True).order_by("name"):
        try:
            summaries.append(mcp_server_discover(server=server, actor=actor).summary())
        except McpServerUnavailable as error:
            summaries.append(f"{server}: unavailable ({error.message})")
        except Exception as error:  # noqa: BLE001 (one server's fault stops no other)
            # Its type only: the message of a database error quotes what the server sent.
            logger.error("Discovery of MCP server %s failed: %s", server, type(error).__name__)
            _health(server, McpServer.Health.UNHEALTHY, f"discovery failed: {type(error).__name__}")
            summaries.append(f"{server}: discovery failed ({type(error).__name__})")
    return summaries
