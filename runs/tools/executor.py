"""A tool call through the eight gates of DESIGN.md.

Gates 1-5 run on the worker's own thread with the run locked; gate 6 (the adapter call under
rate limit, concurrency cap and circuit breaker) may run calls of one step in parallel; gate 7
builds the envelope and keeps the evidence; gate 8 (transcript and checkpoint) is the loop's.
A refused call is recorded as `tool.rejected`, answered with a stable error category, and
never executed.
"""

import copy
import hashlib
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone
from jsonschema import Draft202012Validator, FormatChecker
from referencing import Registry

from config.credentials import credential_refusal, credential_value
from config.queries import PreparedQuery
from registry.choices import READ_RISKS, AdapterKind
from registry.models import Tenant, ToolVersion
from registry.selectors import version_ids_withdrawn, versions_frozen
from runs import events, quotas, tracing, writes
from runs.choices import RunStatus
from runs.model_clients.base import ToolCall as RequestedCall
from runs.model_clients.base import arguments_too_large
from runs.models import Run, Source, ToolCall
from runs.models.tools import EVIDENCE_USE, source_reference
from runs.tools import adapters, limits, threads
from runs.tools.adapters import SourceDraft, ToolContext, ToolFailed, ToolOutput, ToolRefused
from runs.tools.envelope import (
    DRY_RUN,
    Envelope,
    ErrorCategory,
    business_done,
    fit,
    strip_secrets,
)
from runs.workflows import Node

logger = logging.getLogger(__name__)

# Failures of a tool that may pass: another try may reach it. A sandbox's faults of these
# categories are retryable, as a real system's would be; a retry policy applies to them.
TRANSIENT_CATEGORIES = frozenset(
    {ErrorCategory.TIMEOUT, ErrorCategory.UPSTREAM_ERROR, ErrorCategory.RATE_LIMITED}
)

# Failures that tell of the tool's own health, which its circuit breaker counts. A caller's
# mistake (NOT_FOUND, INVALID_ARGUMENT, PERMISSION_DENIED) is an answer: the tool is up.
# Counted as a failure, a few bad arguments of one tenant opened a platform-wide tool's
# circuit for every tenant.
TOOL_FAULTS = TRANSIENT_CATEGORIES | {ErrorCategory.UNKNOWN}


@dataclass
class Admitted:
    """A call that passed gates 1-5 and waits for execution."""

    record: ToolCall
    tool_version: ToolVersion
    context: ToolContext
    arguments: dict[str, Any]


# What each call a try at a step executed gave, by call id: (outcome, attempts, duration_ms,
# None), the last in place of the limits' passage, which the call has left.
CallsMade = dict[str, tuple[Any, int, int, None]]


@dataclass
class StepCalls:
    """The calls of one step: records in call order, and the evidence they returned. Both
    are written together, in two statements, when the step's calls have run."""

    records: list[ToolCall] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)


def unavailable_for_a_while(record: ToolCall) -> bool:
    """Whether a call's outcome says its tool was only unavailable for a while, so that a
    run left without a result by it may be retried: the call failed, or was turned away
    before it ran, and its envelope says another try may pass (`retryable`). The envelope's
    flag decides, never the error category alone: a tool that answers UPSTREAM_ERROR or
    TIMEOUT and says a retry will not help is not one to try again later, and one that
    says it may is. How both workflows tell a tool that may answer another time from one
    that will not."""
    return (
        record.status in (ToolCall.Status.FAILED, ToolCall.Status.REJECTED)
        and record.envelope.get("retryable") is True
    )


def _reject(
    record: ToolCall,
    run: Run,
    *,
    category: ErrorCategory,
    message: str,
    retryable: bool = False,
) -> ToolCall:
    """The call turned away before it ran, never executed; `retryable` when the refusal may
    pass (an authorisation check that did not answer within the tool's timeout). The reason
    loses its secrets, as a failed call's message does: a handler's check may quote what the
    system it asked answered, a token included."""
    envelope = fit(
        Envelope(
            call_id=record.call_id,
            tool=record.name,
            protocol_status="rejected",
            business_status="not_executed",
            error={"category": category, "message": strip_secrets(message)},
            retryable=retryable,
        ),
        max_bytes=settings.TOOL_RESULT_MAX_BYTES,
    )
    message = envelope.error["message"]
    record.status = ToolCall.Status.REJECTED
    record.error_category = category
    record.envelope = envelope.as_dict()
    events.tool_rejected(
        run,
        call_id=record.call_id,
        name=record.name,
        category=category,
        reason=message,
        retryable=retryable,
    )
    tracing.span_add(
        run,
        "tool.call",
        started_at=record.started_at,
        error=True,
        tool=record.name,
        call_id=record.call_id,
        status=record.status,
        error_category=category,
        validation=message,
    )
    return record


# A published version's schema never changes: its validator is built once per process, and
# kept with the schema it was built from (a schema that differs builds a new one).
_validators: dict[Any, tuple[Any, Draft202012Validator]] = {}


def schema_validator(schema: dict[str, Any]) -> Draft202012Validator:
    """How gate 2 checks arguments against an input schema (formats included). A reference
    resolves within the schema or to a JSON Schema meta-schema; nothing is ever fetched (the
    default registry would fetch any URL a schema names, from the worker)."""
    return Draft202012Validator(schema, format_checker=FormatChecker(), registry=Registry())


def _validator(tool_version: ToolVersion) -> Draft202012Validator:
    schema = tool_version.input_schema
    cached = _validators.get(tool_version.pk)
    if cached is None or cached[0] != schema:
        if len(_validators) >= 256:
            _validators.clear()
        schema = copy.deepcopy(schema)
        cached = _validators[tool_version.pk] = (schema, schema_validator(schema))
    return cached[1]


def _validation_errors(tool_version: ToolVersion, arguments: Any) -> list[str]:
    if (too_large := arguments_too_large(arguments)) is not None:
        size, limit = too_large
        return [f"The arguments are {size} bytes, more than the {limit} a tool call may send."]
    if not isinstance(arguments, dict):
        return ["The arguments are not a JSON object."]
    validator = _validator(tool_version)
    if validator.is_valid(arguments):
        return []
    return sorted(
        ("/".join(map(str, error.absolute_path)) + ": " if error.absolute_path else "")
        + _shortened(error.message)
        for error in validator.iter_errors(arguments)
    )


# A validation message quotes the value it refuses: a long one is cut to this many characters.
VALIDATION_MESSAGE_CHARS = 200


def _shortened(message: str) -> str:
    if len(message) <= VALIDATION_MESSAGE_CHARS:
        return message
    return message[: VALIDATION_MESSAGE_CHARS - 1] + "…"


def _credential_reference(tool_version: ToolVersion, run: Run) -> tuple[str, Tenant | None] | None:
    """The variable an HTTP tool names as its credential, with the tenant that owns the tool
    (the run's; None: a platform-wide tool), or None."""
    reference = tool_version.adapter_config.get("credential_ref")
    if tool_version.adapter_kind != AdapterKind.HTTP or not reference:
        return None
    return reference, None if tool_version.tool.tenant_id is None else run.tenant


def host_context(
    *,
    run: Run,
    call_id: str,
    tool_version: ToolVersion,
    resources: dict[str, Any] | None = None,
    deadline: float | None = None,
) -> ToolContext:
    """Gate 5: what the host, never the model, gives a call: identity, tenant, the
    idempotency key `run_id:call_id` and a short-lived credential from its reference; and
    the `deadline` by which the call must have ended (`tries_deadline`), if it has one."""
    reference = _credential_reference(tool_version, run)
    return ToolContext(
        run_id=str(run.pk),
        call_id=call_id,
        tenant=run.tenant,
        actor=run.actor,
        idempotency_key=f"{run.pk}:{call_id}",
        credential=None
        if reference is None
        else credential_value(reference[0], owner=reference[1]),
        resources={} if resources is None else resources,
        deadline=deadline,
    )


def snapshot_tool(run: Run, name: str) -> dict[str, Any] | None:
    """The entry of the run's capability snapshot for the tool `name`, if it holds one."""
    return next((tool for tool in run.capability.get("tools", []) if tool["name"] == name), None)


def tools_withdrawn(run: Run) -> frozenset[str]:
    """The ids of the snapshot's tool versions revoked or no longer granted to the run's
    tenant since it started. One lookup of them all serves what a turn offers the model and
    the gate of its calls; under the registry's generation the step read, it is kept until
    the generation moves, so a step of a registry nobody changed asks nothing."""
    ids = [entry["id"] for entry in run.capability.get("tools", [])]
    if not ids:
        return frozenset()
    return version_ids_withdrawn(
        model=ToolVersion,
        ids=ids,
        tenant=run.tenant,
        generation=getattr(run, "registry_generation", None),
    )


def host_refusal(
    *, run: Run, call: RequestedCall, deadline: float
) -> ToolRefused | ToolFailed | None:
    """Gate 3 alone, for a call the host would make but answers from what it holds (a
    recipient confirmed in the session): why its tool does not authorise it, if it does not
    (a refusal, or a check that failed), so the call is turned away the same with or without
    being made. The check ends by `deadline` (monotonic), as the call's own would."""
    entry = snapshot_tool(run, call.name)
    if entry is None:
        return ToolRefused(
            f"{call.name} is not available in this step.", category=ErrorCategory.NOT_FOUND
        )
    tool_version = versions_frozen(model=ToolVersion, ids={entry["id"]})[entry["id"]]
    context = host_context(
        run=run, call_id=call.call_id, tool_version=tool_version, deadline=deadline
    )
    return _authorization_refusal(tool_version, context, call.arguments)


def _authorization_refusal(
    tool_version: ToolVersion, context: ToolContext, arguments: Any
) -> ToolRefused | ToolFailed | None:
    """Gate 3: why the tool does not authorise the call, if it does not. A handler that is
    not installed, or whose check raised (a bug; a database error is the step's), refuses it
    as it would fail a call it ran: the model is answered, the step goes on."""
    try:
        adapters.authorize(tool_version, context, arguments)
    except (ToolRefused, ToolFailed) as refusal:
        return refusal
    except DatabaseError:
        raise
    except Exception as error:  # noqa: BLE001 (a handler's bug fails its call only)
        return adapters.handler_failure(tool_version, error)
    return None


def _admit(
    *,
    run: Run,
    call: RequestedCall,
    node: Node,
    step: int,
    entry: dict[str, Any] | None,
    tool_version: ToolVersion | None,
    withdrawn: bool,
    authorised: dict[str, Any],
    deadline: float,
) -> ToolCall | Admitted:
    """Gates 1-5 for one call the run has not seen, to end by `deadline`, its check
    included. Returns the rejected ToolCall (not yet saved) or the admitted call."""
    record = writes.new(
        ToolCall,
        run_id=run.pk,
        call_id=call.call_id,
        step=step,
        name=call.name[:128],
        arguments=call.arguments,
        tool_version_id=None if tool_version is None else tool_version.pk,
        started_at=timezone.now(),
    )
    run.tool_call_count += 1
    events.tool_requested(run, call_id=call.call_id, name=record.name, arguments=record.arguments)
    if entry is None or tool_version is None or call.name not in node.tools:
        category = ErrorCategory.NOT_FOUND if entry is None else ErrorCategory.PERMISSION_DENIED
        return _reject(
            record, run, category=category, message=f"{record.name} is not available in this step."
        )
    if withdrawn:
        return _reject(
            record,
            run,
            category=ErrorCategory.PERMISSION_DENIED,
            message=f"{tool_version.qualified_name} was revoked or is no longer granted.",
        )
    problems = _validation_errors(tool_version, call.arguments)
    if problems:
        return _reject(
            record, run, category=ErrorCategory.INVALID_ARGUMENT, message="; ".join(problems)
        )
    reference = _credential_reference(tool_version, run)
    refusal = reference and credential_refusal(reference[0], owner=reference[1])
    if refusal:
        return _reject(record, run, category=ErrorCategory.PERMISSION_DENIED, message=refusal)
    context = host_context(
        run=run,
        call_id=call.call_id,
        tool_version=tool_version,
        resources=authorised,
        deadline=deadline,
    )
    if reference and not context.credential:
        # Called without it, the service would take the call as anonymous, or refuse it
        # after it went out; a model or MCP server's unset credential fails the same way.
        return _reject(
            record,
            run,
            category=ErrorCategory.PERMISSION_DENIED,
            message=(
                f"The credential {reference[0]} is not set or empty on this host; nothing was sent."
            ),
        )
    if (refusal := _authorization_refusal(tool_version, context, call.arguments)) is not None:
        return _reject(
            record,
            run,
            category=refusal.category,
            message=str(refusal),
            retryable=isinstance(refusal, ToolFailed) and refusal.retryable,
        )
    if not node.side_effects and tool_version.risk not in READ_RISKS:
        return _reject(
            record,
            run,
            category=ErrorCategory.PERMISSION_DENIED,
            message=f"{tool_version.qualified_name} is not a read: it runs only after approval.",
        )
    if node.guard is not None:
        reason = node.guard(run.state, call.name, call.arguments)
        if reason:
            return _reject(record, run, category=ErrorCategory.PERMISSION_DENIED, message=reason)
    return Admitted(
        record=record, tool_version=tool_version, context=context, arguments=call.arguments
    )


# The reference of the Source that keeps a whole response its envelope had to cut.
RESULT_REFERENCE_PREFIX = "tool-result:"
# A side effect turned away by a limit asks again after this long (seconds, jittered).
LIMIT_WAIT_SECONDS = (0.2, 1.0)
_RUN_CALL_IDS = PreparedQuery(
    lambda run_id: (
        ToolCall.objects.filter(run_id=run_id).order_by().values_list("call_id", flat=True)
    ),
    run_id=uuid.UUID,
)


KNOWN_ROWS = "_known_rows"


@dataclass
class KnownRows:
    """The call ids of a run's tool calls and the references of its evidence, as of the
    run's row: kept on the run by an execution that has seen every such row written. It
    starts from a run that has not started (its steps make every ToolCall and Source: the
    tool calls, and the MCP resources its start attaches) and takes in what each step
    writes, for as long as the execution reuses its copy of the run, that is while nobody
    else writes it (`runs.loop.Execution`)."""

    call_ids: set[str] = field(default_factory=set)
    evidence: set[str] = field(default_factory=set)


def known_rows(run: Run) -> KnownRows | None:
    return run.__dict__.get(KNOWN_ROWS)


def known_rows_start(run: Run) -> None:
    """On a run just read with its lock: one that has not started has no such row."""
    if run.status == RunStatus.QUEUED:
        run.__dict__[KNOWN_ROWS] = KnownRows()


def known_rows_add(run: Run, rows: list) -> None:
    """Rows a step wrote for the run."""
    known = known_rows(run)
    if known is None:
        return
    for row in rows:
        if type(row) is ToolCall:
            known.call_ids.add(row.call_id)
        elif type(row) is Source and row.allowed_use == EVIDENCE_USE:
            known.evidence.add(row.reference)


def _known_calls(run: Run, calls: list[RequestedCall]) -> dict[str, ToolCall]:
    """The records the run already has of these call ids: the call ids of a run are few
    (its tool-call budget), and a record is loaded only on a redelivery."""
    known = known_rows(run)
    call_ids = known.call_ids if known is not None else set(_RUN_CALL_IDS(run_id=run.pk))
    repeated = call_ids & {call.call_id for call in calls}
    if not repeated:
        return {}
    return {record.call_id: record for record in run.tool_calls.filter(call_id__in=repeated)}


def calls_run(
    *,
    run: Run,
    calls: list[RequestedCall],
    node: Node,
    step: int,
    deadline: float,
    made: CallsMade,
) -> list[ToolCall]:
    """The eight gates for the calls of one step, with the run locked, to end by `deadline`
    (no later than `tries_deadline`); returns their records in call order. A call id the run
    already has is answered with its record and never admitted or executed again. Gates 1-5
    run in call order; admitted calls execute (in parallel when there are several); the
    records, their evidence and their events are written in the step's transaction.
    `made`: what the calls executed by an earlier try at this step gave, by call id, when
    that try was rolled back before it was written (`runs.loop.run_advance_step`). Such a
    call passes gates 1-5 again and is recorded from that outcome: it is not executed
    again. The calls executed now are added to it."""
    by_name = {entry["name"]: entry for entry in run.capability.get("tools", [])}
    entries = [by_name.get(call.name) for call in calls]
    ids = {entry["id"] for entry in entries if entry is not None}
    tool_versions = versions_frozen(model=ToolVersion, ids=ids)
    withdrawn = tools_withdrawn(run) if ids else frozenset()
    known = _known_calls(run, calls)
    step_calls = StepCalls()
    authorised: dict[str, Any] = {}
    admitted: list[Admitted] = []
    outcomes: dict[str, ToolCall] = {}
    for call, entry in zip(calls, entries, strict=True):
        if call.call_id in known or call.call_id in outcomes:
            continue
        outcome = _admit(
            run=run,
            call=call,
            node=node,
            step=step,
            entry=entry,
            tool_version=tool_versions.get(entry["id"]) if entry else None,
            withdrawn=entry is not None and entry["id"] in withdrawn,
            authorised=authorised,
            deadline=deadline,
        )
        if isinstance(outcome, Admitted):
            admitted.append(outcome)
            outcome = outcome.record
        outcomes[call.call_id] = outcome
        step_calls.records.append(outcome)
    _execute_admitted(run, admitted, step_calls, deadline=deadline, made=made)
    writes.add(run, [*step_calls.records, *step_calls.sources])
    return [known.get(call.call_id) or outcomes[call.call_id] for call in calls]


def side_effect_admit(
    *, run: Run, call: RequestedCall, node: Node, step: int
) -> Admitted | ToolCall:
    """Gates 1-5 for a side effect, with the run locked. Its ToolCall is saved now, in the
    transaction that records the action as executing: the call and its idempotency key are
    durable before anything is done. Run it with `side_effect_run`, outside any transaction,
    and record it with `side_effect_record`. The send's time (`tries_deadline`) starts
    here, before its gate-3 check, and bounds the check and the send, which run in the same
    task."""
    entry = snapshot_tool(run, call.name)
    tool_version = (
        versions_frozen(model=ToolVersion, ids=[entry["id"]]).get(entry["id"]) if entry else None
    )
    outcome = _admit(
        run=run,
        call=call,
        node=node,
        step=step,
        entry=entry,
        tool_version=tool_version,
        withdrawn=bool(entry)
        and entry["id"]
        in version_ids_withdrawn(model=ToolVersion, ids=[entry["id"]], tenant=run.tenant),
        authorised={},
        deadline=tries_deadline(),
    )
    record = outcome.record if isinstance(outcome, Admitted) else outcome
    record.save(force_insert=True)
    return outcome


def side_effect_run(admitted: Admitted) -> tuple[ToolOutput | ToolFailed, int, int]:
    """Gate 6 for a side effect: under its limits, without retrying what may have happened.
    A limit that turned the call away (its concurrency or rate cap reached, its circuit open)
    did nothing, so the call waits for it, with jitter, at most as long as a crashed
    worker's slot can outlive it (the tool's timeout and a grace): an approved action is not
    failed because other sends held every slot for a moment. It is not asked again before
    its open circuit lets a trial through, the trial under way has had its time or its rate
    window frees a place (the refusal's `retry_after`): one that does none in that time fails
    the call at once. Neither the wait nor a retry goes past the task's time, nor does a
    try, whatever the tool's timeout: the deadline its context holds (`tries_deadline`,
    taken by `side_effect_admit`, or by the reconciliation that makes the send before it
    asked the tool about the key)."""
    started = time.monotonic()
    timeout_s = admitted.tool_version.timeout_s
    task_deadline = admitted.context.deadline
    deadline = min(started + timeout_s + limits.SLOT_GRACE_SECONDS, task_deadline - timeout_s)
    attempts = 0
    while True:
        outcome, tried, _, passage = _run_with_retries(admitted, deadline=task_deadline)
        if passage is not None:
            limits.calls_leave([(passage, False)])
        attempts += tried
        wait = (
            max(random.uniform(*LIMIT_WAIT_SECONDS), outcome.retry_after or 0)
            if isinstance(outcome, ToolFailed) and outcome.turned_away
            else None
        )
        if wait is None or time.monotonic() + wait > deadline:
            return outcome, attempts, int((time.monotonic() - started) * 1000)
        time.sleep(wait)


def side_effect_record(
    run: Run, admitted: Admitted, outcome: ToolOutput | ToolFailed, attempts: int, duration_ms: int
) -> ToolCall:
    """Gate 7 with the run locked again: the envelope, the evidence and the events."""
    step_calls = StepCalls()
    _record(run, admitted, outcome, attempts, duration_ms, step_calls)
    record = admitted.record
    record.save(update_fields=["status", "error_category", "envelope", "attempts", "duration_ms"])
    writes.add(run, step_calls.sources)
    return record


def _sandboxed(admitted: Admitted) -> ToolOutput | None:
    """In an evaluation sandbox, a tool fails as its faults say, and a tool that is not a
    read never reaches its system: it answers what it would have done (dry run)."""
    tenant, tool_version = admitted.context.tenant, admitted.tool_version
    if not tenant.sandbox_of_id:
        return None
    fault = tenant.sandbox_settings.get("faults", {}).get(tool_version.tool.name)
    if fault:
        raise ToolFailed(
            f"{tool_version.qualified_name} failed ({fault}) as the sandbox says.",
            category=fault,
            retryable=fault in TRANSIENT_CATEGORIES,
        )
    if tool_version.risk in READ_RISKS:
        return None
    return ToolOutput(
        business_status=DRY_RUN,
        raw={"dry_run": True, "would_call": tool_version.qualified_name},
        normalized={"arguments": admitted.arguments},
    )


def _attempt(
    admitted: Admitted, entered: limits.Passage | ToolFailed | None
) -> tuple[ToolOutput, limits.Passage | None]:
    """One call of the tool under its limits (entered already, or entered now). Returns the
    output with the limits' passage, still held (its call succeeded); a call that failed
    has left them. An evaluation sandbox's call spends the rate window of the tenant it is a
    sandbox of (`quotas.payer_id`): it reaches that tenant's tools, and a sandbox is made for
    each eval run, which would otherwise bring a fresh allowance of its own."""
    sandboxed = _sandboxed(admitted)
    if sandboxed is not None:
        return sandboxed, None
    if entered is None:
        [entered] = limits.calls_enter(
            [admitted.tool_version], tenant_id=quotas.payer_id(admitted.context.tenant)
        )
    if isinstance(entered, ToolFailed):
        raise entered
    try:
        output = adapters.execute(admitted.tool_version, admitted.context, admitted.arguments)
        if (problem := _output_problem(output)) is not None:
            raise TypeError(problem)
    except ToolFailed as failure:
        limits.calls_leave([(entered, failure.category in TOOL_FAULTS)])
        raise
    except DatabaseError:
        limits.calls_leave([(entered, None)])
        raise
    except Exception as error:
        limits.calls_leave([(entered, True)])
        raise adapters.handler_failure(admitted.tool_version, error) from error
    except BaseException:
        limits.calls_leave([(entered, None)])
        raise
    return output, entered


def _output_problem(output: Any) -> str | None:
    """Why a handler's answer is not a ToolOutput the envelope is made from, if it is not."""
    if not isinstance(output, ToolOutput):
        return f"The handler answered {type(output).__name__}, not a ToolOutput."
    if not isinstance(output.business_status, str):
        return "The handler's business_status is not text."
    if not isinstance(output.normalized, dict):
        return "The handler's normalized result is not a dict."
    if not isinstance(output.sources, list | tuple) or not all(
        isinstance(source, SourceDraft)
        and isinstance(source.reference, str)
        and isinstance(source.content, str)
        for source in output.sources
    ):
        return "The handler's sources are not SourceDrafts of text."
    return None


def tries_deadline() -> float:
    """When (monotonic) the tool calls of a step, an action's send, or a reconciliation's
    question about the key and the send it may make, begun now must have ended, retries and
    their waits included: no try runs past it (`adapters.attempt_seconds`). A run's task
    starts no step later than RUN_TASK_SECONDS into it, so a step has at least the rest of
    the task's soft time limit (an action's send or its reconciliation, which starts as its
    task does, has that at least too). Celery interrupts a task at that limit mid-call: the
    step's work is lost (its calls made again by the task the sweep sends), and a send is
    left executing for reconciliation."""
    return time.monotonic() + settings.CELERY_TASK_SOFT_TIME_LIMIT - settings.RUN_TASK_SECONDS


def _run_with_retries(
    admitted: Admitted,
    entered: limits.Passage | ToolFailed | None = None,
    *,
    deadline: float,
) -> tuple[ToolOutput | ToolFailed, int, int, limits.Passage | None]:
    """Gate 6, from the limits `entered` for the first attempt (if they were, with the
    other calls of its step). Only transient failures of tools safe to repeat are retried,
    with backoff and jitter, within the tool's retry policy, and only while another attempt,
    its wait and its whole timeout, would end by `deadline` (`tries_deadline`): past it,
    the last failure stands, as one another try may pass later. Returns (outcome, attempts,
    duration_ms, the passage of a call that succeeded, for the caller to leave). The
    attempts count the tries that reached the tool: one that never left the host (a limit
    turned it away, the host refused to send it) is not one."""
    tool_version = admitted.tool_version
    policy = tool_version.retry_policy or {}
    max_attempts = policy.get("max_attempts", 1)
    repeatable = tool_version.is_idempotent or tool_version.risk in READ_RISKS
    started = time.monotonic()
    attempt = reached = 0
    while True:
        attempt += 1
        try:
            output, passage = _attempt(admitted, entered if attempt == 1 else None)
        except ToolFailed as failure:
            reached += failure.attempted
            wait = _retry_wait(policy, attempt, failure)
            if (
                not (failure.retryable and repeatable and attempt < max_attempts)
                or wait is None
                or time.monotonic() + wait + tool_version.timeout_s > deadline
            ):
                return failure, reached, int((time.monotonic() - started) * 1000), None
        else:
            return output, reached + 1, int((time.monotonic() - started) * 1000), passage
        time.sleep(wait)


def _retry_wait(policy: dict[str, Any], attempt: int, failure: ToolFailed) -> float | None:
    """Seconds to wait after the `attempt`-th failed: the policy's backoff (exponential, at
    most its max_backoff_s, jittered unless it says not), or longer when the tool asked for
    a longer wait (Retry-After). None when it asked for more than max_backoff_s: a try
    sooner would be turned away again, and the run is not held longer than its policy says."""
    longest = policy.get("max_backoff_s", 2)
    backoff = min(policy.get("backoff_s", 0.2) * 2 ** (attempt - 1), longest)
    if policy.get("jitter", True):
        backoff = random.uniform(0, backoff)
    if failure.retry_after is None:
        return backoff
    if failure.retry_after > longest:
        return None
    return max(backoff, failure.retry_after)


def _execute_admitted(
    run: Run,
    admitted: list[Admitted],
    step_calls: StepCalls,
    *,
    deadline: float,
    made: CallsMade,
) -> None:
    """Gates 6 and 7 for the admitted calls of one step, in rounds of at most
    `TOOL_PARALLELISM` calls run in parallel. A round's calls enter their limits together
    just before they start, so a slot lapses counted from its call's start, and leave them
    together when the round ends (a sandbox's calls enter their own). A call kept out while
    others of its round got in (its own step's calls filling its tool's cap) waits for the
    next round; one that a round lets nothing in with (a rate window, an open circuit, other
    runs' calls) goes to its retry policy, retried until `deadline`. A call whose round would
    start at `deadline` or later is not started (`_not_started`). Results stay paired with
    their call ids; a call that raised gives its error back once every slot is back. A call
    in `made` is not executed: its outcome there is recorded."""
    outcomes: list[Any] = [made.get(call.record.call_id) for call in admitted]
    waiting = [index for index, outcome in enumerate(outcomes) if outcome is None]
    while waiting and time.monotonic() < deadline:
        round_calls = waiting[: settings.TOOL_PARALLELISM]
        entered = _round_enter(run, [admitted[index] for index in round_calls])
        kept_out = [
            index
            for index, passage in zip(round_calls, entered, strict=True)
            if isinstance(passage, ToolFailed)
        ]
        if len(kept_out) == len(round_calls):
            kept_out = []
        started = [
            (index, passage)
            for index, passage in zip(round_calls, entered, strict=True)
            if index not in kept_out
        ]
        finished = threads.parallel_map(
            _attempted,
            [(admitted[index], passage, deadline) for index, passage in started],
            workers=settings.TOOL_PARALLELISM,
        )
        limits.calls_leave(
            [
                (outcome[3], False)
                for outcome in finished
                if not isinstance(outcome, Exception) and outcome[3] is not None
            ]
        )
        for (index, _), outcome in zip(started, finished, strict=True):
            if isinstance(outcome, Exception):
                raise outcome
            outcomes[index] = outcome
            made[admitted[index].record.call_id] = (*outcome[:3], None)
        waiting = kept_out + waiting[len(round_calls) :]
    for index in waiting:
        outcomes[index] = (_not_started(admitted[index].tool_version), 0, 0, None)
    for call, (outcome, attempts, duration_ms, _) in zip(admitted, outcomes, strict=True):
        _record(run, call, outcome, attempts, duration_ms, step_calls)


def _not_started(tool_version: ToolVersion) -> ToolFailed:
    """A call of a step whose time ran out before its turn came: it would run past the point
    where Celery interrupts the step, its work lost. Nothing was done; another try may pass."""
    return ToolFailed(
        f"{tool_version.qualified_name} was not called: its step had no time left for it.",
        category=ErrorCategory.TIMEOUT,
        retryable=True,
        attempted=False,
    )


def _round_enter(run: Run, calls: list[Admitted]) -> list[limits.Passage | ToolFailed | None]:
    if run.tenant.sandbox_of_id:
        return [None] * len(calls)
    return limits.calls_enter([call.tool_version for call in calls], tenant_id=run.tenant_id)


def _attempted(call: tuple[Admitted, limits.Passage | ToolFailed | None, float]) -> Any:
    admitted, entered, deadline = call
    try:
        return _run_with_retries(admitted, entered, deadline=deadline)
    except Exception as error:  # noqa: BLE001 (raised by the caller, once every slot is back)
        return error


def _record(
    run: Run,
    admitted: Admitted,
    outcome: ToolOutput | ToolFailed,
    attempts: int,
    duration_ms: int,
    step_calls: StepCalls,
) -> None:
    """Gate 7: the envelope, secrets stripped and size-limited; evidence kept as Sources.
    Only a call whose business status says it did what it was asked (`business_done`)
    returned evidence: the sources of a business refusal (HTTP 200 with "refused") are not
    kept, as none are for a failed call or an MCP tool's `isError`. What the refusal said
    stays in the envelope, so that no draft cites it and no run rests on it
    (`runs.loop._final`, NO_EVIDENCE)."""
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
        envelope.error = {
            "category": outcome.category,
            "message": strip_secrets(str(outcome), secrets=secrets),
        }
        envelope.retryable = outcome.retryable
        envelope.may_have_side_effect = outcome.may_have_side_effect
        record.status = ToolCall.Status.FAILED
        record.error_category = outcome.category
    else:
        envelope.business_status = strip_secrets(outcome.business_status, secrets=secrets)[:64]
        envelope.raw = strip_secrets(outcome.raw, secrets=secrets)
        envelope.normalized = strip_secrets(outcome.normalized, secrets=secrets)
        succeeded = business_done(envelope.business_status)
        evidence = outcome.sources if succeeded else []
        kept = evidence[: settings.TOOL_RESULT_MAX_SOURCES]
        envelope.truncated = len(kept) < len(evidence)
        drafts = [
            SourceDraft(
                reference=strip_secrets(draft.reference, secrets=secrets),
                content=strip_secrets(draft.content, secrets=secrets),
                allowed_use=draft.allowed_use,
            )
            for draft in kept
        ]
        if succeeded and envelope.size() > settings.TOOL_RESULT_MAX_BYTES:
            # The envelope will be cut: the whole response stays as evidence of its own.
            whole = {"raw": envelope.raw, "normalized": envelope.normalized}
            drafts.append(
                SourceDraft(
                    reference=f"{RESULT_REFERENCE_PREFIX}{record.call_id}",
                    content=json.dumps(whole, ensure_ascii=False, default=str),
                )
            )
        for draft in drafts:
            source = writes.new(
                Source,
                run_id=run.pk,
                tool_call_id=record.pk,
                origin=tool_version.qualified_name,
                reference=source_reference(draft.reference),
                content_hash=hashlib.sha256(draft.content.encode()).hexdigest(),
                allowed_use=draft.allowed_use,
                content=draft.content,
            )
            step_calls.sources.append(source)
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
    tracing.span_add(
        run,
        "tool.call",
        started_at=record.started_at,
        error=record.status != ToolCall.Status.COMPLETED,
        tool=tool_version.qualified_name,
        call_id=record.call_id,
        status=record.status,
        business_status=envelope.business_status,
        error_category=record.error_category,
        attempts=attempts,
        retries=max(attempts - 1, 0),
        gate6_ms=duration_ms,
        risk=tool_version.risk,
    )
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
