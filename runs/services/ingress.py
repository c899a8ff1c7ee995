"""Message ingress: a message becomes a governed run, exactly once per Idempotency-Key."""

import secrets
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from config.celery import task_send
from config.ids import time_ordered_id
from config.queries import PreparedQuery
from registry.canonical import canonical_hash
from registry.choices import Action
from registry.generation import registry_cached
from registry.models import AgentConfig, Tenant
from registry.selectors import user_can, user_roles_and_generation
from runs import events, tracing, writes
from runs.capability import capability_snapshot
from runs.choices import RunStatus
from runs.errors import IdempotencyKeyReused, NotFound, PermissionDenied, ValidationFailed
from runs.models import IngressRecord, Run, Session
from runs.redaction import redact, secrets_removed
from runs.services.attachments import attachment_parts_resolve
from runs.services.resources import resource_parts_resolve
from runs.services.runs import run_finish
from runs.tasks import run_advance


@dataclass(frozen=True)
class Ingested:
    run: Run
    created: bool


def _existing(*, tenant: Tenant, actor: AbstractBaseUser, key: str, request_hash: str):
    record = (
        IngressRecord.objects.select_related("run")
        .filter(tenant=tenant, actor=actor, idempotency_key=key)
        .first()
    )
    if record is None:
        return None
    if record.request_hash != request_hash:
        raise IdempotencyKeyReused(
            "This Idempotency-Key was used with a different body.",
            details={"idempotency_key": key, "run_id": str(record.run_id)},
        )
    return Ingested(run=record.run, created=False)


_SESSION_LOCKED = PreparedQuery(
    lambda session_id, tenant_id, actor_id: (
        Session.objects.select_for_update()
        .filter(pk=session_id, tenant_id=tenant_id, actor_id=actor_id)
        .order_by()[:1]
    ),
    session_id=UUID,
    tenant_id=int,
    actor_id=int,
)
# An agent whose model an admin switched off is as unavailable as one switched off itself.
_ACTIVE_AGENTS = AgentConfig.objects.filter(
    is_active=True, model_config__is_active=True
).select_related("policy", "model_config")
_AGENT_NAMED = PreparedQuery(
    lambda tenant_id, name: _ACTIVE_AGENTS.filter(tenant_id=tenant_id, name=name).order_by()[:1],
    tenant_id=int,
    name=str,
)
_AGENT_OF_ID = PreparedQuery(
    lambda tenant_id, pk: _ACTIVE_AGENTS.filter(tenant_id=tenant_id, pk=pk).order_by()[:1],
    tenant_id=int,
    pk=int,
)
_AGENT_DEFAULT = PreparedQuery(
    lambda tenant_id: _ACTIVE_AGENTS.filter(tenant_id=tenant_id).order_by("name")[:1],
    tenant_id=int,
)


def _session(
    *, tenant: Tenant, actor: AbstractBaseUser, session_id: UUID | None, channel: str
) -> tuple[Session, bool]:
    """The session named, locked; or a new one, not saved yet (it is written with its run)."""
    if session_id is None:
        return Session(tenant=tenant, actor=actor, channel=channel), True
    session = _SESSION_LOCKED.first(session_id=session_id, tenant_id=tenant.pk, actor_id=actor.pk)
    if session is None:
        raise NotFound("No such session.", details={"session_id": str(session_id)})
    return session, False


def _agent_config(
    *, tenant: Tenant, name: str | None, agent_id: int | None, generation: int | None
) -> AgentConfig | None:
    """The active agent of the id the server gave, or else named, or else the tenant's
    first; kept while the registry's generation stays the same (`registry.generation`), as
    one instance the runs share and never change."""
    if agent_id is not None:
        agent = registry_cached(
            generation,
            ("agent id", tenant.pk, agent_id),
            lambda: _AGENT_OF_ID.first(tenant_id=tenant.pk, pk=agent_id),
        )
        if agent is None:
            raise NotFound("No such agent in this tenant.", details={"agent_config_id": agent_id})
        return agent
    agent = registry_cached(
        generation,
        ("agent", tenant.pk, name or None),
        lambda: (
            _AGENT_NAMED.first(tenant_id=tenant.pk, name=name)
            if name
            else _AGENT_DEFAULT.first(tenant_id=tenant.pk)
        ),
    )
    if name and agent is None:
        raise NotFound("No such agent in this tenant.", details={"agent": name})
    return agent


def _normalized(
    *,
    run_id: UUID,
    tenant: Tenant,
    actor: AbstractBaseUser,
    session: Session,
    channel: str,
    key: str,
    parts: list[dict[str, Any]],
    metadata: dict[str, Any],
    received_at: str,
) -> dict[str, Any]:
    """The internal message event every downstream component reads (seed 000, stage 2)."""
    return {
        "event_id": str(uuid4()),
        "idempotency_key": key,
        "type": "message.received",
        "tenant_id": tenant.slug,
        "session_id": str(session.pk),
        "run_id": str(run_id),
        "actor": {"user_id": str(actor.pk), "channel": channel},
        "message": {"role": "user", "parts": parts},
        "metadata": metadata,
        "source_timestamp": metadata.get("source_timestamp") or received_at,
        "received_at": received_at,
    }


def message_ingest(
    *,
    actor: AbstractBaseUser,
    tenant: Tenant,
    idempotency_key: str,
    channel: str,
    parts: list[dict[str, Any]],
    metadata: dict[str, Any],
    session_id: UUID | None = None,
    agent_config_id: int | None = None,
) -> Ingested:
    """Accept a message: the same key and body give the same run; the same key with another
    body is refused; concurrent duplicates make one run (the ingress unique constraint). A
    secret pasted into the text or the metadata (a key, a token, a bearer header, a value
    under a name that says it is a secret) is removed before the run stores, logs or shows it
    to a model; the key's request hash is of the body as sent.
    Attachment references must name the actor's own uploads in this tenant; the run's message
    carries what each one is, never its content. Resource references must name a resource an
    MCP server available to the tenant listed; a reference refused so for a request whose key
    is taken (its server was switched off since) is answered as the key's first request was,
    so a client retrying an accepted message gets its run.
    The agent is one of the tenant's active agents: the one of `agent_config_id`, which only
    the server gives (a scheduled task's, by its key, so a renamed agent stays the task's),
    or else the one `metadata.agent` names, or else the tenant's first."""
    roles, generation = user_roles_and_generation(user=actor, tenant=tenant)
    if not user_can(user=actor, action=Action.RUN_CREATE, tenant=tenant, roles=roles):
        raise PermissionDenied("You may not start runs in this tenant.")
    request = {
        "channel": channel,
        "parts": parts,
        "metadata": metadata,
        "session_id": str(session_id) if session_id else None,
    }
    request_hash = canonical_hash(request)
    try:
        normalized_parts = [
            {**part, "text": secrets_removed(part["text"])} if part["type"] == "text" else part
            for part in resource_parts_resolve(
                tenant=tenant,
                parts=attachment_parts_resolve(actor=actor, tenant=tenant, parts=parts),
            )
        ]
        with transaction.atomic():
            run = _create_run(
                actor=actor,
                tenant=tenant,
                key=idempotency_key,
                request_hash=request_hash,
                channel=channel,
                parts=normalized_parts,
                metadata=redact(metadata, cleared=True),
                session_id=session_id,
                agent_config_id=agent_config_id,
                roles=roles,
                generation=generation,
            )
        if run.status == RunStatus.QUEUED:
            transaction.on_commit(lambda: task_send(run_advance, run_id=str(run.pk)))
    except (IntegrityError, NotFound, ValidationFailed):
        existing = _existing(
            tenant=tenant, actor=actor, key=idempotency_key, request_hash=request_hash
        )
        if existing is None:
            raise
        return existing
    return Ingested(run=run, created=True)


def _create_run(
    *,
    actor: AbstractBaseUser,
    tenant: Tenant,
    key: str,
    request_hash: str,
    channel: str,
    parts: list[dict[str, Any]],
    metadata: dict[str, Any],
    session_id: UUID | None,
    agent_config_id: int | None,
    roles: frozenset[str],
    generation: int | None,
) -> Run:
    """The ingress record is written with its run, in the run's one statement: a key already
    taken fails there, and the transaction rolls back what was done before it. The caller
    answers a key already taken, and a session or agent not found for a request whose key is
    taken, as the key's first request was answered (or as a reused key)."""
    run_id = time_ordered_id()
    started_at = timezone.now()
    agent_config = _agent_config(
        tenant=tenant, name=metadata.get("agent"), agent_id=agent_config_id, generation=generation
    )
    session, is_new = _session(tenant=tenant, actor=actor, session_id=session_id, channel=channel)
    message = _normalized(
        run_id=run_id,
        tenant=tenant,
        actor=actor,
        session=session,
        channel=channel,
        key=key,
        parts=parts,
        metadata=metadata,
        received_at=timezone.now().isoformat(),
    )
    capability_started = timezone.now()
    capability, capability_hash = (
        capability_snapshot(
            tenant=tenant,
            actor=actor,
            agent_config=agent_config,
            roles=roles,
            request_text=" ".join(part["text"] for part in parts if part["type"] == "text"),
            generation=generation,
        )
        if agent_config
        else ({}, "")
    )
    capability_ended = timezone.now()
    run = Run(
        id=run_id,
        tenant=tenant,
        actor=actor,
        session=session,
        agent_config=agent_config,
        channel=channel,
        message=message,
        capability=capability,
        capability_hash=capability_hash,
        skill=next(
            (f"{skill['name']}@{skill['version']}" for skill in capability.get("skills", [])),
            "",
        ),
        trace_id=secrets.token_hex(16),
    )
    writes.hold(run)
    writes.add(
        run,
        [
            IngressRecord(
                tenant=tenant,
                actor=actor,
                idempotency_key=key,
                request_hash=request_hash,
                run_id=run_id,
            )
        ],
    )
    if is_new:
        writes.add(run, [session])
    ingress = tracing.span_add(
        run, "ingress", started_at=started_at, channel=channel, parts=len(parts), new_session=is_new
    )
    tracing.span_add(
        run,
        "capability",
        started_at=capability_started,
        ended_at=capability_ended,
        parent_span_id=ingress.span_id,
        capability_hash=run.capability_hash,
        tools=len(capability.get("tools", [])),
        excluded=len(capability.get("excluded", [])),
    )
    events.message_received(
        run,
        idempotency_key=key,
        channel=channel,
        part_count=len(parts),
        request_hash=request_hash,
    )
    events.message_normalized(run, message=message)
    events.session_loaded(run, is_new=is_new, state_keys=sorted(session.state))
    if agent_config is None:
        tracing.export_on_commit(writes.run_insert(run))
        return run_finish(run=run, status=RunStatus.REFUSED, reason_code="NO_AGENT_CONFIGURED")
    events.capability_resolved(
        run,
        capability_hash=run.capability_hash,
        skills=[f"{skill['name']}@{skill['version']}" for skill in capability["skills"]],
        tools=[f"{tool['name']}@{tool['version']}" for tool in capability["tools"]],
    )
    tracing.export_on_commit(writes.run_insert(run))
    return run
