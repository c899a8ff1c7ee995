"""Optional export of run spans over OTLP/HTTP, off unless `OTEL_EXPORTER_OTLP_ENDPOINT` is
set (the exporter reads the standard `OTEL_EXPORTER_OTLP_*` variables: headers, timeout, …).

The spans exported are the stored ones, with their ids and times, and their attributes as the
run page shows them to a viewer without clearance: a tracing backend has no viewer to clear,
so what a tool returned under a field its contract marks sensitive, and what the run recalled
of its requester's memory above internal, which a span may quote (a name in a rejected
argument), leave masked; the stored spans keep them for those who may see them. They leave
after the step's transaction commits, batched on a background thread, so a slow collector
never holds a run.
What the batch still holds when the process ends is sent first (`shutdown`): at exit, and,
in a worker's pool process, which ends without running exit hooks, at its shutdown signal.
"""

import atexit
import json
import threading
from typing import Any

from django.conf import settings
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags
from opentelemetry.trace.status import Status

from runs.models import Run, Span
from runs.redaction import redact
from runs.selectors import hidden_fields, hidden_texts

_processor: BatchSpanProcessor | None = None
_lock = threading.Lock()


def processor() -> BatchSpanProcessor | None:
    """The process's batch processor, or None when export is off."""
    global _processor
    if not settings.OTEL_EXPORTER_OTLP_ENDPOINT:
        return None
    with _lock:
        if _processor is None:
            _processor = BatchSpanProcessor(OTLPSpanExporter())
        return _processor


def _value(value: Any) -> str | bool | int | float:
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _nanoseconds(moment) -> int:
    return int(moment.timestamp() * 1_000_000_000)


def readable(
    span: Span,
    *,
    run_id: str,
    sensitive: frozenset[str],
    texts: frozenset[str],
) -> ReadableSpan:
    """The stored span as the SDK exports it, its attributes redacted as for a viewer
    without clearance of its run (`sensitive` and `texts`, from `_uncleared_masks`)."""
    attributes = redact(span.attributes, sensitive=sensitive, texts=texts)
    trace_id = int(span.trace_id, 16)
    context = SpanContext(
        trace_id=trace_id,
        span_id=int(span.span_id, 16),
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    parent = (
        SpanContext(trace_id=trace_id, span_id=int(span.parent_span_id, 16), is_remote=False)
        if span.parent_span_id
        else None
    )
    return ReadableSpan(
        name=span.name,
        context=context,
        parent=parent,
        resource=Resource.create({"service.name": settings.OTEL_SERVICE_NAME}),
        attributes={
            "run.id": run_id,
            "session.id": str(span.session_id),
            **{key: _value(value) for key, value in attributes.items() if value is not None},
        },
        status=Status(StatusCode.ERROR if span.status == Span.Status.ERROR else StatusCode.OK),
        start_time=_nanoseconds(span.started_at),
        end_time=_nanoseconds(span.ended_at),
    )


def shutdown() -> None:
    """Send what is batched and stop exporting (tests; a process going down)."""
    global _processor
    with _lock:
        if _processor is not None:
            _processor.shutdown()
            _processor = None


atexit.register(shutdown)


def _uncleared_masks(run_ids: set) -> dict[Any, tuple[frozenset[str], frozenset[str]]]:
    """By run id: the fields and texts a viewer without clearance does not see
    (`selectors.hidden_fields`, `selectors.hidden_texts`), read once for the spans of a
    commit rather than per span: a step's spans are of one run, and seven reads at most
    find them (the run without its transcript, its tools' contracts, and what its calls and
    sources returned, where a contract hides a field, and those of the earlier runs of its
    session, and what those recalled of their requester's memory, where its history names
    them)."""
    runs = list(
        Run.objects.filter(pk__in=run_ids).only("session_id", "created_at", "capability", "state")
    )
    contracts: dict[str, frozenset[str]] = {}
    fields = {run.pk: hidden_fields(run=run, cleared=False, contracts=contracts) for run in runs}
    texts = hidden_texts(runs=runs, contracts=contracts)
    return {run.pk: (fields[run.pk], texts[run.pk]) for run in runs}


def export(spans: list[Span]) -> None:
    """Hand stored spans to the exporter (call it after the transaction that stored them)."""
    batch = processor()
    if batch is None:
        return
    masks = _uncleared_masks({span.run_id for span in spans})
    for span in spans:
        sensitive, texts = masks[span.run_id]
        batch.on_end(readable(span, run_id=str(span.run_id), sensitive=sensitive, texts=texts))
