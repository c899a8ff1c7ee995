"""The only writer of the run event log: one function per event type.

Every function expects the caller to hold the run's row lock (or to have created the run in
the current transaction): numbering is `last_event_seq + 1` under that lock, and the unique
(run, seq) constraint refuses any second writer that slipped past it. The counter advances in
memory and is saved with the run at the end of the step: a path that
forgot to save it would collide on (run, seq) at the next write, loudly, never lose events.
"""

from collections.abc import Sequence
from typing import Any

from runs import writes
from runs.choices import EventType, RunStatus
from runs.models import Run, RunEvent


def _append(run: Run, event_type: EventType, payload: dict[str, Any]) -> RunEvent:
    """Number the event and write it, or hold it for the step's one write (`runs.writes`)."""
    run.last_event_seq += 1
    event = writes.new(
        RunEvent, run_id=run.pk, seq=run.last_event_seq, type=event_type, payload=payload
    )
    writes.add(run, [event])
    return event


def message_received(
    run: Run, *, idempotency_key: str, channel: str, part_count: int, request_hash: str
) -> RunEvent:
    return _append(
        run,
        EventType.MESSAGE_RECEIVED,
        {
            "idempotency_key": idempotency_key,
            "channel": channel,
            "part_count": part_count,
            "request_hash": request_hash,
        },
    )


def message_normalized(run: Run, *, message: dict[str, Any]) -> RunEvent:
    return _append(run, EventType.MESSAGE_NORMALIZED, {"message": message})


def session_loaded(run: Run, *, is_new: bool, state_keys: list[str]) -> RunEvent:
    return _append(
        run,
        EventType.SESSION_LOADED,
        {"session_id": str(run.session_id), "is_new": is_new, "state_keys": state_keys},
    )


def capability_resolved(run: Run, *, capability_hash: str, skills: list[str], tools: list[str]):
    return _append(
        run,
        EventType.CAPABILITY_RESOLVED,
        {"capability_hash": capability_hash, "skills": skills, "tools": tools},
    )


def run_finished(run: Run, *, status: RunStatus | str, reason_code: str) -> RunEvent:
    """A CANCELLED run's event names who asked first for the cancel, `cancelled_by` (their
    username, as an approval's approver is named), or None when the platform stopped it."""
    payload = {"status": str(status), "reason_code": reason_code}
    if status == RunStatus.CANCELLED:
        payload["cancelled_by"] = run.cancelled_by.get_username() if run.cancelled_by else None
    return _append(run, EventType.RUN_FINISHED, payload)


def route_selected(run: Run, *, decision: dict[str, Any]) -> RunEvent:
    """`decision`: workflow, skill, risk, category, mode, model, clarification, pre_approval,
    why (runs.routing)."""
    return _append(run, EventType.ROUTE_SELECTED, decision)


def skill_activated(
    run: Run,
    *,
    skill: str,
    skill_version_id: str,
    rules: list[str],
    overridden: list[str],
    node: str | None = None,
) -> RunEvent:
    """`rules`: the rules in force with it, "layer:id" in precedence order; `overridden`:
    restatements that yielded to a higher layer; `node`: the workflow node that loads the
    skill (explicit workflow assembly)."""
    payload = {
        "skill": skill,
        "skill_version_id": skill_version_id,
        "rules": rules,
        "overridden": overridden,
    }
    return _append(
        run, EventType.SKILL_ACTIVATED, payload if node is None else {**payload, "node": node}
    )


def tools_assembled(
    run: Run, *, node: str, allowlist: list[str], deferred: list[str], withdrawn: list[str]
) -> RunEvent:
    """What the model is offered in `node` (`allowlist`), what the snapshot holds for other
    nodes (`deferred`), and the snapshot's versions revoked or no longer granted since the run
    started, which the model is not offered (`withdrawn`, recorded only when there is one)."""
    payload = {"node": node, "allowlist": allowlist, "deferred": deferred}
    if withdrawn:
        payload["withdrawn"] = withdrawn
    return _append(run, EventType.TOOLS_ASSEMBLED, payload)


def context_built(
    run: Run, *, step: int, sections: dict[str, dict[str, Any]], budget: dict[str, int]
) -> RunEvent:
    return _append(
        run, EventType.CONTEXT_BUILT, {"step": step, "sections": sections, "budget": budget}
    )


def model_requested(run: Run, *, step: int, model: str, offline: bool) -> RunEvent:
    return _append(
        run, EventType.MODEL_REQUESTED, {"step": step, "model": model, "offline": offline}
    )


def model_responded(
    run: Run,
    *,
    step: int,
    text: str,
    tool_calls: list[dict[str, Any]],
    usage: dict[str, int],
    counted: dict[str, Any],
    cost: str,
    stop_reason: str,
    model: str,
) -> RunEvent:
    """`model`: the model the provider says answered, which a gateway or an alias may have
    chosen for the one model.requested names. `usage`: the tokens the provider reported;
    `counted`: those the run's tokens and `cost` count, with the local estimate in place of
    any the provider reported as 0, named in its `estimated` ("input", "output")."""
    return _append(
        run,
        EventType.MODEL_RESPONDED,
        {
            "step": step,
            "model": model,
            "text": text,
            "tool_calls": tool_calls,
            "usage": usage,
            "counted": counted,
            "cost": cost,
            "stop_reason": stop_reason,
        },
    )


def tool_requested(
    run: Run, *, call_id: str, name: str, arguments: dict[str, Any] | str
) -> RunEvent:
    return _append(
        run, EventType.TOOL_REQUESTED, {"call_id": call_id, "name": name, "arguments": arguments}
    )


def tool_rejected(
    run: Run, *, call_id: str, name: str, category: str, reason: str, retryable: bool
) -> RunEvent:
    return _append(
        run,
        EventType.TOOL_REJECTED,
        {
            "call_id": call_id,
            "name": name,
            "category": category,
            "reason": reason,
            "retryable": retryable,
        },
    )


def tool_completed(
    run: Run,
    *,
    call_id: str,
    name: str,
    business_status: str,
    duration_ms: int,
    sources: list[str],
) -> RunEvent:
    return _append(
        run,
        EventType.TOOL_COMPLETED,
        {
            "call_id": call_id,
            "name": name,
            "business_status": business_status,
            "duration_ms": duration_ms,
            "sources": sources,
        },
    )


def tool_failed(
    run: Run,
    *,
    call_id: str,
    name: str,
    category: str,
    retryable: bool,
    may_have_side_effect: bool,
) -> RunEvent:
    return _append(
        run,
        EventType.TOOL_FAILED,
        {
            "call_id": call_id,
            "name": name,
            "category": category,
            "retryable": retryable,
            "may_have_side_effect": may_have_side_effect,
        },
    )


def draft_created(run: Run, *, draft: dict[str, Any]) -> RunEvent:
    return _append(run, EventType.DRAFT_CREATED, {"draft": draft})


def approval_required(
    run: Run, *, action_id: str, draft_hash: str, recipient: dict[str, Any], expires_at: str
) -> RunEvent:
    return _append(
        run,
        EventType.APPROVAL_REQUIRED,
        {
            "action_id": action_id,
            "draft_hash": draft_hash,
            "recipient": recipient,
            "expires_at": expires_at,
        },
    )


def approval_granted(run: Run, *, action_id: str, approver: str, payload_hash: str) -> RunEvent:
    return _append(
        run,
        EventType.APPROVAL_GRANTED,
        {"action_id": action_id, "approver": approver, "payload_hash": payload_hash},
    )


def approval_rejected(
    run: Run, *, action_id: str, approver: str, payload_hash: str, comment: str
) -> RunEvent:
    return _append(
        run,
        EventType.APPROVAL_REJECTED,
        {
            "action_id": action_id,
            "approver": approver,
            "payload_hash": payload_hash,
            "comment": comment,
        },
    )


def approval_invalidated(
    run: Run, *, action_id: str, reasons: list[str], versions: Sequence[str] = ()
) -> RunEvent:
    """`versions`: the skill and tool versions (`name@version`) no longer usable, if that is
    a reason."""
    payload = {"action_id": action_id, "reasons": reasons}
    if versions:
        payload["versions"] = list(versions)
    return _append(run, EventType.APPROVAL_INVALIDATED, payload)


def handoff_requested(run: Run, *, handoff_id: str, risks: list[str]) -> RunEvent:
    return _append(run, EventType.HANDOFF_REQUESTED, {"handoff_id": handoff_id, "risks": risks})


def handoff_resolved(
    run: Run, *, handoff_id: str, outcome: str, resolved_by: str | None, note: str, reason: str
) -> RunEvent:
    """`outcome`: handled or declined by `resolved_by`, or withdrawn (no one: the run ended
    first); `reason`: the reason code the run ends with."""
    return _append(
        run,
        EventType.HANDOFF_RESOLVED,
        {
            "handoff_id": handoff_id,
            "outcome": str(outcome),
            "resolved_by": resolved_by,
            "note": note,
            "reason": reason,
        },
    )


def run_resumed(run: Run, *, action_id: str, checks: list[str]) -> RunEvent:
    return _append(run, EventType.RUN_RESUMED, {"action_id": action_id, "checks": checks})


def action_executing(run: Run, *, action_id: str, idempotency_key: str) -> RunEvent:
    return _append(
        run,
        EventType.ACTION_EXECUTING,
        {"action_id": action_id, "idempotency_key": idempotency_key},
    )


def action_succeeded(run: Run, *, action_id: str, external_id: str) -> RunEvent:
    return _append(
        run, EventType.ACTION_SUCCEEDED, {"action_id": action_id, "external_id": external_id}
    )


def action_failed(run: Run, *, action_id: str, category: str) -> RunEvent:
    return _append(run, EventType.ACTION_FAILED, {"action_id": action_id, "category": category})


def action_unknown(run: Run, *, action_id: str, category: str) -> RunEvent:
    return _append(run, EventType.ACTION_UNKNOWN, {"action_id": action_id, "category": category})


def action_reconciled(run: Run, *, action_id: str, outcome: str, external_id: str) -> RunEvent:
    return _append(
        run,
        EventType.ACTION_RECONCILED,
        {"action_id": action_id, "outcome": outcome, "external_id": external_id},
    )
