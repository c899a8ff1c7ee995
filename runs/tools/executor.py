"""A tool call through the eight gates of DESIGN.md.

Gates 1-5 run on the worker's own thread with the run locked; gate 6 (the adapter call under
rate limit, concurrency cap and circuit breaker) may run calls of one step in parallel; gate 7
builds the envelope and keeps the evidence; gate 8 (transcript and checkpoint) is the loop's.
A refused call is recorded as `tool.rejected`, answered with a stable error category, and
never executed.
"""

import hashlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import close_old_connections
from jsonschema import Draft202012Validator, FormatChecker

from registry.choices import READ_RISKS, AdapterKind, VersionStatus
from registry.models import ToolVersion
from runs import events
from runs.model_clients.base import ToolCall as RequestedCall
from runs.models import Run, Source, ToolCall
from runs.tools import adapters, limits
from runs.tools.adapters import ToolContext, ToolFailed, ToolOutput, ToolRefused
from runs.tools.envelope import Envelope, ErrorCategory, fit, strip_secrets
from runs.workflows import Node


@dataclass
class Admitted:
    """A call that passed gates 1-5 and waits for execution."""

    record: ToolCall
    tool_version: ToolVersion
    context: ToolContext
    arguments: dict[str, Any]


def _reject(record: ToolCall, run: Run, *, category: ErrorCategory, message: str) -> ToolCall:
    envelope = Envelope(
        call_id=record.call_id,
        tool=record.name,
        protocol_status="rejected",
        business_status="not_executed",
        error={"category": category, "message": message},
    )
    record.status = ToolCall.Status.REJECTED
    record.error_category = category
    record.envelope = envelope.as_dict()
    record.save(update_fields=["status", "error_category", "envelope"])
    events.tool_rejected(
        run, call_id=record.call_id, name=record.name, category=category, reason=message
    )
    return record


def _validation_errors(tool_version: ToolVersion, arguments: Any) -> list[str]:
    if not isinstance(arguments, dict):
        return ["The arguments are not a JSON object."]
    validator = Draft202012Validator(tool_version.input_schema, format_checker=FormatChecker())
    return sorted(
        ("/".join(map(str, error.absolute_path)) + ": " if error.absolute_path else "")
        + error.message
        for error in validator.iter_errors(arguments)
    )


def _credential(tool_version: ToolVersion) -> str | None:
    reference = tool_version.adapter_config.get("credential_ref")
    if tool_version.adapter_kind != AdapterKind.HTTP or not reference:
        return None
    return os.environ.get(reference)


def admit(*, run: Run, call: RequestedCall, node: Node, step: int) -> ToolCall | Admitted:
    """Gates 1-5. Returns the rejected (or already finished) ToolCall, or the admitted call."""
    entry = next(
        (tool for tool in run.capability.get("tools", []) if tool["name"] == call.name), None
    )
    tool_version = ToolVersion.objects.select_related("tool").get(pk=entry["id"]) if entry else None
    record, created = ToolCall.objects.get_or_create(
        run=run,
        call_id=call.call_id,
        defaults={
            "step": step,
            "name": call.name[:128],
            "arguments": call.arguments,
            "tool_version": tool_version,
        },
    )
    if not created and record.status != ToolCall.Status.REQUESTED:
        return record
    if created:
        run.tool_call_count += 1
        events.tool_requested(
            run, call_id=call.call_id, name=record.name, arguments=record.arguments
        )
    if entry is None or call.name not in node.tools:
        category = ErrorCategory.NOT_FOUND if entry is None else ErrorCategory.PERMISSION_DENIED
        return _reject(
            record, run, category=category, message=f"{call.name} is not available in this step."
        )
    if tool_version.status == VersionStatus.REVOKED:
        return _reject(
            record,
            run,
            category=ErrorCategory.PERMISSION_DENIED,
            message=f"{tool_version.qualified_name} was revoked.",
        )
    problems = _validation_errors(tool_version, call.arguments)
    if problems:
        return _reject(
            record, run, category=ErrorCategory.INVALID_ARGUMENT, message="; ".join(problems)
        )
    context = ToolContext(
        run_id=str(run.pk),
        call_id=call.call_id,
        tenant=run.tenant,
        actor=run.actor,
        idempotency_key=f"{run.pk}:{call.call_id}",
        credential=_credential(tool_version),
    )
    try:
        adapters.authorize(tool_version, context, call.arguments)
    except ToolRefused as refused:
        return _reject(record, run, category=refused.category, message=str(refused))
    if node.guard is not None:
        reason = node.guard(run.state, call.name, call.arguments)
        if reason:
            return _reject(record, run, category=ErrorCategory.PERMISSION_DENIED, message=reason)
    return Admitted(
        record=record, tool_version=tool_version, context=context, arguments=call.arguments
    )


def _attempt(admitted: Admitted) -> ToolOutput:
    tool_version = admitted.tool_version
    limits.check_circuit(tool_version)
    limits.check_rate_limit(tool_version, tenant_id=admitted.context.tenant.pk)
    with limits.concurrency_slot(tool_version):
        try:
            output = adapters.execute(tool_version, admitted.context, admitted.arguments)
        except ToolFailed:
            limits.record_outcome(tool_version, failed=True)
            raise
    limits.record_outcome(tool_version, failed=False)
    return output


def _run_with_retries(admitted: Admitted) -> tuple[ToolOutput | ToolFailed, int, int]:
    """Gate 6. Only transient failures of tools safe to repeat are retried, with backoff and
    jitter, within the tool's retry policy. Returns (outcome, attempts, duration_ms)."""
    tool_version = admitted.tool_version
    policy = tool_version.retry_policy or {}
    max_attempts = policy.get("max_attempts", 1)
    repeatable = tool_version.is_idempotent or tool_version.risk in READ_RISKS
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return _attempt(admitted), attempt, int((time.monotonic() - started) * 1000)
        except ToolFailed as failure:
            if not (failure.retryable and repeatable and attempt < max_attempts):
                return failure, attempt, int((time.monotonic() - started) * 1000)
        backoff = min(
            policy.get("backoff_s", 0.2) * 2 ** (attempt - 1), policy.get("max_backoff_s", 2)
        )
        time.sleep(random.uniform(0, backoff) if policy.get("jitter", True) else backoff)


def _execute_isolated(admitted: Admitted) -> tuple[ToolOutput | ToolFailed, int, int]:
    try:
        return _run_with_retries(admitted)
    finally:
        close_old_connections()


def execute_admitted(run: Run, admitted: list[Admitted]) -> list[ToolCall]:
    """Gates 6 and 7 for the admitted calls of one step; independent calls run in parallel
    under `TOOL_PARALLELISM`, results stay paired with their call ids."""
    if len(admitted) > 1:
        with ThreadPoolExecutor(
            max_workers=settings.TOOL_PARALLELISM, thread_name_prefix="tool-call"
        ) as pool:
            outcomes = list(pool.map(_execute_isolated, admitted))
    else:
        outcomes = [_run_with_retries(call) for call in admitted]
    return [
        _record(run, call, outcome, attempts, duration_ms)
        for call, (outcome, attempts, duration_ms) in zip(admitted, outcomes, strict=True)
    ]


def _record(
    run: Run, admitted: Admitted, outcome: ToolOutput | ToolFailed, attempts: int, duration_ms: int
) -> ToolCall:
    """Gate 7: the envelope, secrets stripped and size-limited; evidence kept as Sources."""
    record, tool_version = admitted.record, admitted.tool_version
    secrets = tuple(filter(None, [admitted.context.credential]))
    envelope = Envelope(
        call_id=record.call_id,
        tool=tool_version.qualified_name,
        protocol_status="ok",
        business_status="ok",
    )
    if isinstance(outcome, ToolFailed):
        envelope.protocol_status = "error"
        envelope.business_status = "unknown" if outcome.may_have_side_effect else "failed"
        envelope.raw = strip_secrets(outcome.raw, secrets=secrets)
        envelope.error = {"category": outcome.category, "message": str(outcome)}
        envelope.retryable = outcome.retryable
        envelope.may_have_side_effect = outcome.may_have_side_effect
        record.status = ToolCall.Status.FAILED
        record.error_category = outcome.category
    else:
        envelope.business_status = outcome.business_status
        envelope.raw = strip_secrets(outcome.raw, secrets=secrets)
        envelope.normalized = strip_secrets(outcome.normalized, secrets=secrets)
        for draft in outcome.sources:
            content = strip_secrets(draft.content, secrets=secrets)
            source = Source.objects.create(
                run=run,
                tool_call=record,
                origin=tool_version.qualified_name,
                reference=draft.reference[:300],
                content_hash=hashlib.sha256(content.encode()).hexdigest(),
                allowed_use=draft.allowed_use,
                content=content,
            )
            envelope.sources.append(
                {
                    "id": str(source.pk),
                    "reference": source.reference,
                    "content_hash": source.content_hash,
                }
            )
        record.status = ToolCall.Status.COMPLETED
    envelope = fit(envelope, max_bytes=settings.TOOL_RESULT_MAX_BYTES)
    record.envelope = envelope.as_dict()
    record.attempts = attempts
    record.duration_ms = duration_ms
    record.save(update_fields=["status", "error_category", "envelope", "attempts", "duration_ms"])
    if record.status == ToolCall.Status.COMPLETED:
        events.tool_completed(
            run,
            call_id=record.call_id,
            name=tool_version.qualified_name,
            business_status=envelope.business_status,
            duration_ms=duration_ms,
            sources=[source["reference"] for source in envelope.sources],
        )
    else:
        events.tool_failed(
            run,
            call_id=record.call_id,
            name=tool_version.qualified_name,
            category=record.error_category,
            retryable=envelope.retryable,
            may_have_side_effect=envelope.may_have_side_effect,
        )
    return record
