"""What auditors read: the run history with filters and keyset pagination, and one run in
full (timeline, capability, model turns, tool calls, sources, actions with their approval
chain, spans, result), redacted for the viewer.

Keyset pagination keeps a deep page as fast as the first: a page is the next `PAGE_SIZE` runs
before a (created_at, id) cursor, on the (tenant, created_at) indexes.
"""

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from uuid import UUID

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from approvals.choices import EXECUTED_STATUSES
from approvals.models import BusinessAction
from config import jsontext
from registry.models import ToolVersion
from runs.capability import pinned_model_label
from runs.context import RECIPIENT_FIELDS
from runs.models import Run, RunEvent, Source, Span, ToolCall
from runs.redaction import REDACTED, redact
from runs.selectors import (
    contract_sensitive_fields,
    hidden_fields,
    memory_hidden,
    recalled_texts,
    recipient_texts,
    runs_of_skill,
    texts_of_earlier_runs,
    texts_under,
)

PAGE_SIZE = 50


@dataclass(frozen=True)
class HistoryFilters:
    tenant: str = ""
    status: str = ""
    skill: str = ""
    user: str = ""
    date_from: date | None = None
    date_to: date | None = None
    has_side_effect: bool = False
    has_rejected_call: bool = False


def encode_cursor(run: Run) -> str:
    raw = f"{run.created_at.isoformat()}|{run.pk}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, UUID] | None:
    """The (created_at, id) a cursor names, or None for a cursor that is not one of ours:
    ours name an aware time that PostgreSQL can hold (in UTC, within Python's years)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created_at, run_id = raw.split("|")
        moment = datetime.fromisoformat(created_at)
        if moment.tzinfo is None:
            return None
        return moment.astimezone(UTC), UUID(run_id)
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError):
        return None


def _day_start(day: date) -> datetime:
    return timezone.make_aware(datetime.combine(day, time.min))


def history(runs: QuerySet[Run], filters: HistoryFilters, *, before: str = "") -> list[Run]:
    """One page (plus one, to tell whether there is a next) of `runs`, newest first."""
    if filters.tenant:
        runs = runs.filter(tenant__slug=filters.tenant)
    if filters.status:
        runs = runs.filter(status=filters.status)
    if filters.skill:
        runs = runs_of_skill(runs, filters.skill)
    if filters.user:
        runs = runs.filter(actor__username=filters.user)
    if filters.date_from:
        runs = runs.filter(created_at__gte=_day_start(filters.date_from))
    if filters.date_to and filters.date_to < date.max:
        runs = runs.filter(created_at__lt=_day_start(filters.date_to + timedelta(days=1)))
    side_effect = BusinessAction.objects.filter(
        run=OuterRef("pk"), status__in=EXECUTED_STATUSES, executed_at__isnull=False
    )
    rejected = ToolCall.objects.filter(run=OuterRef("pk"), status=ToolCall.Status.REJECTED)
    if filters.has_side_effect:
        runs = runs.filter(Exists(side_effect))
    if filters.has_rejected_call:
        runs = runs.filter(Exists(rejected))
    position = decode_cursor(before) if before else None
    if position is not None:
        created_at, run_id = position
        # The first condition bounds the index range; the second breaks ties by id.
        runs = runs.filter(created_at__lte=created_at).filter(
            Q(created_at__lt=created_at) | Q(pk__lt=run_id)
        )
    return list(
        runs.select_related("tenant", "actor")
        .annotate(has_side_effect=Exists(side_effect), has_rejected_call=Exists(rejected))
        .only(
            "id",
            "status",
            "reason_code",
            "skill",
            "channel",
            "created_at",
            "finished_at",
            "steps",
            "tool_call_count",
            "cost",
            "tenant__slug",
            "actor__username",
        )
        .order_by("-created_at", "-pk")[: PAGE_SIZE + 1]
    )


# --- one run ------------------------------------------------------------------------------


def _sensitive_fields(tool_versions: dict[Any, ToolVersion]) -> dict[Any, frozenset[str]]:
    """The fields each version's result contract marks sensitive."""
    return {
        pk: contract_sensitive_fields(version.result_contract)
        for pk, version in tool_versions.items()
    }


def _waterfall(spans: list[Span], run: Run) -> list[dict[str, Any]]:
    """Each span with its offset and width as percentages of the run's span."""
    if not spans:
        return []
    start = min(span.started_at for span in spans)
    end = max(span.ended_at for span in spans)
    total = max((end - start).total_seconds(), 0.001)
    return [
        {
            "name": span.name,
            "span_id": span.span_id,
            "parent_span_id": span.parent_span_id,
            "started_at": span.started_at.isoformat(),
            "duration_ms": span.duration_ms,
            "status": span.status,
            "attributes": span.attributes,
            "offset": round((span.started_at - start).total_seconds() / total * 100, 2),
            "width": max(round(span.duration_ms / 1000 / total * 100, 2), 0.3),
        }
        for span in spans
    ]


SEEN_CHARS = 2000


def _seen(entry: dict[str, Any], *, cleared: bool, texts: frozenset[str]) -> dict[str, Any]:
    """One transcript entry as a turn had it, redacted before it is cut (a cut through an
    email address or a hidden text would leave its first part unmasked)."""
    text = redact(entry.get("text") or entry.get("content") or "", cleared=cleared, texts=texts)
    return {
        "kind": entry.get("kind"),
        "name": entry.get("name", ""),
        "call_id": entry.get("call_id", ""),
        "text": text[:SEEN_CHARS] + ("…" if len(text) > SEEN_CHARS else ""),
    }


def _result_redacted(entry: dict[str, Any], sensitive: frozenset[str]) -> dict[str, Any]:
    """A tool result of the transcript with the envelope inside its untrusted-data wrapper
    redacted with the tool contract's sensitive fields."""
    try:
        wrapped = json.loads(entry["content"])
        envelope = json.loads(wrapped["untrusted_data"]["content"])
    except (KeyError, TypeError, ValueError):
        return entry
    wrapped["untrusted_data"]["content"] = json.dumps(
        redact(envelope, sensitive=sensitive), ensure_ascii=False
    )
    return {**entry, "content": json.dumps(wrapped, ensure_ascii=False)}


def _json_redacted(text: str, sensitive: frozenset[str]) -> str:
    """A source's text, redacted with its tool contract's sensitive fields if it is JSON;
    other text of a tool with sensitive fields may be one of them (a name): not shown, nor
    is JSON nested deeper than a run keeps (`jsontext.loads_bounded`), which the redaction's
    walk would have to go down to the interpreter's recursion limit."""
    try:
        value = jsontext.loads_bounded(text)
    except ValueError:
        return REDACTED
    return json.dumps(redact(value, sensitive=sensitive), ensure_ascii=False)


def _turns(
    events: list[RunEvent],
    transcript: list[dict[str, Any]],
    *,
    cleared: bool,
    texts: frozenset[str],
) -> list[dict[str, Any]]:
    """Per model turn: the context sections' sizes in tokens and whether the builder spelled
    out hidden characters in them (what context.built records of them, besides their hashes:
    what such a section showed the model is not the text the run keeps), the transcript
    entries it had (the builder may have cut old results to their sources within its
    budget), what it answered, and the tokens the provider reported for it and those the run
    counted (`model.responded`). A turn had every entry an earlier turn had: it lists only
    those new to it (`seen`), and counts the others (`seen_before`), so that a run of many
    turns is not its transcript over and over."""
    turns: dict[int, dict[str, Any]] = {}
    for event in events:
        step = event.payload.get("step")
        if event.type == "context.built":
            turns.setdefault(step, {"step": step})["sections"] = {
                name: {
                    "tokens": section.get("tokens"),
                    **(
                        {"hidden_characters_spelled_out": True}
                        if section.get("hidden_characters_spelled_out")
                        else {}
                    ),
                }
                for name, section in event.payload.get("sections", {}).items()
            }
        elif event.type == "model.requested":
            turns.setdefault(step, {"step": step})["model"] = event.payload.get("model")
        elif event.type == "model.responded":
            turn = turns.setdefault(step, {"step": step})
            turn["tool_calls"] = event.payload.get("tool_calls", [])
            turn["usage"] = event.payload.get("usage", {})
            # What the run counted (an event written before it said so: what was reported).
            turn["counted"] = event.payload.get("counted", turn["usage"])
            turn["stop_reason"] = event.payload.get("stop_reason")
            turn["answered_by"] = event.payload.get("model")
    answers = [index for index, entry in enumerate(transcript) if entry.get("kind") == "assistant"]
    ordered = [turns[step] for step in sorted(turns, key=lambda value: value or 0)]
    # Each turn had the entries before its answer: each entry is redacted once for them all.
    seen = [_seen(entry, cleared=cleared, texts=texts) for entry in transcript]
    start = 0
    for number, turn in enumerate(ordered):
        end = answers[number] if number < len(answers) else len(transcript)
        turn["seen"], turn["seen_before"] = seen[start:end], start
        start = end
    return ordered


def _given(run: Run, *, cleared: bool) -> dict[str, Any]:
    """What the turns had with the user's message besides the transcript, from the run's
    state: the recipient's snapshot, what is remembered about the user (without clearance,
    the value of an item above internal replaced whole, however short:
    `selectors.memory_hidden`) and the session's earlier messages (each turn's sections say
    how much of them its budget took)."""
    recipient = run.state.get("recipient")
    return {
        "recipient": {field: recipient.get(field) for field in RECIPIENT_FIELDS}
        if isinstance(recipient, dict)
        else None,
        "memory": [
            {**entry, "value": REDACTED}
            if not cleared and isinstance(entry, dict) and memory_hidden(entry)
            else entry
            for entry in run.state.get("memory") or []
        ],
        "history": run.state.get("history") or [],
    }


def _actions(run: Run, events: list[RunEvent]) -> list[dict[str, Any]]:
    resumed = {
        event.payload.get("action_id"): event.payload.get("checks", [])
        for event in events
        if event.type == "run.resumed"
    }
    found = []
    actions = BusinessAction.objects.filter(run=run).select_related("decision__approver")
    for action in actions.order_by("created_at"):
        decision = getattr(action, "decision", None)
        found.append(
            {
                "id": str(action.pk),
                "kind": action.kind,
                "status": action.status,
                "status_reason": action.status_reason,
                "payload_hash": action.payload_hash,
                "idempotency_key": action.idempotency_key,
                "payload": action.payload,
                "created_at": action.created_at.isoformat(),
                "expires_at": action.expires_at.isoformat() if action.expires_at else None,
                "executed_at": action.executed_at.isoformat() if action.executed_at else None,
                "external_id": action.external_id,
                "decision": {
                    "decision": decision.decision,
                    "approver": decision.approver.get_username(),
                    "payload_hash": decision.payload_hash,
                    "hash_matches": decision.payload_hash == action.payload_hash,
                    "comment": decision.comment,
                    "decided_at": decision.created_at.isoformat(),
                }
                if decision
                else None,
                "revalidated": resumed.get(str(action.pk), []),
            }
        )
    return found


# The parts of a run's record that may hold what the host or the model copied from a tool's
# answer.
_COPIES_OF_ANSWERS = frozenset({"events", "actions", "result", "turns", "tool_calls", "given"})


def run_record(run: Run, *, cleared: bool) -> dict[str, Any]:
    """Everything an auditor reads about one run, redacted for the viewer; the page renders
    it and the export is it, as JSON. Tool calls are redacted first with their contracts'
    sensitive fields; redacting again changes nothing already masked."""
    events = list(RunEvent.objects.filter(run=run).order_by("seq"))
    calls = list(ToolCall.objects.filter(run=run).order_by("step", "started_at"))
    # The versions the run called, and those its snapshot allows, whose contracts hide
    # fields (`selectors.hidden_fields`), in one read.
    allowed = {entry["id"] for entry in run.capability.get("tools", []) if "id" in entry}
    versions = {
        version.pk: version
        for version in ToolVersion.objects.filter(
            pk__in={call.tool_version_id for call in calls if call.tool_version_id} | allowed
        ).select_related("tool")
    }
    sensitive = _sensitive_fields(versions)
    # What a viewer without clearance may not see of each call's results (by call id, and
    # by the call's row for its sources).
    hidden_in: dict[Any, frozenset[str]] = {}
    for call in calls if not cleared else ():
        fields = sensitive.get(call.tool_version_id, frozenset())
        if fields:
            hidden_in[call.call_id] = hidden_in[call.pk] = fields
    sources = list(Source.objects.filter(run=run).order_by("fetched_at", "id"))
    # What those results hold under the hidden fields, masked inside any text of the record
    # (`selectors.hidden_texts`, from the rows read here).
    texts = frozenset().union(
        *(texts_under(call.envelope, hidden_in[call.pk]) for call in calls if call.pk in hidden_in),
        *(
            texts_under(source.content, hidden_in[source.tool_call_id])
            for source in sources
            if source.tool_call_id in hidden_in
        ),
    )
    # What the host copied from a tool's answer (a recipient into the result, the action,
    # the events, a model's later call) is hidden as the answer is.
    hidden = hidden_fields(
        run=run, cleared=cleared, contracts={str(pk): fields for pk, fields in sensitive.items()}
    )
    texts |= recipient_texts(run=run, fields=hidden)
    # What it recalled of its requester's memory above internal, and what the earlier runs
    # of its session returned or recalled so, which its history quotes: its model may copy
    # them.
    if not cleared:
        texts |= recalled_texts(run.state.get("memory"), run.state.get("memory_masked"))
        texts |= texts_of_earlier_runs(runs=[run])[run.pk]
    spans = list(Span.objects.filter(run=run).order_by("started_at"))
    record = {
        "run": {
            "id": str(run.pk),
            "tenant": run.tenant.slug,
            "actor": run.actor.get_username(),
            "session_id": str(run.session_id),
            "trace_id": run.trace_id,
            "channel": run.channel,
            "skill": run.skill,
            "status": run.status,
            "reason_code": run.reason_code,
            "created_at": run.created_at.isoformat(),
            "started_at": run.started_at.isoformat() if run.started_at else None,
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
            "steps": run.steps,
            "tool_calls": run.tool_call_count,
            "tokens": run.tokens_used,
            "cost": str(run.cost),
            "capability_hash": run.capability_hash,
            "model": pinned_model_label(run.capability),
        },
        "message": run.message,
        "capability": run.capability,
        "events": [
            {
                "seq": event.seq,
                "type": event.type,
                "at": event.created_at.isoformat(),
                "payload": event.payload,
            }
            for event in events
        ],
        "turns": _turns(
            events,
            run.transcript
            if cleared
            else [
                _result_redacted(entry, hidden_in[entry["call_id"]])
                if entry.get("call_id") in hidden_in
                else entry
                for entry in run.transcript
            ],
            cleared=cleared,
            texts=texts,
        ),
        "given": _given(run, cleared=cleared),
        "tool_calls": [
            {
                "call_id": call.call_id,
                "name": call.name,
                "tool_version": versions[call.tool_version_id].qualified_name
                if call.tool_version_id in versions
                else None,
                "step": call.step,
                "status": call.status,
                "error_category": call.error_category,
                "attempts": call.attempts,
                "duration_ms": call.duration_ms,
                "arguments": redact(
                    call.arguments,
                    cleared=cleared,
                    sensitive=sensitive.get(call.tool_version_id, frozenset()),
                ),
                "envelope": redact(
                    call.envelope,
                    cleared=cleared,
                    sensitive=sensitive.get(call.tool_version_id, frozenset()),
                ),
            }
            for call in calls
        ],
        "sources": [
            {
                "reference": source.reference,
                "origin": source.origin,
                "content_hash": source.content_hash,
                "allowed_use": source.allowed_use,
                "fetched_at": source.fetched_at.isoformat(),
                "content": _json_redacted(source.content, hidden_in[source.tool_call_id])
                if source.tool_call_id in hidden_in
                else source.content,
            }
            for source in sources
        ],
        "actions": _actions(run, events),
        "spans": _waterfall(spans, run),
        "result": run.result,
    }
    # What the answers held under those fields is masked in any text (a name the model wrote
    # into a draft); each part is redacted once.
    return {
        part: redact(
            value,
            cleared=cleared,
            sensitive=hidden if part in _COPIES_OF_ANSWERS else frozenset(),
            texts=texts,
        )
        for part, value in record.items()
    }


def run_export(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, indent=2, sort_keys=True, default=str)
