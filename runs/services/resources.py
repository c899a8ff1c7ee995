"""MCP resources attached to a message: checked at ingress, read when the run starts.

A resource is someone else's text. It reaches the model only inside an `untrusted_data`
envelope with its URI as source, is kept as a Source the draft may cite (by
`mcp:<server>:<uri>`), and is cut to `MCP_RESOURCE_MAX_BYTES`. A resource that cannot be
read leaves a note, not a failed run.
"""

import functools
import hashlib
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from registry.errors import ValidationFailed
from registry.mcp.connections import (
    McpRemoteError,
    McpTimeout,
    McpUnavailable,
    connections,
    endpoint_for,
)
from registry.models import McpResource, McpServer, Tenant
from registry.selectors import mcp_server_usable
from runs.context import wrap_untrusted
from runs.models import Run, Source
from runs.models.tools import EVIDENCE_USE, source_reference
from runs.services.excerpts import (
    LONGEST_TIMESTAMP,
    NO_ROOM,
    fitted,
    head,
    repeats_refused,
    within,
)
from runs.tools.adapters import mcp_identity
from runs.tools.envelope import strip_secrets
from runs.tools.executor import known_rows_add

RESOURCE_PART = "resource_ref"


def resource_line(part: dict[str, Any]) -> str:
    """How an earlier message of the session refers to a resource: its URI and media type as
    its server listed them, and the server; never its content, which only its own run reads."""
    media_type = part.get("mime_type") or "unknown type"
    return f"[resource {part['uri']}: {media_type}, from {part['server']}]"


def resource_key(part: dict[str, Any]) -> tuple[str, str]:
    """A resource part's identity: a URI names a resource only on its server, and two servers
    may list one URI."""
    return part["server"], part["uri"]


def resource_reference(*, server: str, uri: str) -> str:
    """How the run's evidence, and a draft citing it, refers to a resource read from `server`:
    by its origin and URI, so that one URI listed by two servers is two sources."""
    return source_reference(f"mcp:{server}:{uri}")


def _listed(tenant: Tenant, server_name: str, uri: str) -> McpResource | None:
    """The resource as the tenant's own server lists it (a sandbox's: its parent's), else a
    granted platform server."""
    candidates = (
        McpResource.objects.filter(server__name=server_name, uri=uri)
        .filter(Q(server__tenant=tenant.registry_owner) | Q(server__tenant__isnull=True))
        .select_related("server")
        .order_by("server__tenant_id")
    )
    return next(
        (found for found in candidates if mcp_server_usable(server=found.server, tenant=tenant)),
        None,
    )


def resource_parts_resolve(*, tenant: Tenant, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each resource reference bound to a resource its server listed at discovery, on a
    server available to the tenant; anything else is refused alike, telling nothing. A
    resource is named once: its run reads each reference in a share of the excerpt."""
    repeats_refused(
        parts,
        part_type=RESOURCE_PART,
        key=resource_key,
        named=("server", "uri"),
        noun="resource",
    )
    resolved, unknown = [], []
    for index, part in enumerate(parts):
        if part["type"] != RESOURCE_PART:
            resolved.append(part)
            continue
        found = _listed(tenant, part["server"], part["uri"])
        if found is None:
            unknown.append({"index": index, "uri": part["uri"], "message": "No such resource."})
            continue
        resolved.append(
            {
                "type": RESOURCE_PART,
                "server": found.server.name,
                "server_id": str(found.server_id),
                "uri": found.uri,
                "mime_type": found.mime_type,
            }
        )
    if unknown:
        raise ValidationFailed(
            "A part refers to a resource you cannot use.", details={"parts": unknown}
        )
    return resolved


def _content(result: Any) -> str:
    texts = [
        item.text if hasattr(item, "text") else f"[{item.mimeType or 'binary'} content omitted]"
        for item in result.contents
    ]
    return "\n".join(texts)


def _shown(uri: str, reference: str, content: str, fetched_at: str = LONGEST_TIMESTAMP) -> str:
    """How the user's message shows an excerpt of the resource (measured at the longest
    timestamp an envelope shows)."""
    return wrap_untrusted(
        source=uri,
        fetched_at=fetched_at,
        content=content,
        allowed_use=EVIDENCE_USE,
        references=[reference],
    )


def _excerpt(text: str, *, uri: str, reference: str, tokens: int) -> str | None:
    """At most MCP_RESOURCE_MAX_BYTES of the resource's text, and no more than `tokens` of the
    context, marked as cut when there is more; None when there is no room for any."""
    data = text.encode()
    kept, cut = head(data, settings.MCP_RESOURCE_MAX_BYTES)
    fits = within(tokens, functools.partial(_shown, uri, reference))
    return fitted(kept, cut=cut, size=len(data), fits=fits)


def resources_attach(run: Run, *, tokens: int) -> dict[tuple[str, str], str]:
    """Read the message's resources, each as the run's requester; returns, by `resource_key`,
    what the model is shown for each. Each shows at most `tokens` of the context
    (`excerpts.tokens_each`)."""
    shown: dict[tuple[str, str], str] = {}
    for part in run.message.get("message", {}).get("parts", []):
        if part["type"] != RESOURCE_PART:
            continue
        uri, key = part["uri"], resource_key(part)
        server = McpServer.objects.filter(pk=part["server_id"]).first()
        if not mcp_server_usable(server=server, tenant=run.tenant):
            shown[key] = f"[resource {uri}: its server is no longer available]"
            continue
        try:
            endpoint = endpoint_for(server)
            result = connections.read_resource(
                endpoint,
                uri,
                meta=mcp_identity(tenant=run.tenant, actor=run.actor, run_id=str(run.pk)),
                timeout_s=server.timeout_s,
            )
        except (McpUnavailable, McpTimeout, McpRemoteError):
            shown[key] = f"[resource {uri}: could not be read from {server.name}]"
            continue
        reference = resource_reference(server=server.name, uri=uri)
        content = _excerpt(
            strip_secrets(_content(result), secrets=endpoint.secrets),
            uri=uri,
            reference=reference,
            tokens=tokens,
        )
        if content is None:
            shown[key] = f"[resource {uri}: not read: {NO_ROOM}]"
            continue
        source = Source.objects.create(
            run=run,
            origin=f"mcp:{server.name}",
            reference=reference,
            content_hash=hashlib.sha256(content.encode()).hexdigest(),
            allowed_use=EVIDENCE_USE,
            content=content,
        )
        known_rows_add(run, [source])
        shown[key] = _shown(
            uri, reference, content, (source.fetched_at or timezone.now()).isoformat()
        )
    return shown
