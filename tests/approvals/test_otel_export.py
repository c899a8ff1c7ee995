"""Spans leave over OTLP/HTTP only when an endpoint is configured, with the stored ids and
the redaction the run page applies for a viewer without clearance."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from approvals import services
from approvals.choices import Decision
from runs import otel
from runs.choices import RunStatus
from runs.loop import run_execute
from runs.models import Span
from tests.approvals import test_sensitive_fields as sensitive
from tests.approvals.conftest import waiting_run
from tests.celery_worker import (
    alice_client,
    example_post,
    example_seed,
    queue_purge,
    run_status,
    wait_until,
)
from tests.runs import conftest as runs_fixtures
from tests.runs import test_memory as memory
from tests.runs.fake_provider import openai_completion

pytestmark = pytest.mark.django_db(transaction=True)

model_server = runs_fixtures.model_server
demo_names_sensitive = sensitive.demo_names_sensitive


@pytest.fixture(autouse=True)
def _tasks_kept_to_this_session(celery_queue):
    """The runs' tasks, enqueued on commit here, go to this session's queue and are dropped:
    the runs are advanced in process."""
    yield
    queue_purge()


class Received(list):
    """The export requests a collector received, decoded; `url` is where it listens."""

    url = ""


@pytest.fixture
def collector() -> Iterator[Received]:
    """A local OTLP/HTTP receiver."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    received.url = f"http://127.0.0.1:{server.server_port}"
    yield received
    server.shutdown()


def exported(requests: list[ExportTraceServiceRequest]) -> list:
    return [
        span
        for request in requests
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


def test_spans_are_exported_with_their_ids_and_redacted(
    demo, bob, smtp_server, collector, settings, monkeypatch
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    settings.OTEL_EXPORTER_OTLP_ENDPOINT = collector.url
    try:
        run, action = waiting_run(demo)
        services.approval_decide(
            action_id=action.pk,
            approver=bob,
            decision=Decision.APPROVE,
            payload_hash=action.payload_hash,
        )
        services.action_execute(action_id=action.pk)
    finally:
        otel.shutdown()

    spans = exported(collector)
    stored = Span.objects.filter(run=run)
    assert sorted(span.span_id.hex() for span in spans) == sorted(
        stored.values_list("span_id", flat=True)
    )
    assert {span.trace_id.hex() for span in spans} == {run.trace_id}
    root = next(span for span in spans if span.name == "run")
    assert root.parent_span_id == b""
    attributes = {
        attribute.key: attribute.value.string_value
        for span in spans
        for attribute in span.attributes
    }
    assert attributes["run.id"] == str(run.pk)
    assert "li.wei@acme.example" not in str(collector)


def _refused_argument_exported(
    demo, value: str, model_server, collector, settings, monkeypatch
) -> tuple[Span, str]:
    """A run whose model passes `value` into an argument project_search's schema refuses (the
    refusal quotes it in the call's span), its spans exported: the stored span of the call
    and the validation text the collector received for it."""
    sensitive.fake_model(demo, model_server, monkeypatch)
    arguments = {"project_id": [value]}
    model_server.reply(
        openai_completion(tool_calls=(("call_1", "project_search", json.dumps(arguments)),))
    )
    model_server.reply(openai_completion(content="Done."))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    settings.OTEL_EXPORTER_OTLP_ENDPOINT = collector.url
    try:
        run = runs_fixtures.demo_run(demo, project_id="apollo")
        run_execute(run_id=str(run.pk))
    finally:
        otel.shutdown()
    stored = Span.objects.get(run=run, name="tool.call", attributes__call_id="call_1")
    (sent,) = [span for span in exported(collector) if span.span_id.hex() == stored.span_id]
    validation = next(
        attribute.value.string_value
        for attribute in sent.attributes
        if attribute.key == "validation"
    )
    return stored, validation


def test_what_a_tool_returned_under_a_sensitive_field_is_exported_masked(
    demo_names_sensitive, model_server, collector, settings, monkeypatch
):
    # given a model that passes the name the directory returned under a sensitive field
    # into an argument its schema refuses

    # when the run's spans are exported
    stored, validation = _refused_argument_exported(
        demo_names_sensitive, sensitive.NAME, model_server, collector, settings, monkeypatch
    )

    # then the collector, which has no viewer to clear, receives the name masked, as a viewer
    # without clearance reads it; the stored span keeps it for those who may see it
    assert sensitive.NAME in stored.attributes["validation"]
    assert validation == stored.attributes["validation"].replace(sensitive.NAME, "[redacted]")
    assert sensitive.NAME not in str(collector)


def test_a_confidential_item_the_run_recalled_is_exported_masked(
    demo, model_server, collector, settings, monkeypatch
):
    # given alice's confidential item, recalled into her run, whose model passes it into an
    # argument its schema refuses
    memory.memory_skill(demo)
    memory.keep_confidential(demo)

    # when the run's spans are exported
    stored, validation = _refused_argument_exported(
        demo, memory.CODENAME, model_server, collector, settings, monkeypatch
    )

    # then the collector receives the value masked; the stored span keeps it
    assert memory.CODENAME in stored.attributes["validation"]
    assert validation == stored.attributes["validation"].replace(memory.CODENAME, "[redacted]")
    assert memory.CODENAME not in str(collector)


def test_nothing_is_exported_without_an_endpoint(demo, collector, settings):
    settings.OTEL_EXPORTER_OTLP_ENDPOINT = ""

    waiting_run(demo)
    otel.shutdown()

    assert collector == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_worker_process_sends_the_spans_it_holds_when_it_stops(start_worker, collector, pool):
    # given a worker exporting in batches far apart: what it exports waits in its batch
    example_seed()
    worker = start_worker(
        pool=pool,
        environment={
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
        },
    )
    run_id = example_post(alice_client()).json()["run_id"]
    wait_until(
        lambda: run_status(run_id) == RunStatus.WAITING_APPROVAL,
        seconds=30,
        what="the run to wait for approval",
        worker=worker,
    )
    assert collector == []

    # when the worker is stopped (a deployment, a restart)
    worker.stop()

    # then the spans of the steps it ran reach the collector, rather than end with the process
    stored = Span.objects.filter(run_id=run_id).exclude(name__in=["ingress", "capability"])
    assert sorted(span.span_id.hex() for span in exported(collector)) == sorted(
        stored.values_list("span_id", flat=True)
    )


def test_an_exporter_that_cannot_start_fails_no_run(demo, collector, settings, monkeypatch):
    # given export configured with batches larger than the queue (2048 by default): the
    # exporter's processor refuses to start
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096")
    settings.OTEL_EXPORTER_OTLP_ENDPOINT = collector.url

    # when a message comes in and its run goes on
    try:
        run, _action = waiting_run(demo)
    finally:
        otel.shutdown()

    # then the run is as it would be without export, and its spans are kept for its page
    assert run.status == "WAITING_APPROVAL"
    assert Span.objects.filter(run=run, name="ingress").exists()
    assert collector == []
