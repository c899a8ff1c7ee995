"""What a case's run did, as the metrics read it (`evaluations.metrics.Outcome.observed`):
read from the run's own records (events, tool calls, sources, the frozen action), never from
what the model says it did."""

import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

from approvals.choices import ActionStatus, Decision
from approvals.models import BusinessAction
from registry.choices import READ_RISKS
from registry.models import SkillVersion
from runs.models import Run, RunEvent, Source, ToolCall
from runs.transcript import HOST_CALL_PREFIX

EXECUTED_ACTION_STATUSES = frozenset(
    {ActionStatus.EXECUTING, ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.UNKNOWN}
)


def _outcome(call: ToolCall) -> str:
    return {
        ToolCall.Status.COMPLETED: "completed",
        ToolCall.Status.REJECTED: "rejected",
    }.get(call.status, "failed")


def _draft(run: Run) -> dict[str, Any] | None:
    draft = run.state.get("draft")
    if not isinstance(draft, dict):
        return None
    sections = {name: value for name, value in draft.items() if isinstance(value, list)}
    if not sections:
        return None
    return {"sections": sections}


def _recipients(arguments: Any) -> str:
    """The addresses a call's `to` names, comma-separated: a list of them or one. A tool's
    schema is its tenant's, so `to` may be anything else too (a number, objects), which
    names no address."""
    to = arguments.get("to") if isinstance(arguments, dict) else None
    if isinstance(to, str):
        return to
    if isinstance(to, list):
        return ",".join(address for address in to if isinstance(address, str))
    return ""


def _executions(
    run: Run, calls: list[ToolCall], action: BusinessAction | None
) -> list[dict[str, Any]]:
    """Side effects that reached execution: through an approved action, or (a bypass) a call
    of a tool that is not a read that the loop let through."""
    executions = []
    if action is not None and action.status in EXECUTED_ACTION_STATUSES:
        decision = getattr(action, "decision", None)
        executions.append(
            {
                "idempotency_key": action.idempotency_key,
                "approved": bool(decision and decision.decision == Decision.APPROVE),
                "recipient_email": action.payload["recipient_snapshot"]["corporate_email"],
            }
        )
    for call in calls:
        executed = call.status in (ToolCall.Status.COMPLETED, ToolCall.Status.FAILED)
        is_action_call = (
            action is not None and call.call_id == f"{action.kind}:{action.payload_hash}"
        )
        if executed and not is_action_call and call.tool_version.risk not in READ_RISKS:
            executions.append(
                {
                    "idempotency_key": f"{run.pk}:{call.call_id}",
                    "approved": False,
                    "recipient_email": _recipients(call.arguments),
                }
            )
    return executions


def _frozen(action: BusinessAction | None) -> dict[str, Any] | None:
    if action is None:
        return None
    return {
        "recipient_record_id": action.payload["recipient_snapshot"]["record_id"],
        "recipient_email": action.payload["recipient_snapshot"]["corporate_email"],
    }


def _did(run: Run) -> tuple[list[ToolCall], list[dict[str, Any]], BusinessAction | None]:
    """The run's tool calls, the side effects it executed, and the action it froze."""
    calls = list(run.tool_calls.select_related("tool_version").order_by("step", "started_at"))
    action = BusinessAction.objects.filter(run=run).select_related("decision").first()
    return calls, _executions(run, calls, action), action


def observe(run: Run) -> dict[str, Any]:
    """How the case's last run ended, and what the runs of each of its messages (one session)
    did on the way: a tool completed, a side effect executed or frozen (`actions`), or text
    answered (`output_text`) by an earlier message's run is the case's as much as one of its
    last, and so are the steps, the model cost and the time to each pause or end of all its
    runs.
    `action` is the last run's own: the recipient a case expects is the one its last message
    led to."""
    run = Run.objects.get(pk=run.pk)
    calls, executions, actions, outputs = [], [], [], []
    steps, cost, took, action = 0, Decimal(0), timedelta(), None
    for case_run in Run.objects.filter(session_id=run.session_id).order_by("created_at", "pk"):
        did_calls, did_executions, did_action = _did(case_run)
        if case_run.pk == run.pk:
            action = did_action
        calls += did_calls
        executions += did_executions
        if did_action is not None:
            actions.append(_frozen(did_action))
        outputs.append(json.dumps(case_run.result, ensure_ascii=False, sort_keys=True))
        steps += case_run.steps
        cost += case_run.cost
        took += (case_run.finished_at or case_run.updated_at) - case_run.created_at
    route = (
        RunEvent.objects.filter(run=run, type="route.selected").values_list("payload", flat=True)
    ).first() or {}
    skill_entry = (run.capability.get("skills") or [None])[0]
    required_sections: list[str] = []
    if skill_entry is not None:
        version = SkillVersion.objects.filter(pk=skill_entry["id"]).first()
        required_sections = list((version.output_contract if version else {}).get("sections", []))
    return {
        "status": run.status,
        "reason_code": run.reason_code,
        "skill": run.skill.split("@")[0] if run.skill else None,
        "mode": route.get("mode"),
        "steps": steps,
        "model_calls": [
            {"name": call.name, "outcome": _outcome(call), "category": call.error_category}
            for call in calls
            if not call.call_id.startswith(HOST_CALL_PREFIX)
        ],
        "tools_completed": sorted(
            {call.name for call in calls if call.status == ToolCall.Status.COMPLETED}
        ),
        "draft": _draft(run),
        "required_sections": required_sections,
        "sources": list(
            Source.objects.filter(run=run)
            .order_by("fetched_at", "id")
            .values_list("reference", flat=True)
        ),
        "action": _frozen(action),
        "actions": actions,
        "executions": executions,
        "output_text": "\n".join(outputs),
        "cost": float(cost),
        "latency_ms": round(took.total_seconds() * 1000),
    }
