"""The only writer of the run event log: one function per event type.

Every function expects the caller to hold the run's row lock (or to have created the run in
the current transaction): numbering is `last_event_seq + 1` under that lock, and the unique
(run, seq) constraint refuses any second writer that slipped past it.
"""

from typing import Any

from runs.choices import EventType, RunStatus
from runs.models import Run, RunEvent


def _append(run: Run, event_type: EventType, payload: dict[str, Any]) -> RunEvent:
    run.last_event_seq += 1
    Run.objects.filter(pk=run.pk).update(last_event_seq=run.last_event_seq)
    return RunEvent.objects.create(
        run=run, seq=run.last_event_seq, type=event_type, payload=payload
    )


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
    return _append(run, EventType.RUN_FINISHED, {"status": str(status), "reason_code": reason_code})
