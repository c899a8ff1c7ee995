"""The HTTP adapter against a local service over real HTTP: which answers are a tool's result
and which are a failed call, with the error category, retryable and may_have_side_effect of
the envelope (DESIGN.md, gate 7)."""

import base64
import gzip
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from approvals import services
from approvals.choices import ActionStatus, Decision
from registry.choices import AdapterKind, ModelProvider, Risk
from registry.demo import DEMO_PASSWORD
from registry.models import AgentConfig, Tenant, ToolVersion
from registry.selectors import versions_frozen
from registry.services.common import registry_object_save
from registry.services.tools import TOOL_CONTENT_FIELDS
from runs.loop import run_execute
from runs.models import Run, Source, Span, ToolCall
from runs.models.tools import source_reference
from runs.tools import limits
from runs.tools.adapters import ToolContext, ToolFailed, ToolOutput, http_call
from runs.tools.envelope import ErrorCategory, business_done
from runs.tools.executor import LIMIT_WAIT_SECONDS
from tests.approvals.conftest import waiting_run
from tests.approvals.test_sensitive_fields import revealed
from tests.loopback import loopback_server
from tests.runs.conftest import (
    apollo_draft,
    demo_run,
    event_types,
    events_of,
    read_apollo,
    this_week,
)
from tests.runs.fake_provider import anthropic_message, openai_completion
from tests.runs.test_loop import http_reader_add, publish_skill, publish_tool, seeded_tool

SSO_LOGIN = "/sso/login"


@dataclass
class ReportService:
    """A local service behind an HTTP tool: answers every POST with the canned status,
    headers and body, and records every request it receives (path and body)."""

    url: str = ""
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    body: bytes = b'{"business_status": "ok", "data": {"health": "green"}}'
    requests: list[dict[str, Any]] = field(default_factory=list)
    # Seconds between two bytes of the body; none: the body at once.
    drip: float | None = None

    def redirect_to_login(self, status: int = 302) -> None:
        """A gateway in front of the service that sends an unauthenticated call to its SSO
        login page, with a state token in the query, on this same server."""
        self.status = status
        self.headers = {"Location": f"{self.url.rsplit('/', 1)[0]}{SSO_LOGIN}?state=st-8d41c2"}
        self.body = b""


@pytest.fixture
def report_service() -> Iterator[ReportService]:
    service = ReportService()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            service.requests.append(
                {"method": self.command, "path": self.path, "body": json.loads(raw or b"null")}
            )
            self.send_response(service.status)
            for name, value in service.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(service.body)))
            self.end_headers()
            if service.drip is None:
                self.wfile.write(service.body)
                return
            try:
                for byte in service.body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(service.drip)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the host stopped reading

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with loopback_server(Handler) as port:
        service.url = f"http://127.0.0.1:{port}/report"
        yield service


def report_tool(url: str, *, timeout_s: int = 5) -> ToolVersion:
    """An HTTP read tool as a publisher configures it (not saved: the adapter reads only its
    configuration)."""
    return ToolVersion(
        adapter_kind=AdapterKind.HTTP,
        adapter_config={"url": url},
        risk=Risk.READ,
        timeout_s=timeout_s,
    )


def call_context() -> ToolContext:
    return ToolContext(
        run_id="run-1",
        call_id="call-1",
        tenant=Tenant(slug="acme"),
        actor=get_user_model()(username="alice"),
        idempotency_key="run-1:call-1",
    )


def test_a_redirect_answer_is_a_failed_call_not_a_successful_one(demo, report_service):
    # given an HTTP read tool behind a gateway that redirects its call to an SSO login page
    report_service.redirect_to_login()
    http_reader_add(demo, report_service.url, tool="report_read", agent="report-reader")
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the call failed as an upstream error that another identical try would not fix, and
    # that did nothing (the service never ran it)
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.error_category, record.attempts) == (
        "failed",
        "UPSTREAM_ERROR",
        1,
    )
    envelope = record.envelope
    assert (envelope["protocol_status"], envelope["business_status"]) == ("error", "failed")
    assert (envelope["retryable"], envelope["may_have_side_effect"]) == (False, False)
    assert envelope["error"] == {
        "category": "UPSTREAM_ERROR",
        "message": "The service answered 302 (a redirect, not followed) instead of a result.",
    }
    # the envelope names where the gateway pointed, without the login URL's state token
    assert envelope["raw"] == {
        "location": f"{report_service.url.rsplit('/', 1)[0]}{SSO_LOGIN}",
        "body": {"text": ""},
    }
    assert events_of(run, "tool.failed") == [
        {
            "call_id": record.call_id,
            "name": "report_read@1.0.0",
            "category": "UPSTREAM_ERROR",
            "retryable": False,
            "may_have_side_effect": False,
        }
    ]
    assert "tool.completed" not in event_types(run)
    # nothing from the login page became evidence, and the redirect was not followed
    assert not Source.objects.filter(run=run).exists()
    assert [(request["method"], request["path"]) for request in report_service.requests] == [
        ("POST", "/report")
    ]
    # and the model was given the failure as an error result, with nothing to cite
    run = Run.objects.get(pk=run.pk)
    results = [entry for entry in run.transcript if entry["kind"] == "tool_result"]
    assert [(entry["call_id"], entry["is_error"]) for entry in results] == [(record.call_id, True)]
    assert run.result["sources"] == []
    # so the agent's answer rests on no result: the run does not claim it completed, nor
    # that a retry may help (the envelope says another identical try would not)
    assert (run.status, run.reason_code) == ("PARTIAL", "NO_TOOL_RESULT")
    assert run.result["output"]["failed_tools"] == ["report_read"]
    assert run.result["output"]["answer"]


REFUSAL = {"business_status": "refused", "data": {"reason": "Apollo's report is sealed."}}


def test_an_answer_resting_on_a_business_refusal_is_not_a_grounded_completion(demo, report_service):
    # given a service that answers 200, refusing the business request in its payload
    report_service.body = json.dumps(REFUSAL).encode()

    # when the generic agent reads the report, then answers
    run = report_read(demo, report_service)

    # then the call completed at the protocol level with the service's refusal kept
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.status == "completed"
    assert (record.envelope["protocol_status"], record.envelope["business_status"]) == (
        "ok",
        "refused",
    )
    assert record.envelope["raw"] == REFUSAL["data"]
    # and the model was given it as an error result
    results = [entry for entry in run.transcript if entry["kind"] == "tool_result"]
    assert [(entry["call_id"], entry["is_error"]) for entry in results] == [(record.call_id, True)]
    # so the answer rests on no result: kept, but not the run's completion (a refusal does
    # not pass by trying again)
    assert (run.status, run.reason_code) == ("PARTIAL", "NO_TOOL_RESULT")
    assert run.result["output"]["failed_tools"] == ["report_read"]
    assert run.result["output"]["unknown_tool_calls"] == 0
    assert run.result["output"]["answer"]


@pytest.mark.parametrize(
    "provider", [ModelProvider.ANTHROPIC, ModelProvider.OPENAI_COMPATIBLE], ids=str
)
def test_the_model_is_told_a_business_refusal_is_an_error(
    demo, report_service, fake_model, provider
):
    # given the generic agent on a provider's model that reads the report, then answers,
    # and a service that refuses the request in a 200 answer
    report_service.body = json.dumps(REFUSAL).encode()
    fake = fake_model(provider)
    http_reader_add(demo, report_service.url, tool="report_read", agent="report-reader")
    agent = AgentConfig.objects.get(tenant=demo.acme, name="report-reader")
    agent.model_config = demo.agent.model_config
    registry_object_save(instance=agent, actor=demo.admin, reason="fake model")
    arguments = {"project_id": "apollo"}
    if provider == ModelProvider.ANTHROPIC:
        fake.reply(anthropic_message(tool_uses=(("toolu_1", "report_read", arguments),)))
        fake.reply(anthropic_message(text="Apollo's report is sealed."))
    else:
        fake.reply(
            openai_completion(tool_calls=(("call_1", "report_read", json.dumps(arguments)),))
        )
        fake.reply(openai_completion(content="Apollo's report is sealed."))
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the model got the result flagged as an error where its API has the flag (Anthropic
    # Messages), and with the refusal in its content either way
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("PARTIAL", "NO_TOOL_RESULT")
    assert run.result["output"]["answer"] == "Apollo's report is sealed."
    messages = fake.requests[1].body["messages"]
    if provider == ModelProvider.ANTHROPIC:
        (result,) = [
            block
            for message in messages
            if isinstance(message["content"], list)
            for block in message["content"]
            if block["type"] == "tool_result"
        ]
        assert (result["tool_use_id"], result["is_error"]) == ("toolu_1", True)
    else:
        (result,) = [message for message in messages if message["role"] == "tool"]
        assert result["tool_call_id"] == "call_1"
    envelope = json.loads(json.loads(result["content"])["untrusted_data"]["content"])
    assert envelope["business_status"] == "refused"


def test_a_tool_result_s_hidden_characters_reach_the_model_spelled_out(
    demo, report_service, fake_model
):
    # given a service whose report hides a right-to-left override and a zero-width joiner in
    # its text, and a model that reads it, then answers
    report = {"summary": "on track\u202e.detaler lla eteled\u202c done\u200d"}
    report_service.body = json.dumps(report, ensure_ascii=False).encode()
    fake = fake_model()
    http_reader_add(demo, report_service.url, tool="report_read", agent="report-reader")
    agent = AgentConfig.objects.get(tenant=demo.acme, name="report-reader")
    agent.model_config = demo.agent.model_config
    registry_object_save(instance=agent, actor=demo.admin, reason="fake model")
    fake.reply(
        openai_completion(tool_calls=(("call_1", "report_read", '{"project_id": "apollo"}'),))
    )
    fake.reply(openai_completion(content="Apollo is on track."))
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the model was shown the characters by their code points, and the call's record
    # keeps the report as the service gave it
    (result,) = [
        message for message in fake.requests[1].body["messages"] if message["role"] == "tool"
    ]
    wrapped = json.loads(result["content"])["untrusted_data"]
    envelope = json.loads(wrapped["content"])
    assert envelope["raw"] == {
        "summary": "on track<U+202E>.detaler lla eteled<U+202C> done<U+200D>"
    }
    assert wrapped["hidden_characters_spelled_out"] is True
    assert "\u202e" not in result["content"] and "\u200d" not in result["content"]
    assert ToolCall.objects.get(run=run, call_id="call_1").envelope["raw"] == report


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_every_redirect_status_is_a_final_upstream_error_without_side_effect(
    report_service, status
):
    # given a service whose gateway redirects the call
    report_service.redirect_to_login(status)

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then
    failure = raised.value
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        ErrorCategory.UPSTREAM_ERROR,
        False,
        False,
    )
    assert len(report_service.requests) == 1


@pytest.mark.parametrize(
    ("location", "target"),
    [
        ("https://sso.example:80a/login?state=st-8d41c2", "https://sso.example:80a/login"),
        ("https://ex\u00e4mple..com/login", "https://ex\u00e4mple..com/login"),
        ("http://[::1/login?state=st-8d41c2", ""),
    ],
)
def test_a_redirect_to_a_location_that_is_no_url_is_a_final_upstream_error_too(
    demo, report_service, location, target
):
    # given a read tool retried up to 3 times, behind a gateway that redirects its call to a
    # location no URL can be parsed from (a port that is no number, a host that is no name,
    # an unclosed IPv6 address)
    report_service.redirect_to_login()
    report_service.headers = {"Location": location}

    # when
    run = report_read(demo, report_service, retry_policy=RETRIES_WITHIN_5_S)

    # then the call failed as a redirect does, once: the service did not run it, and another
    # identical try would be redirected again
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.error_category, record.attempts) == (
        "failed",
        "UPSTREAM_ERROR",
        1,
    )
    assert len(report_service.requests) == 1
    envelope = record.envelope
    assert (envelope["retryable"], envelope["may_have_side_effect"]) == (False, False)
    assert envelope["error"]["message"] == (
        "The service answered 302 (a redirect, not followed) instead of a result."
    )
    # and the envelope names where it pointed, when that can be told without its query
    assert envelope["raw"] == {"location": target, "body": {"text": ""}}


@pytest.mark.parametrize(
    ("status", "category", "is_retryable", "may_have_side_effect"),
    [
        (400, ErrorCategory.INVALID_ARGUMENT, False, False),
        (403, ErrorCategory.PERMISSION_DENIED, False, False),
        (404, ErrorCategory.NOT_FOUND, False, False),
        (408, ErrorCategory.TIMEOUT, True, False),
        (429, ErrorCategory.RATE_LIMITED, True, False),
        (503, ErrorCategory.UPSTREAM_ERROR, True, True),
    ],
)
def test_an_error_status_is_a_failed_call_keeping_the_service_s_answer(
    report_service, status, category, is_retryable, may_have_side_effect
):
    # given a service that answers an error with its reason in JSON
    report_service.status = status
    report_service.body = b'{"error": "no such project"}'

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then
    failure = raised.value
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        category,
        is_retryable,
        may_have_side_effect,
    )
    assert str(failure) == f"The service answered {status}."
    assert failure.raw == {"error": "no such project"}


PROXY_PAGE = b"<html><body><h1>200 OK</h1><p>Request accepted.</p></body></html>"


@pytest.mark.parametrize(
    ("content_type", "body", "kind"),
    [
        ("text/html", PROXY_PAGE, "text/html"),
        ("text/plain", b"apollo: green", "text/plain"),
        ("application/json", b"", "application/json"),
        (None, b"", "no content type"),
    ],
)
@pytest.mark.parametrize(
    ("risk", "may_have_side_effect"), [(Risk.READ, False), (Risk.EXTERNAL_SIDE_EFFECT, True)]
)
def test_a_2xx_answer_that_is_not_json_is_a_failed_call_not_a_result(
    report_service, content_type, body, kind, risk, may_have_side_effect
):
    # given a service whose 200 is not the JSON of the contract: a proxy's page, plain text,
    # or nothing at all
    report_service.headers = {"Content-Type": content_type} if content_type else {}
    report_service.body = body
    tool = report_tool(report_service.url)
    tool.risk = risk

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(tool, call_context(), {"project_id": "apollo"})

    # then nobody knows what the service did: no business status says it was done, so the
    # call failed, an upstream error a later try may pass, and a write may have had its
    # effect; what the service sent is kept as text
    failure = raised.value
    assert str(failure) == (
        f"The service answered 200 without JSON the host can read ({kind}, {len(body)} bytes)."
    )
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        ErrorCategory.UPSTREAM_ERROR,
        True,
        may_have_side_effect,
    )
    assert failure.raw == {"text": body.decode()}


def test_an_approved_send_a_proxy_answers_200_with_its_page_is_not_taken_for_sent(
    demo, report_service, monkeypatch
):
    # given the running example's approved send, made through an HTTP mail service behind a
    # proxy that answers the call 200 with a page of its own
    run, action, _ = approved_http_send(demo, report_service, monkeypatch)
    report_service.headers = {"Content-Type": "text/html"}
    report_service.body = PROXY_PAGE

    # when the approved send is made
    services.action_execute(action_id=action.pk)

    # then the call reached the service once, and the action is not recorded as done: its
    # outcome is unknown, for reconciliation or a person, and the run does not say it sent
    assert len(report_service.requests) == 1
    action.refresh_from_db()
    run = Run.objects.get(pk=run.pk)
    assert action.status == ActionStatus.UNKNOWN
    assert (run.status, run.result["next_step"]) == ("RUNNING", services.SETTLING)
    assert event_types(run)[-2:] == ["tool.failed", "action.unknown"]
    envelope = ToolCall.objects.get(run=run, name="mail_send").envelope
    assert (envelope["business_status"], envelope["may_have_side_effect"]) == ("unknown", True)
    assert envelope["raw"] == {"text": PROXY_PAGE.decode()}


NOT_AN_OBJECT = [(b"null", None), (b"[]", []), (b'"refused"', "refused"), (b"42", 42)]


@pytest.mark.parametrize(("body", "value"), NOT_AN_OBJECT)
@pytest.mark.parametrize(
    ("risk", "may_have_side_effect"), [(Risk.READ, False), (Risk.EXTERNAL_SIDE_EFFECT, True)]
)
def test_a_2xx_answer_whose_json_is_not_an_object_is_a_failed_call_not_a_result(
    report_service, body, value, risk, may_have_side_effect
):
    # given a service whose 200 is JSON, but not the object of the contract that states the
    # business outcome
    report_service.body = body
    tool = report_tool(report_service.url)
    tool.risk = risk

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(tool, call_context(), {"project_id": "apollo"})

    # then, as for an answer that is not JSON, nobody knows what the service did: the call
    # failed, an upstream error a later try may pass, and a write may have had its effect;
    # what the service sent is kept
    failure = raised.value
    assert str(failure) == (
        f"The service answered 200 with JSON that is not an object ({len(body)} bytes)."
    )
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        ErrorCategory.UPSTREAM_ERROR,
        True,
        may_have_side_effect,
    )
    assert failure.raw == value


@pytest.mark.parametrize(("body", "value"), NOT_AN_OBJECT)
def test_an_approved_send_answered_200_with_json_that_is_not_an_object_is_not_taken_for_sent(
    demo, report_service, monkeypatch, body, value
):
    # given the running example's approved send, made through an HTTP mail service that
    # answers the call 200 with JSON that is no object
    run, action, _ = approved_http_send(demo, report_service, monkeypatch)
    report_service.body = body

    # when the approved send is made
    services.action_execute(action_id=action.pk)

    # then the call reached the service once, and the action is not recorded as done: its
    # outcome is unknown, for reconciliation or a person, and the run does not say it sent
    assert len(report_service.requests) == 1
    action.refresh_from_db()
    run = Run.objects.get(pk=run.pk)
    assert action.status == ActionStatus.UNKNOWN
    assert (run.status, run.result["next_step"]) == ("RUNNING", services.SETTLING)
    assert event_types(run)[-2:] == ["tool.failed", "action.unknown"]
    envelope = ToolCall.objects.get(run=run, name="mail_send").envelope
    assert (envelope["business_status"], envelope["may_have_side_effect"]) == ("unknown", True)
    assert envelope["raw"] == value


@pytest.mark.parametrize("charset", ["rot13", "base64", "zlib", "undefined"])
def test_a_text_answer_in_a_charset_of_no_text_is_read_as_utf_8(report_service, charset):
    # given a service whose plain-text answer names a codec Python has, but that decodes no
    # text, as its charset
    report_service.headers = {"Content-Type": f"text/plain; charset={charset}"}
    report_service.body = b"apollo: green"

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then its text is kept as any text answer's is
    assert raised.value.raw == {"text": "apollo: green"}


@pytest.mark.parametrize(
    ("charset", "reason"),
    [
        ("iso-8859-1", "Adresse refusée"),
        ("windows-1252", "Empfänger gesperrt"),
        ("shift_jis", "宛先拒否"),
    ],
)
def test_a_json_answer_in_the_charset_it_declares_keeps_its_business_status(
    demo, report_service, charset, reason
):
    # given a service that refuses in JSON encoded in the charset its answer declares, not
    # UTF-8, and names a source
    report_service.headers = {"Content-Type": f"application/json; charset={charset}"}
    report_service.body = json.dumps(
        {
            "business_status": "refused",
            "data": {"reason": reason},
            "sources": [{"reference": "report:apollo", "content": reason}],
        },
        ensure_ascii=False,
    ).encode(charset)

    # when
    run = report_read(demo, report_service)

    # then the refusal is the call's business status, with the service's words, and no evidence
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.envelope["business_status"], record.envelope["raw"]) == (
        "refused",
        {"reason": reason},
    )
    assert not Source.objects.filter(tool_call=record).exists()


def test_a_json_answer_that_declares_a_charset_but_is_utf_8_is_read_as_utf_8(report_service):
    report_service.headers = {"Content-Type": "application/json; charset=iso-8859-1"}
    report_service.body = '{"data": {"owner": "Zoë"}}'.encode()

    output = http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    assert output == ToolOutput(business_status="ok", raw={"owner": "Zoë"})


@pytest.mark.parametrize(
    ("status", "recorded"),
    [(None, "null"), ({"code": "held"}, '{"code":"held"}'), (7, "7"), (False, "false")],
)
def test_a_business_status_that_is_no_text_is_kept_as_its_json_and_is_not_success(
    report_service, status, recorded
):
    """Before, it was kept in Python's spelling ("None", "{'code': 'held'}", "False")."""
    report_service.body = json.dumps({"business_status": status, "data": {}}).encode()

    output = http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    assert output.business_status == recorded
    assert not business_done(output.business_status)


@pytest.mark.parametrize("sources", [5, 1.5, True, "report:apollo", {"reference": "r"}])
def test_sources_that_are_not_a_list_are_none_and_the_answer_is_the_result(report_service, sources):
    # given a service whose 200 gives its sources as something other than a list
    report_service.body = json.dumps({"data": {"health": "green"}, "sources": sources}).encode()

    # when
    output = http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then the call succeeded with its data, and without sources
    assert output == ToolOutput(business_status="ok", raw={"health": "green"}, sources=[])


def test_an_answer_nested_too_deep_to_parse_is_a_failed_call_kept_as_text(report_service):
    report_service.body = b"[" * 5000 + b"]" * 5000

    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    assert raised.value.category == ErrorCategory.UPSTREAM_ERROR
    assert raised.value.raw == {"text": ("[" * 5000)[:4000]}


class BreakingOff(BaseHTTPRequestHandler):
    """Reads the call, starts a 200 answer of 100 bytes and hangs up after 5."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        self.wfile.write(b'{"ok"')

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("risk", "may_have_side_effect"), [(Risk.EXTERNAL_SIDE_EFFECT, True), (Risk.READ, False)]
)
def test_an_answer_that_breaks_off_after_the_call_went_out_may_have_had_its_effect(
    risk, may_have_side_effect
):
    # given a service that received the call and hung up in the middle of its answer
    with loopback_server(BreakingOff) as port:
        tool = report_tool(f"http://127.0.0.1:{port}/")
        tool.risk = risk

        # when
        with pytest.raises(ToolFailed) as raised:
            http_call(tool, call_context(), {"project_id": "apollo"})

    # then a tool that changes something may have done so: reconciliation finds out
    failure = raised.value
    assert str(failure) == "The service's answer broke off."
    assert (failure.category, failure.may_have_side_effect) == (
        ErrorCategory.UPSTREAM_ERROR,
        may_have_side_effect,
    )


def test_a_service_that_cannot_be_reached_had_no_effect():
    # given a write tool whose service is not listening
    with loopback_server(BreakingOff) as port:
        url = f"http://127.0.0.1:{port}/"
    tool = report_tool(url)
    tool.risk = Risk.EXTERNAL_SIDE_EFFECT

    with pytest.raises(ToolFailed) as raised:
        http_call(tool, call_context(), {"project_id": "apollo"})

    assert str(raised.value) == "The service could not be reached."
    assert raised.value.may_have_side_effect is False
    # nor is it a try of the tool: an approved send that ends so was never executed
    assert raised.value.attempted is False


@pytest.mark.parametrize(
    "credential", ["svc-77d0c1e9a4b25f68\n", "svc-77d0c1e9a4b25f68 ", "svc-77d0c1é9a4b25f68"]
)
def test_a_credential_no_header_can_carry_fails_the_call_before_anything_is_sent(
    report_service, credential
):
    # given a write tool whose credential variable was set with a trailing line break or
    # space, or with a character outside ASCII
    tool = report_tool(report_service.url)
    tool.risk = Risk.EXTERNAL_SIDE_EFFECT
    tool.adapter_config["credential_ref"] = "REPORT_SERVICE_TOKEN"
    context = replace(call_context(), credential=credential)

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(tool, context, {"project_id": "apollo"})

    # then nothing was sent, nothing may have happened, another try would fail the same, and
    # the operator is told which variable to fix, not its value
    failure = raised.value
    assert report_service.requests == []
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        ErrorCategory.PERMISSION_DENIED,
        False,
        False,
    )
    assert str(failure) == (
        "The credential REPORT_SERVICE_TOKEN is no valid HTTP header value (a line break, a "
        "space at either end, or a character outside printable ASCII); nothing was sent."
    )


def test_a_compressed_answer_nobody_asked_for_fails_the_call_before_it_is_inflated(
    report_service,
):
    # given a service that gzips its answer although the host asked for none: 4 KB that
    # inflate to 4 MB of zeros
    report_service.headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    report_service.body = gzip.compress(b'{"data": "' + b"0" * 4_000_000 + b'"}')

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then
    assert str(raised.value) == "The service answered in gzip encoding, which was not asked for."
    assert raised.value.category == ErrorCategory.UPSTREAM_ERROR


def test_a_success_in_an_encoding_echoing_what_the_gateway_was_sent_does_not_quote_it(
    report_service,
):
    # given a gateway that answers 200 with a Content-Encoding echoing what it was sent
    report_service.headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "x-token Svc-77D0c1E9a4B25F68",
    }
    report_service.body = b'{"data": "ok"}'

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then the call fails saying so, without the header's text
    assert str(raised.value) == "The service answered in an encoding that was not asked for."
    assert raised.value.category == ErrorCategory.UPSTREAM_ERROR


@pytest.mark.parametrize(
    ("status", "category", "may_have_side_effect"),
    [(429, ErrorCategory.RATE_LIMITED, False), (503, ErrorCategory.UPSTREAM_ERROR, True)],
)
def test_a_retryable_error_status_stays_retryable_whatever_the_encoding_of_its_body(
    report_service, status, category, may_have_side_effect
):
    # given a service that answers a transient error, asking to wait 7 s, with a gzipped body
    # although the host asked for none (a gateway that compresses every page it sends)
    report_service.status = status
    report_service.headers = {
        "Content-Type": "text/html",
        "Content-Encoding": "gzip",
        "Retry-After": "7",
    }
    report_service.body = gzip.compress(b"<html>busy</html>")

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then the status decides, as it does for a plain body: a failure another try may pass,
    # after the wait the service asked for
    failure = raised.value
    assert str(failure) == (
        f"The service answered {status}; try again in 7 s. Its body was not read: it was in "
        "gzip encoding, which was not asked for."
    )
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        category,
        True,
        may_have_side_effect,
    )
    assert failure.retry_after == 7
    assert failure.raw is None


@pytest.mark.parametrize(
    ("encoding", "named"),
    [
        ("br", "br encoding, which was"),
        ("BR ", "br encoding, which was"),
        ("x-token Svc-77D0c1E9a4B25F68", "an encoding that was"),
    ],
)
def test_an_error_status_whose_body_is_in_an_encoding_not_asked_for_says_it_was_not_read(
    report_service, encoding, named
):
    # given a gateway that answers 503, asking to wait 7 s, with a body in an encoding the
    # host did not ask for (it asks for identity only), or that echoes in that header what
    # it was sent
    report_service.status = 503
    report_service.headers = {
        "Content-Type": "application/json",
        "Content-Encoding": encoding,
        "Retry-After": "7",
    }
    report_service.body = b"\x1b\x0f\x00\xf8\xa5\x02\x02"

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then the status and its wait are kept, and the error says the body was left unread,
    # naming only a coding HTTP defines
    failure = raised.value
    assert str(failure) == (
        f"The service answered 503; try again in 7 s. Its body was not read: it was in {named} "
        "not asked for."
    )
    assert (failure.category, failure.retryable, failure.retry_after) == (
        ErrorCategory.UPSTREAM_ERROR,
        True,
        7,
    )
    assert failure.raw is None
    assert "Svc-77D0" not in str(failure)


class TricklingHeaders(BaseHTTPRequestHandler):
    """Reads the call and sends its answer's status line and headers a byte every 0.2 s."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        try:
            for byte in answer:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass  # the host stopped reading

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_headers_that_trickle_in_past_the_timeout_fail_the_call_in_time():
    # given a service whose headers alone take 16 s, each byte well within the tool's 1 s
    with loopback_server(TricklingHeaders) as port:
        # when
        started = time.monotonic()
        with pytest.raises(ToolFailed) as raised:
            http_call(
                report_tool(f"http://127.0.0.1:{port}/", timeout_s=1),
                call_context(),
                {"project_id": "apollo"},
            )

        # then the call failed as a timeout within a read's timeout of its deadline, not
        # when the headers ended
        assert time.monotonic() - started < 6
    assert raised.value.category == ErrorCategory.TIMEOUT
    assert str(raised.value) == "The service did not finish its answer in time."


def report_read(demo, report_service: ReportService, **reader: Any) -> Run:
    """A run of the generic agent that reads the report once (the tool as `reader` says,
    `http_reader_add`), finished."""
    http_reader_add(demo, report_service.url, tool="report_read", agent="report-reader", **reader)
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(run.pk))
    return Run.objects.get(pk=run.pk)


def envelope_size(envelope: dict) -> int:
    return len(json.dumps(envelope, separators=(",", ":")).encode())


def test_an_answer_too_large_for_the_envelope_stays_whole_in_a_source_of_the_call(
    demo, report_service, settings
):
    # given a service whose answer is far larger than an envelope may carry
    rows = [{"row": index, "text": f"line {index} " + "x" * 40} for index in range(900)]
    report_service.body = json.dumps({"business_status": "ok", "data": {"rows": rows}}).encode()

    # when
    run = report_read(demo, report_service)

    # then the envelope is cut to size, and refers to a Source holding the whole answer
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.status == "completed"
    assert record.envelope["truncated"] is True
    assert envelope_size(record.envelope) <= settings.TOOL_RESULT_MAX_BYTES
    (source,) = Source.objects.filter(run=run, tool_call=record)
    assert source.reference == f"tool-result:{record.call_id}"
    assert json.loads(source.content)["raw"]["rows"] == rows
    assert [item["reference"] for item in record.envelope["sources"]] == [source.reference]
    assert run.result["sources"] == [{"reference": source.reference, "origin": "report_read@1.0.0"}]


def test_a_call_keeps_at_most_its_share_of_the_sources_a_service_returns(
    demo, report_service, settings
):
    # given a service that answers with thousands of sources
    settings.TOOL_RESULT_MAX_SOURCES = 5
    sources = [
        {"reference": f"report:{index}", "content": f"line {index}"} for index in range(8000)
    ]
    report_service.body = json.dumps({"data": {}, "sources": sources}).encode()

    # when
    run = report_read(demo, report_service)

    # then the call kept the first five, and says it was cut
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.status == "completed"
    assert record.envelope["truncated"] is True
    kept = [f"report:{index}" for index in range(5)]
    assert [item["reference"] for item in record.envelope["sources"]] == kept
    assert (
        sorted(Source.objects.filter(tool_call=record).values_list("reference", flat=True)) == kept
    )


def test_large_normalised_fields_are_cut_too(demo, report_service, settings):
    # given a service whose normalised fields are large (its raw answer is small)
    report_service.body = json.dumps(
        {"business_status": "ok", "data": {"ok": True}, "normalized": {"summary": "y" * 60_000}}
    ).encode()

    # when
    run = report_read(demo, report_service)

    # then
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["truncated"] is True
    assert envelope_size(record.envelope) <= settings.TOOL_RESULT_MAX_BYTES
    (source,) = Source.objects.filter(run=run, tool_call=record)
    assert json.loads(source.content)["normalized"] == {"summary": "y" * 60_000}


@pytest.fixture
def report_token(monkeypatch, settings) -> str:
    """The credential the report tool may name, REPORT_SERVICE_TOKEN, granted to acme."""
    monkeypatch.setenv("REPORT_SERVICE_TOKEN", "svc-77d0c1e9a4b25f68")
    settings.TENANT_CREDENTIALS = {"acme": ["REPORT_SERVICE_TOKEN"]}
    return "svc-77d0c1e9a4b25f68"


@pytest.mark.parametrize("value", [None, ""])
def test_a_tool_whose_credential_is_not_set_is_never_called_without_it(
    demo, report_service, report_token, monkeypatch, value
):
    # given a tool naming a credential granted to acme, whose variable this host does not
    # set, or sets empty
    if value is None:
        monkeypatch.delenv("REPORT_SERVICE_TOKEN")
    else:
        monkeypatch.setenv("REPORT_SERVICE_TOKEN", value)

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the service was never called, the call rejected at the host's gate
    assert report_service.requests == []
    record = ToolCall.objects.get(run=run, name="report_read")
    message = (
        "The credential REPORT_SERVICE_TOKEN is not set or empty on this host; nothing was sent."
    )
    assert (record.status, record.error_category, record.attempts) == (
        "rejected",
        "PERMISSION_DENIED",
        0,
    )
    assert (record.envelope["retryable"], record.envelope["error"]["message"]) == (False, message)
    assert [payload["reason"] for payload in events_of(run, "tool.rejected")] == [message]
    assert "tool.completed" not in event_types(run)


def test_a_read_that_failed_before_anything_was_sent_counts_no_attempt(
    demo, report_service, report_token, monkeypatch
):
    # given a read tool, retried up to 3 times, whose credential variable holds a line break
    # no header can carry
    monkeypatch.setenv("REPORT_SERVICE_TOKEN", f"{report_token}\n")

    # when
    run = report_read(
        demo,
        report_service,
        credential_ref="REPORT_SERVICE_TOKEN",
        retry_policy=RETRIES_WITHIN_5_S,
    )

    # then the call failed at the host, the service never asked, and its record says so
    assert report_service.requests == []
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.error_category, record.attempts) == (
        "failed",
        "PERMISSION_DENIED",
        0,
    )
    [span] = Span.objects.filter(run=run, name="tool.call")
    assert (span.attributes["attempts"], span.attributes["retries"]) == (0, 0)


@pytest.mark.parametrize("business_status", ["ok", "refused for {secret}"])
def test_a_credential_the_service_echoes_in_a_reference_or_status_is_stripped(
    demo, report_service, report_token, business_status
):
    # given a service that names its evidence by the URL it fetched, credential included, and
    # succeeds, or echoes the credential in the business status it refuses with
    secret = report_token
    report_service.body = json.dumps(
        {
            "business_status": business_status.format(secret=secret),
            "data": {"health": "green"},
            "sources": [
                {"reference": f"https://status.example/apollo?token={secret}", "content": "green"}
            ],
        }
    ).encode()

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the service got the credential, and it is nowhere in what the run keeps or shows:
    # a success keeps its source, its reference stripped; a refusal keeps none
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["business_status"] == business_status.format(secret="[redacted]")
    references = list(
        Source.objects.filter(run=run, tool_call=record).values_list("reference", flat=True)
    )
    assert references == (
        ["https://status.example/apollo?token=[redacted]"] if business_status == "ok" else []
    )
    stored = json.dumps(
        [
            list(run.events.values_list("payload", flat=True)),
            record.envelope,
            references,
            run.transcript,
            run.result,
        ]
    )
    assert secret not in stored


def test_a_credential_the_service_echoes_url_encoded_is_stripped(
    demo, report_service, report_token, monkeypatch
):
    # given a credential with characters a URL encodes, which the service echoes in the
    # links of its answer, encoded as a URL and as a form would (hex in either case)
    secret = "Zk8+q2/Lm9xR=Tv4wB7nH1s"
    monkeypatch.setenv("REPORT_SERVICE_TOKEN", secret)
    links = [
        "https://status.example/retry?auth=Zk8%2Bq2%2FLm9xR%3DTv4wB7nH1s",
        "https://status.example/retry/Zk8%2bq2/Lm9xR%3dTv4wB7nH1s",
    ]
    report_service.body = json.dumps(
        {
            "business_status": "ok",
            "data": {"health": "green", "links": links},
            "sources": [{"reference": links[0], "content": f"green, see {links[1]}"}],
        }
    ).encode()

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the service got the credential, and no encoding of it is in what the run keeps
    assert report_service.requests
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["raw"]["links"] == [
        "https://status.example/retry?auth=[redacted]",
        "https://status.example/retry/[redacted]",
    ]
    stored = json.dumps(
        [
            list(run.events.values_list("payload", flat=True)),
            record.envelope,
            list(Source.objects.filter(run=run).values_list("reference", "content")),
            run.transcript,
            run.result,
        ]
    )
    assert "Tv4wB7nH1s" not in stored


def test_a_credential_the_service_echoes_base64_encoded_is_stripped(
    demo, report_service, report_token, monkeypatch
):
    # given a service that echoes the credential it was given base64-encoded, alone (URL-safe,
    # unpadded) and as Basic authentication encodes it after a user name
    secret = "s3cr3t~~value??-0123456789"
    monkeypatch.setenv("REPORT_SERVICE_TOKEN", secret)
    alone = base64.urlsafe_b64encode(secret.encode()).decode().rstrip("=")
    after_user = base64.b64encode(f"dave:{secret}".encode()).decode()
    report_service.body = json.dumps(
        {
            "business_status": "ok",
            "data": {"health": "green", "seen": [alone, f"received as {after_user}"]},
            "sources": [{"reference": "https://status.example/apollo", "content": after_user}],
        }
    ).encode()

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the service got the credential, and no encoding of it is in what the run keeps
    assert report_service.requests
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["raw"]["seen"] == ["[redacted]", "received as ZGF2ZT[redacted]"]
    stored = json.dumps(
        [
            list(run.events.values_list("payload", flat=True)),
            record.envelope,
            list(Source.objects.filter(run=run).values_list("reference", "content")),
            run.transcript,
            run.result,
        ]
    )
    assert alone[4:20] not in stored
    assert after_user[8:24] not in stored


def test_a_credential_a_text_answer_echoes_where_it_is_cut_leaves_no_part_of_it(
    demo, report_service, report_token
):
    # given a plain-text answer whose cut at 4000 characters falls inside the credential
    report_service.headers = {"Content-Type": "text/plain"}
    report_service.body = ("x" * 3990 + report_token).encode()

    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    record = ToolCall.objects.get(run=run, name="report_read")
    stored = json.dumps(
        [record.envelope, run.transcript, list(run.events.values_list("payload", flat=True))]
    )
    assert report_token[:10] not in stored
    assert record.envelope["raw"]["text"].endswith("[redacted]")


@pytest.mark.parametrize(
    ("header", "padding", "said"),
    [
        ("Content-Type", 50, "x" * 50 + "[redacted]"),
        ("Content-Encoding", 30, "in an encoding that was not asked for"),
    ],
)
def test_a_credential_a_header_the_error_names_echoes_where_it_is_cut_leaves_no_part_of_it(
    demo, report_service, report_token, monkeypatch, header, padding, said
):
    # given a service that echoes the credential (in upper and lower case) in the header its
    # error message names (the content type of a 200 that is not JSON, quoted as far as the
    # message cuts it, or an encoding not asked for, not quoted at all), past that cut
    report_token = "Svc-77D0c1E9a4B25F68"
    monkeypatch.setenv("REPORT_SERVICE_TOKEN", report_token)
    report_service.headers = {"Content-Type": "text/plain"}
    report_service.headers[header] = "x" * padding + report_token
    report_service.body = b"accepted"

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the call failed, and no part of the credential is in what the run keeps
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.error_category) == ("failed", "UPSTREAM_ERROR")
    assert said in record.envelope["error"]["message"]
    stored = json.dumps(
        [record.envelope, run.transcript, list(run.events.values_list("payload", flat=True))]
    )
    assert report_token[:10].lower() not in stored.lower()


def test_a_credential_echoed_in_a_response_header_is_not_logged_even_at_debug(
    demo, report_service, report_token, caplog
):
    caplog.set_level(logging.DEBUG)
    report_service.headers = {
        "Content-Type": "application/json",
        "X-Echo-Authorization": f"Bearer {report_token}",
    }

    report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    assert caplog.records
    assert report_token not in "\n".join(record.getMessage() for record in caplog.records)


def test_an_answer_larger_than_the_response_limit_fails_the_call(report_service, settings):
    # given a service whose answer is larger than the host reads
    settings.TOOL_RESPONSE_MAX_BYTES = 1000
    report_service.body = json.dumps({"data": {"rows": ["x" * 100] * 20}}).encode()

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then
    failure = raised.value
    assert str(failure) == "The service's answer is larger than 1000 bytes."
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        ErrorCategory.UPSTREAM_ERROR,
        False,
        False,
    )


@pytest.mark.parametrize(
    ("status", "category", "may_have_side_effect"),
    [(429, ErrorCategory.RATE_LIMITED, False), (503, ErrorCategory.UPSTREAM_ERROR, True)],
)
def test_a_retryable_error_status_stays_retryable_whatever_the_size_of_its_body(
    report_service, settings, status, category, may_have_side_effect
):
    # given a service that answers a transient error, asking to wait 7 s, with a body larger
    # than the host reads (a gateway's error page, a stack trace)
    settings.TOOL_RESPONSE_MAX_BYTES = 1000
    report_service.status = status
    report_service.headers = {"Content-Type": "text/html", "Retry-After": "7"}
    report_service.body = b"<html>" + b"busy " * 2000 + b"</html>"

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then the status decides, as it does for a small body: a failure another try may pass,
    # after the wait the service asked for; what is kept of the body is what the host read
    failure = raised.value
    assert str(failure) == f"The service answered {status}; try again in 7 s."
    assert (failure.category, failure.retryable, failure.may_have_side_effect) == (
        category,
        True,
        may_have_side_effect,
    )
    assert failure.retry_after == 7
    assert failure.raw == {"text": report_service.body[:1000].decode()}


def test_an_answer_that_trickles_in_past_the_timeout_fails_the_call_in_time(report_service):
    # given a service that sends its answer a byte every 0.2 s, each well within the tool's
    # timeout of 1 s, the whole answer taking 11 s
    report_service.drip = 0.2

    # when
    started = time.monotonic()
    with pytest.raises(ToolFailed) as raised:
        http_call(
            report_tool(report_service.url, timeout_s=1), call_context(), {"project_id": "apollo"}
        )

    # then the call failed as a timeout once its second had passed, not when the answer ended
    assert time.monotonic() - started < 6
    assert raised.value.category == ErrorCategory.TIMEOUT
    assert str(raised.value) == "The service did not finish its answer in time."


def auditor_page_and_export(client, run: Run) -> tuple[str, str]:
    """What carol, acme's auditor without clearance, reads of the run."""
    assert client.login(username="carol", password=DEMO_PASSWORD)
    page = client.get(reverse("runs:detail", args=[run.pk]))
    export = client.get(reverse("runs:export", args=[run.pk]))
    assert page.status_code == export.status_code == 200
    return page.content.decode(), export.content.decode()


def test_a_credential_the_service_uses_as_a_key_is_stripped(demo, report_service, report_token):
    # given a service that keys its answer by the credential it was called with
    secret = report_token
    report_service.body = json.dumps(
        {"business_status": "ok", "data": {"health": "green", "sessions": {secret: "active"}}}
    ).encode()

    # when
    run = report_read(demo, report_service, credential_ref="REPORT_SERVICE_TOKEN")

    # then the key is redacted like any value
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["raw"]["sessions"] == {"[redacted]": "active"}
    assert secret not in json.dumps([record.envelope, run.transcript])


def test_an_auditor_without_clearance_sees_no_sensitive_field_nor_email_anywhere(
    demo, report_service, client
):
    # given a tool whose contract marks salary_band sensitive, answering with it and with a
    # record keyed by an email address
    report_service.body = json.dumps(
        {
            "business_status": "ok",
            "data": {"salary_band": "L7-EUR-183500", "leads": {"li.wei@acme.example": "lead"}},
        }
    ).encode()
    run = report_read(demo, report_service, result_contract={"sensitive_fields": ["salary_band"]})
    assert ToolCall.objects.get(run=run, name="report_read").status == "completed"

    # when carol reads the run and exports it
    page, export = auditor_page_and_export(client, run)

    # then neither is in the call's envelope, the turns the model saw or the sources
    record = json.loads(export)
    assert record["tool_calls"][0]["envelope"]["raw"]["salary_band"] == "[redacted]"
    for text in (page, export):
        assert "L7-EUR-183500" not in text
        assert "li.wei@acme.example" not in text
    assert "l***@acme.example" in export


def test_an_answer_cut_to_fit_its_envelope_shows_an_auditor_no_part_of_a_sensitive_value(
    demo, report_service, client
):
    # given a directory service whose answer is far larger than an envelope may carry, most of
    # it names, under a field its contract marks sensitive: the envelope's cut falls in one
    people = [
        {"record_id": f"dir-{index:04d}", "display_name": f"Zoë Brandt-Nakamura {index:03d}"}
        for index in range(600)
    ]
    report_service.body = json.dumps({"business_status": "ok", "data": {"people": people}}).encode()
    run = report_read(demo, report_service, result_contract={"sensitive_fields": ["display_name"]})
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["truncated"] is True

    # when carol, without clearance, reads the run and exports it
    page, export = auditor_page_and_export(client, run)

    # then no name is there, whole or in part: not in the call's envelope nor in the turns
    # where the model read it
    for text in (page, export):
        assert "zoë" not in revealed(text)
        assert "brandt" not in revealed(text)
    # and the preview, as the model read it, holds whole values only: it ends after one, or
    # after an opening bracket
    preview = record.envelope["raw"]["preview"]
    shown = re.findall(r'"display_name": "([^"]*)"', preview)
    assert shown == [person["display_name"] for person in people[: len(shown)]]
    assert shown
    assert preview.endswith(("}", '"', "{", "["))


@pytest.mark.parametrize("as_text", [False, True])
def test_a_source_nested_deeper_than_a_run_keeps_leaves_the_auditor_s_pages_whole(
    demo, report_service, client, as_text
):
    # given a tool with a sensitive field whose service gives a source's content nested 600
    # levels deep, as an object or as its JSON text
    nested = "[" * 600 + "]" * 600
    report_service.body = (
        '{"business_status": "ok", "data": {"health": "green"}, "sources": [{"reference": '
        f'"report:apollo", "content": {json.dumps(nested) if as_text else nested}}}]}}'
    ).encode()
    run = report_read(demo, report_service, result_contract={"sensitive_fields": ["display_name"]})
    assert Source.objects.filter(run=run, reference="report:apollo").exists()

    # when an auditor without clearance reads the run, then its page and export answer, the
    # content too deep to be read for sensitive fields not shown
    _, export = auditor_page_and_export(client, run)
    (audited,) = [
        item for item in json.loads(export)["sources"] if item["reference"] == "report:apollo"
    ]
    assert audited["content"] == "[redacted]"


def test_a_source_the_service_gives_as_an_object_is_kept_as_its_json_text(
    demo, report_service, client
):
    # given a service that gives its evidence as an object, with a name under a field its
    # contract marks sensitive
    content = {"project": "apollo", "health": "green", "owner": {"display_name": "Zoë Brandt"}}
    report_service.body = json.dumps(
        {
            "business_status": "ok",
            "data": {"health": "green"},
            "sources": [{"reference": "report:apollo", "content": content}],
        }
    ).encode()

    # when
    run = report_read(demo, report_service, result_contract={"sensitive_fields": ["display_name"]})

    # then the run keeps the object as JSON text, which a viewer with clearance reads in the
    # export as the service gave it
    (source,) = Source.objects.filter(run=run, reference="report:apollo")
    assert json.loads(source.content) == content
    client.force_login(demo.admin)
    (exported,) = [
        item
        for item in client.get(reverse("runs:export", args=[run.pk])).json()["sources"]
        if item["reference"] == "report:apollo"
    ]
    assert json.loads(exported["content"]) == content
    # and an auditor without clearance reads it too, the sensitive field hidden
    _, export = auditor_page_and_export(client, run)
    (audited,) = [
        item for item in json.loads(export)["sources"] if item["reference"] == "report:apollo"
    ]
    assert json.loads(audited["content"]) == {
        "project": "apollo",
        "health": "green",
        "owner": {"display_name": "[redacted]"},
    }


@pytest.mark.parametrize(("status", "opens"), [(404, False), (422, False), (503, True)])
def test_only_the_tool_s_own_faults_open_its_circuit(demo, report_service, status, opens):
    """A caller's mistake is an answer: counted as a fault, a few bad arguments of one tenant
    opened a platform-wide tool's circuit, and every tenant's calls of it failed fast."""
    report_service.status = status
    report_service.body = b'{"error": "no such report"}'
    breaker = {"failure_threshold": 3, "reset_after_s": 30}
    http_reader_add(
        demo, report_service.url, tool="report_read", agent="report-reader", circuit_breaker=breaker
    )

    for _ in range(3):
        run = demo_run(
            demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo"
        )
        run_execute(run_id=str(run.pk))

    assert len(report_service.requests) == 3
    tool_version = ToolVersion.objects.get(tool__name="report_read")
    assert limits.circuit_state(tool_version) == ("open" if opens else "closed")


def rate_limited_once(retry_after: str) -> tuple[type[BaseHTTPRequestHandler], list[float]]:
    """A service that answers its first call 429 asking to wait `retry_after` (Retry-After)
    and every later one 200, with the times the calls came (monotonic seconds)."""
    arrivals: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            arrivals.append(time.monotonic())
            limited = len(arrivals) == 1
            body = b'{"error": "slow down"}' if limited else b'{"data": {"health": "green"}}'
            self.send_response(429 if limited else 200)
            if limited:
                self.send_header("Retry-After", retry_after)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler, arrivals


RETRIES_WITHIN_5_S = {"max_attempts": 3, "backoff_s": 0.05, "max_backoff_s": 5, "jitter": False}


def test_a_retry_waits_as_long_as_the_service_asked(demo):
    # given a read tool retried after 0.05 s, whose service asks the first call to wait 1 s
    handler, arrivals = rate_limited_once("1")
    with loopback_server(handler) as port:
        service = ReportService(url=f"http://127.0.0.1:{port}/report")

        # when
        run = report_read(demo, service, retry_policy=RETRIES_WITHIN_5_S)

    # then it was called again once the second had passed, and answered
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(arrivals)) == ("completed", 2, 2)
    assert arrivals[1] - arrivals[0] >= 1


def test_a_service_that_asks_for_a_longer_wait_than_the_retry_policy_s_is_not_called_again(demo):
    # given a read tool retried within 5 s, whose service asks the first call to wait 30 s
    handler, arrivals = rate_limited_once("30")
    with loopback_server(handler) as port:
        service = ReportService(url=f"http://127.0.0.1:{port}/report")

        # when
        run = report_read(demo, service, retry_policy=RETRIES_WITHIN_5_S)

    # then the call failed at once, as one another try may pass later
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(arrivals)) == ("failed", 1, 1)
    assert (record.envelope["error"]["category"], record.envelope["retryable"]) == (
        "RATE_LIMITED",
        True,
    )


def test_a_service_that_answers_429_with_its_wait_tells_the_model_when_to_try_again(demo):
    # given a read tool retried within 5 s, whose service asks the first call to wait 30 s
    handler, _ = rate_limited_once("30")
    with loopback_server(handler) as port:
        service = ReportService(url=f"http://127.0.0.1:{port}/report")

        # when
        run = report_read(demo, service, retry_policy=RETRIES_WITHIN_5_S)

    # then the model is told the service's answer and when to call again, as a call the
    # tool's own rate limit turned away is
    record = ToolCall.objects.get(run=run, name="report_read")
    assert record.envelope["error"]["message"] == "The service answered 429; try again in 30 s."
    [result] = [
        entry for entry in Run.objects.get(pk=run.pk).transcript if entry["kind"] == "tool_result"
    ]
    assert "The service answered 429; try again in 30 s." in result["content"]


@pytest.mark.parametrize(
    ("status", "headers", "told"),
    [
        (429, {"Retry-After": "2.5"}, "The service answered 429; try again in 3 s."),
        (503, {"Retry-After": "7"}, "The service answered 503; try again in 7 s."),
        (429, {}, "The service answered 429."),
        (400, {"Retry-After": "7"}, "The service answered 400."),
        # Not a number of seconds as HTTP writes one, though float() reads each as 10.
        (429, {"Retry-After": "1_0"}, "The service answered 429."),
        (429, {"Retry-After": "1e1"}, "The service answered 429."),
        (429, {"Retry-After": "+10"}, "The service answered 429."),
    ],
)
def test_an_error_status_says_when_to_try_again_when_the_service_said_and_a_try_may_pass(
    report_service, status, headers, told
):
    # given a service that answers an error status, with or without a Retry-After
    report_service.status = status
    report_service.headers = {"Content-Type": "application/json", **headers}
    report_service.body = b'{"error": "not now"}'

    # when
    with pytest.raises(ToolFailed) as raised:
        http_call(report_tool(report_service.url), call_context(), {"project_id": "apollo"})

    # then
    assert str(raised.value) == told


def test_a_call_the_tool_s_rate_limit_turned_away_is_retried_once_its_window_frees_a_place(
    demo, report_service
):
    # given a read tool that allows 1 call a second, retried after 0.05 s, and a run that
    # just called it
    http_reader_add(
        demo,
        report_service.url,
        tool="report_read",
        agent="report-reader",
        rate_limit={"requests": 1, "per_seconds": 1},
        retry_policy=RETRIES_WITHIN_5_S,
    )
    first = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(first.pk))
    started = time.monotonic()

    # when another run calls it at once
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(run.pk))

    # then its call waited for the window instead of spending its tries while it was full,
    # and was answered
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(report_service.requests)) == ("completed", 1, 2)
    assert time.monotonic() - started >= 0.5


def test_a_call_the_tool_s_rate_limit_turned_away_tells_the_model_when_to_try_again(
    demo, report_service
):
    # given a read tool that allows 1 call a minute, retried within 5 s, and a run that just
    # called it
    http_reader_add(
        demo,
        report_service.url,
        tool="report_read",
        agent="report-reader",
        rate_limit={"requests": 1, "per_seconds": 60},
        retry_policy=RETRIES_WITHIN_5_S,
    )
    first = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(first.pk))

    # when another run calls it at once
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(run.pk))

    # then its call failed as one a later try may pass, and the model is told when
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(report_service.requests)) == ("failed", 0, 1)
    assert (record.envelope["error"]["category"], record.envelope["retryable"]) == (
        "RATE_LIMITED",
        True,
    )
    told = re.fullmatch(
        r"report_read@1\.0\.0 allows 1 calls per 60 s; try again in (\d+) s\.",
        record.envelope["error"]["message"],
    )
    assert told and 50 <= int(told[1]) <= 60
    [result] = [
        entry for entry in Run.objects.get(pk=run.pk).transcript if entry["kind"] == "tool_result"
    ]
    assert f"try again in {told[1]} s" in result["content"]


def test_a_call_the_tool_s_open_circuit_turned_away_tells_the_model_when_to_try_again(
    demo, report_service
):
    # given a read tool whose circuit opens for 30 s on its first failure, retried within 5 s,
    # and a run whose call of it the service failed
    report_service.status = 503
    http_reader_add(
        demo,
        report_service.url,
        tool="report_read",
        agent="report-reader",
        circuit_breaker={"failure_threshold": 1, "reset_after_s": 30},
        retry_policy=RETRIES_WITHIN_5_S,
    )
    first = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(first.pk))
    assert limits.circuit_state(ToolVersion.objects.get(tool__name="report_read")) == "open"

    # when another run calls it at once
    run = demo_run(demo, text="Read Apollo's report.", agent="report-reader", project_id="apollo")
    run_execute(run_id=str(run.pk))

    # then its call failed, nothing sent, as one a later try may pass, and the model is told when
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(report_service.requests)) == ("failed", 0, 1)
    assert record.envelope["retryable"] is True
    told = re.fullmatch(
        r"report_read@1\.0\.0 is failing; calls are paused; try again in (\d+) s\.",
        record.envelope["error"]["message"],
    )
    assert told and 20 <= int(told[1]) <= 30
    [result] = [
        entry for entry in Run.objects.get(pk=run.pk).transcript if entry["kind"] == "tool_result"
    ]
    assert f"try again in {told[1]} s" in result["content"]


def test_an_approved_send_its_rate_window_keeps_out_past_its_time_fails_at_once(
    demo, report_service, monkeypatch
):
    # given the running example's approved send through an HTTP mail service that allows 1
    # send a minute, and a send of a minute ago is still in its window
    run, action, mail_send = approved_http_send(demo, report_service, monkeypatch)
    monkeypatch.setattr(mail_send, "rate_limit", {"requests": 1, "per_seconds": 60})
    [held] = limits.calls_enter([mail_send], tenant_id=run.tenant_id)
    limits.calls_leave([(held, False)])
    started = time.monotonic()

    # when the approved send is made
    services.action_execute(action_id=action.pk)

    # then it does not hold its task asking the full window again and again: nothing was
    # sent, the action failed as one a later try may pass, and it says when
    assert time.monotonic() - started < LIMIT_WAIT_SECONDS[1]
    assert report_service.requests == []
    action.refresh_from_db()
    assert action.status == ActionStatus.FAILED
    assert action.outcome["error"]["category"] == "RATE_LIMITED"
    told = re.fullmatch(
        rf"{re.escape(mail_send.qualified_name)} allows 1 calls per 60 s; "
        r"try again in (\d+) s\.",
        action.outcome["error"]["message"],
    )
    assert told and 50 <= int(told[1]) <= 60
    assert Run.objects.get(pk=run.pk).status == "FAILED_RETRYABLE"


# Retried at once, up to 5 times, every 0.5 s.
RETRIES_EVERY_HALF_SECOND = {
    "max_attempts": 5,
    "backoff_s": 0.5,
    "max_backoff_s": 0.5,
    "jitter": False,
}


def test_a_tool_is_not_tried_again_when_the_try_could_not_end_within_the_step_s_task(
    demo, report_service, settings
):
    # given a task whose step has 6 s before its soft time limit (it may start 240 s into a
    # task limited to 246 s), and a read tool of 5 s retried every 0.5 s, whose service is
    # down
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 246
    report_service.status = 503
    report_service.body = b'{"error": "down"}'

    # when
    run = report_read(demo, report_service, retry_policy=RETRIES_EVERY_HALF_SECOND)

    # then it was tried again while another try of 5 s could end within the 6 s, then no
    # more: the call failed as one another try may pass later, before Celery would stop it
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.attempts, len(report_service.requests)) == ("failed", 2, 2)
    assert (record.envelope["error"]["category"], record.envelope["retryable"]) == (
        "UPSTREAM_ERROR",
        True,
    )


def test_an_approved_send_is_not_tried_again_when_the_try_could_not_end_within_its_task(
    demo, report_service, settings, monkeypatch
):
    # given an approved send through an HTTP mail service whose calls time out after 5 s,
    # retried every 0.5 s as its key makes safe, in a task that has 6 s for it, and a mail
    # service that fails every call after it was made
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 246
    run, action, mail_send = approved_http_send(demo, report_service, monkeypatch)
    monkeypatch.setattr(mail_send, "timeout_s", 5)
    monkeypatch.setattr(mail_send, "retry_policy", RETRIES_EVERY_HALF_SECOND)
    report_service.status = 503
    report_service.body = b'{"error": "down"}'

    # when the approved send is made
    services.action_execute(action_id=action.pk)

    # then it was made twice, not five times, and its outcome is left unknown
    assert len(report_service.requests) == 2
    action.refresh_from_db()
    assert action.status == ActionStatus.UNKNOWN
    assert ToolCall.objects.get(run=run, name="mail_send").attempts == 2


@pytest.mark.parametrize(
    ("refusal", "run_status"),
    [
        ("denied-address", "FAILED_FINAL"),
        ("credential-with-a-line-break", "FAILED_FINAL"),
        # a service that may listen later: the user may ask again
        ("service-not-listening", "FAILED_RETRYABLE"),
    ],
)
def test_an_approved_http_send_the_host_refused_to_make_was_not_executed(
    demo, report_service, report_token, monkeypatch, refusal, run_status
):
    # given an approved send through an HTTP mail service the host will not or cannot call:
    # its address is one the egress policy denies, its credential holds a line break, or
    # nothing listens at its address
    run, action, mail_send = approved_http_send(demo, report_service, monkeypatch)
    config = {"url": report_service.url, "credential_ref": "REPORT_SERVICE_TOKEN"}
    if refusal == "denied-address":
        config["url"] = "http://169.254.169.254/latest/meta-data/"
    elif refusal == "service-not-listening":
        with loopback_server(BreakingOff) as port:
            config["url"] = f"http://127.0.0.1:{port}/"
    else:
        monkeypatch.setenv("REPORT_SERVICE_TOKEN", f"{report_token}\n")
    monkeypatch.setattr(mail_send, "adapter_config", config)

    # when the approved send is made
    services.action_execute(action_id=action.pk)

    # then nothing was sent, and the action is a failure that was never executed
    assert report_service.requests == []
    action.refresh_from_db()
    assert (action.status, action.executed_at) == (ActionStatus.FAILED, None)
    assert ToolCall.objects.get(run=run, name="mail_send").attempts == 0
    ended = Run.objects.get(pk=run.pk)
    assert (ended.status, ended.reason_code) == (run_status, "ACTION_FAILED")
    assert ended.result["actions"] == []


def test_a_try_ends_when_the_step_s_task_would_rather_than_at_the_tool_s_timeout(
    demo, report_service, settings
):
    # given a task whose step has 2 s before its soft time limit, and a read tool of 5 s
    # whose service sends its answer a byte every 0.2 s (11 s in all)
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    report_service.drip = 0.2

    # when
    run = report_read(demo, report_service)

    # then the call failed TIMEOUT once the step's 2 s had passed, as one another try may
    # pass later, before Celery would stop the step mid-call and lose its work
    record = ToolCall.objects.get(run=run, name="report_read")
    assert (record.status, record.error_category, record.attempts) == ("failed", "TIMEOUT", 1)
    assert record.duration_ms < 3000
    assert record.envelope["retryable"] is True


def test_an_approved_send_ends_when_its_task_would_rather_than_at_the_tool_s_timeout(
    demo, report_service, settings, monkeypatch
):
    # given an approved send through an HTTP mail service whose calls time out after 5 s, in
    # a task that has 2 s for it, and a mail service that sends its answer a byte every 0.2 s
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    run, action, mail_send = approved_http_send(demo, report_service, monkeypatch)
    monkeypatch.setattr(mail_send, "timeout_s", 5)
    report_service.drip = 0.2

    # when the approved send is made
    started = time.monotonic()
    services.action_execute(action_id=action.pk)

    # then it ended within the task's 2 s (not at the tool's 5 s), its outcome left unknown
    # for reconciliation
    assert time.monotonic() - started < 4
    assert len(report_service.requests) == 1
    action.refresh_from_db()
    assert action.status == ActionStatus.UNKNOWN
    call = ToolCall.objects.get(run=run, name="mail_send")
    assert (call.error_category, call.attempts) == ("TIMEOUT", 1)


@pytest.mark.parametrize(
    ("reference", "kept"),
    [
        ({"update": 7, "project": "apollo"}, '{"project":"apollo","update":7}'),
        (["apollo", 7, {"b": 2, "a": 1}], '["apollo",7,{"a":1,"b":2}]'),
        (7, "7"),
        (True, "true"),
        ("report:apollo", "report:apollo"),
    ],
    ids=["object", "list", "number", "literal", "text"],
)
def test_a_source_reference_the_service_gives_as_another_json_value_is_kept_as_its_json_text(
    demo, report_service, reference, kept
):
    # given a service that names its evidence by a JSON value that is not text, its keys in
    # any order
    report_service.body = json.dumps(
        {
            "data": {"health": "green"},
            "sources": [{"reference": reference, "content": "Apollo is green."}],
        }
    ).encode()

    # when a run reads it
    run = report_read(demo, report_service)

    # then the Source, the envelope and the event name it by the value's canonical JSON text
    # (keys sorted, compact), the same text every time, never by Python's spelling of it
    (source,) = Source.objects.filter(run=run, origin="report_read@1.0.0")
    assert source.reference == kept
    record = ToolCall.objects.get(run=run, name="report_read")
    assert [item["reference"] for item in record.envelope["sources"]] == [kept]
    assert events_of(run, "tool.completed")[0]["sources"] == [kept]


def test_long_references_that_start_alike_stay_distinct_and_citable(demo, report_service):
    # given a service that names two pieces of evidence by long references that differ only
    # after their first 300 characters
    stem = "report:apollo/" + "section/" * 40
    long_references = [stem + "risks", stem + "milestones"]
    report_service.body = json.dumps(
        {
            "data": {"health": "green"},
            "sources": [
                {"reference": reference, "content": f"Apollo {index}."}
                for index, reference in enumerate([*long_references, "report:short"])
            ],
        }
    ).encode()

    # when a run reads it
    run = report_read(demo, report_service)

    # then each long reference keeps its start and a digest of the whole, within the column,
    # the same in the Source rows, the envelope and the event; a short one is kept as it is
    kept = [
        stem[:286] + "…#" + hashlib.sha256(reference.encode()).hexdigest()[:12]
        for reference in long_references
    ] + ["report:short"]
    assert all(len(reference) <= 300 for reference in kept)
    assert len(set(kept)) == 3
    record = ToolCall.objects.get(run=run, name="report_read")
    references = Source.objects.filter(tool_call=record).values_list("reference", flat=True)
    assert sorted(references) == sorted(kept)
    assert [item["reference"] for item in record.envelope["sources"]] == kept
    assert events_of(run, "tool.completed")[0]["sources"] == kept


def project_search_served_by(demo, url: str) -> None:
    """weekly-summary 3.3.0 pins project_search 2.1.0: the seeded contract, answered by the
    service at `url`."""
    seeded = seeded_tool(demo, "project_search")
    content = {field: getattr(seeded, field) for field in TOOL_CONTENT_FIELDS}
    content |= {"adapter_kind": AdapterKind.HTTP, "adapter_config": {"url": url}}
    publish_skill(
        demo,
        "weekly-summary",
        "3.3.0",
        tool_versions=[
            publish_tool(demo, "project_search", "2.1.0", **content),
            seeded_tool(demo, "directory_lookup"),
            seeded_tool(demo, "mail_send"),
        ],
    )


def approved_http_send(demo, report_service, monkeypatch) -> tuple[Run, Any, ToolVersion]:
    """The running example's send, approved by bob, made through the HTTP mail service
    `report_service` (its tool version, frozen for the run, switched to the HTTP adapter)."""
    run, action = waiting_run(demo)
    services.approval_decide(
        action_id=action.pk,
        approver=get_user_model().objects.get(username="bob"),
        decision=Decision.APPROVE,
        payload_hash=action.payload_hash,
    )
    [mail_send] = versions_frozen(model=ToolVersion, ids=[action.tool_version_id]).values()
    monkeypatch.setattr(mail_send, "adapter_kind", AdapterKind.HTTP)
    monkeypatch.setattr(mail_send, "adapter_config", {"url": report_service.url})
    return run, action, mail_send


def drafting_model(fake_model, *, risks: list[dict]) -> dict:
    """A model that reads apollo, then drafts with `risks` (again when told the draft misses
    its contract); returns the draft."""
    fake = fake_model()
    fake.reply(read_apollo())
    draft = apollo_draft(progress=[], next_steps=[], risks=risks)
    fake.reply(openai_completion(content=json.dumps(draft)))
    fake.reply(openai_completion(content=json.dumps(draft)))
    return draft


LONG_REFERENCE = "report:apollo/" + "section/" * 40 + "risks"


@pytest.mark.parametrize(
    ("cited", "status"),
    [
        (LONG_REFERENCE, "WAITING_APPROVAL"),
        (LONG_REFERENCE[:-5] + "milestones", "PARTIAL"),
        (source_reference(LONG_REFERENCE), "WAITING_APPROVAL"),
    ],
    ids=["as-the-service-gave-it", "one-the-service-never-gave", "as-the-run-keeps-it"],
)
def test_a_weekly_summary_may_cite_a_long_reference_as_the_service_gave_it(
    demo, report_service, fake_model, cited, status
):
    # given project_search served over HTTP, answering without `data`: the envelope shows
    # the model the whole answer, its long reference as the service gave it
    project_search_served_by(demo, report_service.url)
    report_service.body = json.dumps(
        {
            "business_status": "ok",
            "sources": [{"reference": LONG_REFERENCE, "content": "The vendor SDK slips."}],
        }
    ).encode()
    drafting_model(fake_model, risks=[{"text": "Vendor SDK slips", "source": cited}])
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then a draft citing the run's Source, by its reference whole or as the run keeps it,
    # waits for its approval, its risk citing the Source; one citing a reference no tool
    # returned is refused
    run.refresh_from_db()
    record = ToolCall.objects.get(run=run, name="project_search")
    assert record.envelope["raw"]["sources"][0]["reference"] == LONG_REFERENCE
    (source,) = Source.objects.filter(tool_call=record)
    assert source.reference == source_reference(LONG_REFERENCE)
    assert run.status == status, run.result
    if status == "WAITING_APPROVAL":
        assert run.state["draft"]["risks"] == [
            {"text": "Vendor SDK slips", "source": source.reference}
        ]
    else:
        assert run.result["output"] == {"problems": ["Risk 1 has no source returned by a tool."]}


def apollo_report(business_status: str) -> bytes:
    """project_search's answer over HTTP: apollo's week with the evidence it rests on, under
    `business_status`."""
    monday, sunday = this_week()
    return json.dumps(
        {
            "business_status": business_status,
            "data": {
                "project": "apollo",
                "name": "Project Apollo",
                "from": monday,
                "to": sunday,
                "tasks": [
                    {
                        "title": "API gateway migration",
                        "status": "done",
                        "detail": "",
                        "date": monday,
                        "source": "report:apollo/gateway",
                    }
                ],
                "milestones": [],
                "risks": [
                    {
                        "title": "Vendor SDK delay",
                        "status": "open",
                        "detail": "The payments SDK slips by a week.",
                        "date": monday,
                        "source": "report:apollo/sdk",
                    }
                ],
            },
            "sources": [
                {"reference": "report:apollo/gateway", "content": "API gateway migration done."},
                {"reference": "report:apollo/sdk", "content": "The payments SDK slips."},
            ],
        }
    ).encode()


@pytest.mark.parametrize("business_status", ["ok", "refused"])
def test_a_weekly_summary_rests_only_on_what_project_search_answered_with_success(
    demo, report_service, fake_model, business_status
):
    # given project_search served over HTTP, answering 200 with apollo's week and its
    # sources under `business_status`, and a model that drafts citing one of them
    project_search_served_by(demo, report_service.url)
    report_service.body = apollo_report(business_status)
    draft = drafting_model(
        fake_model, risks=[{"text": "Vendor SDK slips", "source": "report:apollo/sdk"}]
    )
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then a success's sources are the run's evidence and the draft citing one waits for its
    # approval; a refusal's are no evidence: its answer is kept in the call's envelope only,
    # and the run ends with no evidence, no draft put before anyone
    run.refresh_from_db()
    record = ToolCall.objects.get(run=run, name="project_search")
    assert record.status == "completed"
    assert record.envelope["business_status"] == business_status
    assert record.envelope["raw"]["risks"][0]["source"] == "report:apollo/sdk"
    kept = sorted(Source.objects.filter(tool_call=record).values_list("reference", flat=True))
    if business_status == "ok":
        assert kept == ["report:apollo/gateway", "report:apollo/sdk"]
        assert run.status == "WAITING_APPROVAL", run.result
        assert run.state["draft"]["risks"] == draft["risks"]
    else:
        assert kept == []
        assert record.envelope["sources"] == []
        assert (run.status, run.reason_code) == ("FAILED_FINAL", "NO_EVIDENCE")
        assert "draft.created" not in event_types(run)
        assert "approval.required" not in event_types(run)
        assert not [s for s in run.result["sources"] if s["reference"].startswith("report:")]


def test_a_refusal_too_large_for_its_envelope_is_no_evidence_either(
    demo, report_service, fake_model, settings
):
    # given project_search answering 200 with a refusal far larger than an envelope may
    # carry (a success's whole answer would stay as a Source of its own)
    project_search_served_by(demo, report_service.url)
    rows = [{"row": index, "text": f"line {index} " + "x" * 40} for index in range(900)]
    report_service.body = json.dumps(
        {"business_status": "refused", "data": {"rows": rows}}
    ).encode()
    drafting_model(fake_model, risks=[{"text": "Rows", "source": "tool-result:call_read"}])
    run = demo_run(demo, project_id="apollo")

    # when the model drafts citing the whole answer's reference
    run_execute(run_id=str(run.pk))

    # then the envelope is cut to size, and the run has no evidence
    run.refresh_from_db()
    record = ToolCall.objects.get(run=run, name="project_search")
    assert envelope_size(record.envelope) <= settings.TOOL_RESULT_MAX_BYTES
    assert not Source.objects.filter(tool_call=record).exists()
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "NO_EVIDENCE")


NOTHING_TO_REPORT = {"answer": "The tools returned nothing to report on."}


@pytest.mark.parametrize(
    ("status", "business_status"),
    [(200, "ok"), (200, "refused"), (400, "ok")],
    ids=["success", "business-refusal", "failed-call"],
)
def test_the_offline_planner_drafts_only_from_what_a_tool_answered_with_success(
    demo, report_service, status, business_status
):
    # given the weekly summary on the offline planner, project_search served over HTTP
    # answering apollo's week with its sources: with success, as a business refusal, or
    # with an error status
    project_search_served_by(demo, report_service.url)
    report_service.status = status
    report_service.body = apollo_report(business_status)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then it drafts from a success; a refusal it reads as a failed call: it has nothing
    # to report on, and the run ends with no evidence
    run.refresh_from_db()
    (result,) = [entry for entry in run.transcript if entry["kind"] == "tool_result"]
    last_word = json.loads(run.transcript[-1]["text"])
    if (status, business_status) == (200, "ok"):
        assert result["is_error"] is False
        assert run.status == "WAITING_APPROVAL", run.result
        assert last_word["risks"] == [
            {
                "text": "Vendor SDK delay: The payments SDK slips by a week.",
                "source": "report:apollo/sdk",
            }
        ]
    else:
        assert result["is_error"] is True
        assert last_word == NOTHING_TO_REPORT
        assert (run.status, run.reason_code) == ("FAILED_FINAL", "NO_EVIDENCE")
