"""Spans of a run's trace: the timed stages an operator reads as a waterfall.

Like events, a step's spans are held in memory and written in one statement with the step
(`runs.writes`); outside a step a span is written at once. Every span carries
the run's trace id, run id and session id; its attributes are redacted before they are kept.
With OTLP export configured (runs.otel), spans also leave once their transaction commits.
"""

import secrets
from datetime import datetime
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from config.queries import PreparedQuery
from runs import otel, writes
from runs.models import Run, Span
from runs.redaction import redact


def root_span_id(run: Run) -> str:
    """The id of the run's root span, known before it is written (when the run ends)."""
    return run.trace_id[:16]


def span_add(
    run: Run,
    name: str,
    *,
    started_at: datetime,
    ended_at: datetime | None = None,
    error: bool = False,
    span_id: str | None = None,
    parent_span_id: str | None = None,
    **attributes: Any,
) -> Span:
    ended_at = ended_at or timezone.now()
    span = writes.new(
        Span,
        run_id=run.pk,
        session_id=run.session_id,
        trace_id=run.trace_id,
        span_id=span_id or secrets.token_hex(8),
        parent_span_id=root_span_id(run) if parent_span_id is None else parent_span_id,
        name=name,
        started_at=started_at,
        ended_at=ended_at,
        duration_ms=max(int((ended_at - started_at).total_seconds() * 1000), 0),
        status=Span.Status.ERROR if error else Span.Status.OK,
        attributes=redact(attributes),
    )
    held = writes.holding(run)
    writes.add(run, [span])
    if not held:
        export_on_commit([span])
    return span


def export_on_commit(rows: list) -> None:
    """Export the spans among rows once their transaction commits (OTLP configured). An
    export that fails (an exporter its OTEL_* settings keep from starting) is logged and
    fails nothing else: not the request or step that committed, nor what else waits on the
    commit (the run's next task)."""
    spans = [row for row in rows if isinstance(row, Span)]
    if spans and settings.OTEL_EXPORTER_OTLP_ENDPOINT:
        transaction.on_commit(lambda: otel.export(spans), robust=True)


_FIRST_SPAN_START = PreparedQuery(
    lambda run_id: (
        Span.objects.filter(run_id=run_id)
        .order_by("started_at")
        .values_list("started_at", flat=True)[:1]
    ),
    run_id=UUID,
)


def _first_start(run: Run) -> datetime:
    """When the run's trace begins: its ingress span starts as the message comes in, before
    the run's row is written (`created_at`)."""
    first = _FIRST_SPAN_START.first(run_id=run.pk)
    return min(run.created_at, first) if first else run.created_at


def run_span(run: Run) -> Span:
    """The root span, when the run reaches its terminal status: from its first span on, so
    that it holds every stage."""
    return span_add(
        run,
        "run",
        started_at=_first_start(run),
        ended_at=run.finished_at,
        error=run.status not in {"COMPLETED", "NEEDS_CLARIFICATION"},
        span_id=root_span_id(run),
        parent_span_id="",
        status=run.status,
        reason_code=run.reason_code,
        skill=run.skill,
        steps=run.steps,
        tool_calls=run.tool_call_count,
        tokens=run.tokens_used,
        cost=str(run.cost),
    )
