"""Answers a real provider, a compatible server or a gateway may give, each through a governed
run against the fake provider over HTTP: every one ends the step as DESIGN.md says (a retry, a
correction, a final status with the provider's reason), never as an exception the step cannot
place, which the task would deliver again, the provider billed each time, until STEP_FAILED."""

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from celery.exceptions import Retry
from django.contrib.auth import get_user_model
from django.db.models import F
from django.urls import reverse
from django.utils import timezone

from approvals.models import BusinessAction
from registry.choices import ModelProvider
from registry.models import AgentConfig, ModelConfig
from registry.services.common import registry_object_save
from runs import otel, quotas
from runs.loop import ModelTemporarilyUnavailable, run_execute
from runs.model_clients import anthropic_messages
from runs.model_clients.answers import MODEL_NAME_MAX_CHARS, TURN_TOKENS_MAX
from runs.models import Run, ToolCall
from runs.tasks import run_advance, runs_sweep
from tests.runs.conftest import apollo_draft, demo_run, read_apollo, this_week
from tests.runs.fake_provider import (
    API_KEY,
    CREDENTIAL_REF,
    anthropic_message,
    openai_completion,
)
from tests.runs.test_loop import context_tokens, project_assistant_on_the_demo_model

OPENAI, ANTHROPIC = ModelProvider.OPENAI_COMPATIBLE, ModelProvider.ANTHROPIC
PROXY_PAGE = b"<html><body><h1>502 Bad Gateway</h1></body></html>"


def advanced(run: Run) -> Run:
    run_execute(run_id=str(run.pk))
    return Run.objects.get(pk=run.pk)


def openai_with(**message) -> dict:
    completion = openai_completion(content="hi")
    completion["choices"][0]["message"].update(message)
    return completion


def search_call(**function) -> list[dict]:
    return [{"id": "c1", "type": "function", "function": {"name": "project_search", **function}}]


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
@pytest.mark.parametrize(
    ("content_type", "body"), [("text/html", PROXY_PAGE), ("application/json", b"")]
)
def test_a_200_that_is_not_a_json_object_is_a_retryable_model_error(
    demo, fake_model, provider, content_type, body
):
    fake_model(provider).reply(body, content_type=content_type)
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(ModelTemporarilyUnavailable, match="other than a JSON object"):
        run_execute(run_id=str(run.pk))

    assert Run.objects.get(pk=run.pk).tokens_used == 0


@pytest.mark.parametrize(
    "content_type",
    ["text/" + "x" * 5000, f"text/html {API_KEY}", "text/html\x85<!-- proxy -->"],
    ids=["long", "quoting-the-key", "control-character"],
)
def test_the_content_type_of_an_answer_that_is_not_json_is_kept_short_and_clean(
    demo, fake_model, content_type
):
    fake_model().reply(PROXY_PAGE, content_type=content_type)
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(ModelTemporarilyUnavailable) as raised:
        run_execute(run_id=str(run.pk))

    message = str(raised.value)
    assert message.startswith("OpenAI-compatible provider answered HTTP 200 with something")
    assert len(message) < 500
    assert API_KEY not in message
    assert "\x85" not in message


@pytest.mark.parametrize(
    ("reply", "arguments"),
    [
        (openai_with(content=None, tool_calls=search_call(arguments={"project_id": "x"})), None),
        (openai_with(content=None, tool_calls=search_call(arguments=None)), {}),
        (openai_with(content=None, tool_calls=search_call(arguments=[1])), "[1]"),
        (openai_with(content=None, tool_calls=search_call(name=None, arguments="{}")), {}),
    ],
    ids=["an-object", "null", "a-list", "no-name"],
)
def test_openai_call_arguments_of_any_shape_reach_the_gates(demo, fake_model, reply, arguments):
    fake = fake_model()
    fake.reply(reply)
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))

    run = advanced(demo_run(demo, project_id="apollo"))

    [call] = ToolCall.objects.filter(run=run).exclude(call_id__startswith="host-")
    expected = {"project_id": "x"} if arguments is None else arguments
    assert call.arguments == expected
    assert call.status == "rejected"
    assert run.status != "RUNNING"


@pytest.mark.parametrize(
    "reply",
    [
        openai_with(content=[{"type": "text", "text": "Not sure."}, {"type": "image"}]),
        {**openai_completion(content="Not sure."), "model": None},
        {**openai_completion(content="Not sure."), "usage": {"prompt_tokens": None}},
    ],
    ids=["content-parts", "no-model", "null-usage"],
)
def test_openai_odd_fields_are_read_as_absent(demo, fake_model, reply):
    fake = fake_model()
    fake.reply(reply)
    fake.reply(openai_completion(content="Not sure."))

    run = advanced(demo_run(demo, project_id="apollo"))

    responded = run.events.filter(type="model.responded").first().payload
    assert responded["text"] == "Not sure."
    assert run.status != "RUNNING"


@pytest.mark.parametrize(
    "reply",
    [
        {**anthropic_message(text="Not sure."), "usage": None},
        {**anthropic_message(text="Not sure."), "content": None},
        {**anthropic_message(text="Not sure."), "content": [{"type": "text", "text": None}]},
        {
            **anthropic_message(text="Not sure."),
            "content": [{"type": ["thinking"]}, {"type": "text", "text": "Not sure."}],
        },
    ],
    ids=["no-usage", "null-content", "null-text", "type-not-text"],
)
def test_anthropic_odd_fields_are_read_as_absent(demo, fake_model, reply):
    fake = fake_model(ANTHROPIC)
    fake.reply(reply)
    fake.reply(anthropic_message(text="Not sure."))

    run = advanced(demo_run(demo, project_id="apollo"))

    assert run.status != "RUNNING"
    assert run.reason_code != "STEP_FAILED"


def test_an_anthropic_tool_use_without_input_is_refused_and_the_run_goes_on(demo, fake_model):
    """Before, its null input was kept, and every try of the tool step failed to store it."""
    fake = fake_model(ANTHROPIC)
    monday, sunday = this_week()
    empty = anthropic_message(tool_uses=(("toolu_1", "project_search", {}),))
    empty["content"][0]["input"] = None
    fake.reply(empty)
    search = {"project_id": "apollo", "from": monday, "to": sunday}
    fake.reply(anthropic_message(tool_uses=(("toolu_2", "project_search", search),)))
    fake.reply(anthropic_message(text=json.dumps(apollo_draft())))

    run = advanced(demo_run(demo, project_id="apollo"))

    assert (run.status, run.reason_code) == ("WAITING_APPROVAL", "")
    first = ToolCall.objects.get(run=run, call_id="toolu_1")
    assert (first.arguments, first.status) == ({}, "rejected")


@pytest.mark.parametrize(
    "reply",
    [
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        {"error": {"message": "Rate limit reached for requests", "code": 429}},
        {"error": {"message": "Upstream failed", "code": "5" * 5000}},
    ],
    ids=["anthropic", "openai", "code-of-thousands-of-digits"],
)
def test_an_error_object_in_a_200_is_the_error_it_describes(demo, fake_model, reply):
    fake_model(ANTHROPIC if reply.get("type") else OPENAI).reply(reply)
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(ModelTemporarilyUnavailable) as raised:
        run_execute(run_id=str(run.pk))

    assert raised.value.error.retryable
    assert "answered HTTP 200 with an error" in str(raised.value)
    assert reply["error"]["message"] in str(raised.value)


def test_a_final_provider_error_keeps_the_provider_s_reason_and_never_the_key(demo, fake_model):
    reason = "This model's maximum context length is 8192 tokens."
    fake_model().reply(
        {"error": {"message": f"{reason} Key {API_KEY}.", "code": "context_length_exceeded"}},
        status=400,
    )

    run = advanced(demo_run(demo, project_id="apollo"))

    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_ERROR")
    assert run.result["output"]["status_code"] == 400
    assert reason in run.result["output"]["model_error"]
    assert API_KEY not in json.dumps(run.result)


def _without_a_turn(provider: str) -> dict:
    """An answer that bills 1200 prompt tokens and holds no turn: a Chat Completions answer
    with no choice, a Messages answer with no content list."""
    if provider == OPENAI:
        reply = openai_completion(content="unused")
        reply["choices"] = []
        reply["usage"] = {"prompt_tokens": 1200, "completion_tokens": 0}
        return reply
    reply = anthropic_message(text="unused")
    del reply["content"]
    reply["usage"] = {"input_tokens": 1200, "output_tokens": 0}
    return reply


@pytest.mark.parametrize(
    ("provider", "missing"),
    [
        (OPENAI, "OpenAI-compatible provider answered without a turn (no choice)."),
        (ANTHROPIC, "Anthropic answered without a turn (no content list)."),
    ],
    ids=["openai", "anthropic"],
)
def test_an_answer_without_a_turn_ends_the_run_and_its_tokens_are_paid_for(
    demo, fake_model, provider, missing
):
    """A provider bills the prompt of an answer it gave no turn for (a content filter's,
    say): the run, its budgets and the tenant's day count it like any turn. Both providers'
    answers end the run alike, FAILED_FINAL with MODEL_ERROR, and nothing is asked again."""
    fake = fake_model(provider)
    fake.reply(_without_a_turn(provider))
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_input=Decimal("0.50"), price_per_1k_output=Decimal("1.50")
    )

    run = advanced(demo_run(demo, project_id="apollo"))

    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_ERROR")
    assert run.result["output"] == {"model_error": missing, "status_code": None}
    finished = run.events.get(type="run.finished").payload
    assert finished == {"status": "FAILED_FINAL", "reason_code": "MODEL_ERROR"}
    assert not run.events.filter(type="model.responded").exists()
    assert len(fake.requests) == 1
    assert (run.tokens_used, run.cost) == (1200, Decimal("0.6"))
    assert quotas.tenant_cost_today(demo.acme.pk) == Decimal("0.6")
    span = run.spans.get(name="model.turn")
    assert (span.attributes["input_tokens"], Decimal(span.attributes["cost"])) == (
        1200,
        Decimal("0.6"),
    )


@pytest.mark.parametrize(
    ("prompt_tokens", "counted"),
    [(3_000_000_000, TURN_TOKENS_MAX), (2**32 + 99, TURN_TOKENS_MAX), (-5, 0)],
    ids=["past-the-column", "wrapping-int32", "negative"],
)
def test_impossible_token_counts_are_bounded(demo, fake_model, prompt_tokens, counted):
    """2**32 + 99 was stored as 100 (a 32-bit parameter wraps), 3e9 broke the step's write."""
    fake = fake_model()
    reply = openai_completion(content="Not sure.")
    reply["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 1}
    fake.reply(reply)
    for _ in range(3):
        fake.reply(openai_completion(content="Not sure."))

    run = advanced(demo_run(demo, project_id="apollo"))

    first = run.events.filter(type="model.responded").first().payload
    assert first["usage"] == {
        "input": counted,
        "cached_input": 0,
        "cache_write_input": 0,
        "output": 1,
    }
    # what the run counted of the turn: the bounded figure, or, in place of a reported 0,
    # the tokens the context builder counted in what the turn sent
    assert first["counted"] == {
        "input": counted or context_tokens(run)[0],
        "cached_input": 0,
        "cache_write_input": 0,
        "output": 1,
        "estimated": [] if counted else ["input"],
    }
    assert run.tokens_used >= counted + 1
    if counted:
        assert (run.status, run.reason_code) == ("BUDGET_EXHAUSTED", "TOKEN_BUDGET")


def test_a_turn_the_provider_reports_no_usage_of_says_what_the_run_counted_for_it(demo, fake_model):
    # given a provider that leaves `usage` out of its answers (some vLLM or proxy setups)
    fake = fake_model()
    for reply in (read_apollo(), openai_completion(content=json.dumps(apollo_draft()))):
        del reply["usage"]
        fake.reply(reply)

    # when a run's turns are answered by it
    run = advanced(demo_run(demo, project_id="apollo"))

    # then each model.responded keeps the provider's 0 and says what the run counted
    # instead, estimated, which adds up to the run's tokens
    turns = [event.payload for event in run.events.filter(type="model.responded")]
    assert run.status == "WAITING_APPROVAL"
    assert [turn["usage"] for turn in turns] == [
        {"input": 0, "cached_input": 0, "cache_write_input": 0, "output": 0}
    ] * 2
    assert [turn["counted"]["input"] for turn in turns] == context_tokens(run)
    assert all(turn["counted"]["output"] > 0 for turn in turns)
    assert [turn["counted"]["estimated"] for turn in turns] == [["input", "output"]] * 2
    assert run.tokens_used == sum(
        turn["counted"]["input"] + turn["counted"]["output"] for turn in turns
    )


def test_the_span_of_a_turn_the_provider_reports_no_usage_of_says_what_the_run_charged(
    demo, fake_model
):
    # given a provider that leaves `usage` out of its answers, on a model with prices
    fake = fake_model()
    for reply in (read_apollo(), openai_completion(content=json.dumps(apollo_draft()))):
        del reply["usage"]
        fake.reply(reply)
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_input=Decimal("0.01"), price_per_1k_output=Decimal("0.03")
    )

    # when a run's turns are answered by it
    run = advanced(demo_run(demo, project_id="apollo"))

    # then each model.turn span keeps the provider's 0 and, beside it, the tokens the run
    # counted and charged, and which were estimated, as model.responded does; so does what
    # an OTel exporter is given of it
    turns = [event.payload for event in run.events.filter(type="model.responded")]
    spans = list(run.spans.filter(name="model.turn").order_by("started_at"))
    assert len(spans) == len(turns) == 2
    for span, turn in zip(spans, turns, strict=True):
        assert (span.attributes["input_tokens"], span.attributes["output_tokens"]) == (0, 0)
        assert Decimal(span.attributes["cost"]) == Decimal(turn["cost"]) > 0
        assert {
            "input": span.attributes["counted_input_tokens"],
            "cached_input": span.attributes["counted_cached_input_tokens"],
            "cache_write_input": span.attributes["counted_cache_write_input_tokens"],
            "output": span.attributes["counted_output_tokens"],
            "estimated": span.attributes["estimated_tokens"],
        } == turn["counted"]
        exported = otel.readable(
            span, run_id=str(run.pk), sensitive=frozenset(), texts=frozenset()
        ).attributes
        assert exported["counted_input_tokens"] == turn["counted"]["input"]
        assert exported["counted_output_tokens"] == turn["counted"]["output"]
    assert run.tokens_used == sum(
        span.attributes["counted_input_tokens"] + span.attributes["counted_output_tokens"]
        for span in spans
    )


def test_a_429_s_retry_after_is_waited_for(demo, fake_model):
    fake_model().reply(
        {"error": {"message": "Slow down."}}, status=429, headers={"Retry-After": "30"}
    )
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(Retry) as retry:
        run_advance.apply(kwargs={"run_id": str(run.pk)}, retries=0, throw=True)

    assert retry.value.when >= 30


def test_a_run_waiting_longer_than_its_lease_for_a_retry_after_is_not_sent_again_meanwhile(
    demo, fake_model, settings
):
    # given a provider asking for a wait of 200 s, longer than a run's lease
    settings.RUN_LEASE_SECONDS = 120
    fake = fake_model()
    fake.reply({"error": {"message": "Slow down."}}, status=429, headers={"Retry-After": "200"})
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(Retry) as retry:
        run_advance.apply(kwargs={"run_id": str(run.pk)}, retries=0, throw=True)

    # then its lease lasts through the wait, so the sweep leaves it to its retry
    run.refresh_from_db()
    assert retry.value.when >= 200
    assert run.lease_expires_at >= timezone.now() + timedelta(seconds=200)
    # (190 s later: the lease moved back as far)
    Run.objects.filter(pk=run.pk).update(
        lease_expires_at=F("lease_expires_at") - timedelta(seconds=190)
    )
    assert runs_sweep() == 0
    assert len(fake.requests) == 1


def test_anthropic_thinking_blocks_go_back_with_their_tool_calls(demo, fake_model):
    """With extended thinking on, the Messages API refuses a turn of tool calls sent back
    without its thinking blocks, unchanged (their signature is checked)."""
    fake = fake_model(ANTHROPIC)
    monday, sunday = this_week()
    search = {"project_id": "apollo", "from": monday, "to": sunday}
    first = anthropic_message(tool_uses=(("toolu_1", "project_search", search),))
    thinking = {"type": "thinking", "thinking": "Read apollo first.", "signature": "c2lnbmVk"}
    redacted = {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"}
    first["content"][:0] = [thinking, redacted]
    fake.reply(first)
    fake.reply(anthropic_message(text=json.dumps(apollo_draft())))

    run = advanced(demo_run(demo, project_id="apollo"))

    assert run.status == "WAITING_APPROVAL"
    assistant = fake.requests[1].body["messages"][1]
    assert assistant["role"] == "assistant"
    assert [block["type"] for block in assistant["content"]] == [
        "thinking",
        "redacted_thinking",
        "tool_use",
    ]
    assert assistant["content"][:2] == [thinking, redacted]


def test_a_model_credential_missing_at_run_time_ends_the_run_final_naming_the_variable(
    demo, fake_model, monkeypatch
):
    """An operator who removed the model's key from the environment (or never set it on this
    worker) has a model error, which no retry mends: the run says which variable to set."""
    fake = fake_model()
    monkeypatch.delenv(CREDENTIAL_REF)
    run = demo_run(demo, project_id="apollo")

    run_advance.apply(kwargs={"run_id": str(run.pk)})

    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_ERROR")
    assert CREDENTIAL_REF in run.result["output"]["model_error"]
    assert run.attempts == 0
    assert fake.requests == []


@pytest.mark.parametrize(
    ("provider", "requested", "answered"),
    [
        (OPENAI, "fake-gpt", "fake-gpt-2025-01-01"),
        (ANTHROPIC, "fake-claude", "fake-claude-2025-01-01"),
    ],
)
def test_each_turn_records_the_model_that_answered_it(
    demo, fake_model, provider, requested, answered
):
    # given a model name the provider (or a gateway routing it) resolves to another model
    fake_model(provider).reply(_answer(provider, "Apollo's payments SDK slips by a week."))

    # when
    run = advanced(_ask_the_agent(demo))

    # then the audit trail and the turn's span name the model asked and the model that answered
    assert run.events.get(type="model.requested").payload["model"] == requested
    assert run.events.get(type="model.responded").payload["model"] == answered
    span = run.spans.get(name="model.turn")
    assert (span.attributes["model"], span.attributes["response_model"]) == (requested, answered)


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
def test_a_model_name_the_provider_reports_is_kept_as_long_as_a_config_s(
    demo, fake_model, provider
):
    # given a gateway that reports a model name of thousands of characters, on two lines
    reported = "gpt-" + "9" * 5000 + "\nsecond line"
    fake_model(provider).reply({**_answer(provider, "Apollo slips."), "model": reported})

    # when
    run = advanced(_ask_the_agent(demo))

    # then the turn names the model by as much of it as a model config may name one
    kept = run.events.get(type="model.responded").payload["model"]
    assert kept == reported[:MODEL_NAME_MAX_CHARS]
    assert run.status == "COMPLETED"


def _cut(provider: str, text: str) -> dict:
    """A last word the provider ended at the request's output limit."""
    if provider == OPENAI:
        reply = openai_completion(content=text)
        reply["choices"][0]["finish_reason"] = "length"
        return reply
    return {**anthropic_message(text=text), "stop_reason": "max_tokens"}


def _answer(provider: str, text: str) -> dict:
    return openai_completion(content=text) if provider == OPENAI else anthropic_message(text=text)


def _ask_the_agent(demo) -> Run:
    project_assistant_on_the_demo_model(demo)
    return demo_run(
        demo, text="What happened in Apollo?", agent="project-assistant", project_id="apollo"
    )


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
def test_an_answer_cut_at_the_output_limit_is_not_the_run_s_answer(demo, fake_model, provider):
    # given the generic agent on a model whose first answer stops at the output limit
    fake = fake_model(provider)
    fake.reply(_cut(provider, "Apollo's payments SDK slips by"))
    fake.reply(_answer(provider, "Apollo's payments SDK slips by a week."))
    run = _ask_the_agent(demo)

    # when
    run = advanced(run)

    # then the model is told once that its answer was cut, and the user gets the whole one
    assert (run.status, run.reason_code) == ("COMPLETED", "ANSWERED")
    assert run.result["output"] == {"answer": "Apollo's payments SDK slips by a week."}
    assert len(fake.requests) == 2
    told = json.dumps(fake.requests[1].body["messages"][-1])
    assert "The answer was cut off at the output limit of 2048 tokens" in told


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
def test_an_answer_cut_at_the_output_limit_twice_ends_partial(demo, fake_model, provider):
    fake = fake_model(provider)
    fake.reply(_cut(provider, "Apollo's payments SDK slips by"))
    fake.reply(_cut(provider, "Apollo's payments"))
    run = _ask_the_agent(demo)

    run = advanced(run)

    assert (run.status, run.reason_code) == ("PARTIAL", "ANSWER_CONTRACT_NOT_MET")
    assert run.result["output"] == {
        "problems": [
            "The answer was cut off at the output limit of 2048 tokens: it must fit within it."
        ]
    }
    assert len(fake.requests) == 2


def test_an_answer_cut_where_the_token_budget_ran_out_ends_the_run_budget_exhausted(
    demo, fake_model
):
    # given a token budget that leaves the agent's first turn 100 output tokens, fewer than
    # the model's limit, and a model that answers up to them
    fake = fake_model()
    fake.reply(_answer(OPENAI, "Apollo's payments SDK slips by a week."))
    probe = advanced(_ask_the_agent(demo))
    agent = AgentConfig.objects.get(name="project-assistant")
    agent.max_tokens = context_tokens(probe)[0] + 100
    registry_object_save(instance=agent, actor=demo.admin, reason="budget under test")
    fake.reply(_cut(OPENAI, "Apollo's payments SDK slips by"))
    run = demo_run(
        demo, text="What happened in Apollo?", agent="project-assistant", project_id="apollo"
    )

    # when
    run = advanced(run)

    # then the cut answer is no answer: the run's tokens ran out
    assert fake.requests[1].body["max_tokens"] == 100
    assert (run.status, run.reason_code) == ("BUDGET_EXHAUSTED", "TOKEN_BUDGET")
    assert "answer" not in run.result["output"]
    assert len(fake.requests) == 2


def _refusal(kind: str) -> dict:
    if kind == "openai-refusal-field":
        return openai_with(content=None, refusal="I can't help with that.")
    if kind == "openai-content-filter":
        reply = openai_completion(content="Apollo's payments")
        reply["choices"][0]["finish_reason"] = "content_filter"
        return reply
    return {**anthropic_message(text="Apollo's payments"), "stop_reason": "refusal"}


@pytest.mark.parametrize(
    ("kind", "provider", "stop_reason"),
    [
        ("openai-refusal-field", OPENAI, "stop"),
        ("openai-content-filter", OPENAI, "content_filter"),
        ("anthropic-refusal", ANTHROPIC, "refusal"),
    ],
)
def test_a_turn_the_model_or_its_provider_refused_ends_the_run_refused(
    demo, fake_model, kind, provider, stop_reason
):
    # given the generic agent on a model that refuses, or whose provider withholds the rest
    fake = fake_model(provider)
    fake.reply(_refusal(kind))
    fake.reply(_answer(provider, "unused"))
    run = _ask_the_agent(demo)

    # when
    run = advanced(run)

    # then the run says it was refused, is not asked again, and shows no withheld text as
    # its answer
    assert (run.status, run.reason_code) == ("REFUSED", "MODEL_REFUSED")
    assert run.result["output"] == {"stop_reason": stop_reason}
    assert len(fake.requests) == 1


def test_a_turn_anthropic_paused_is_not_the_run_s_answer(demo, fake_model):
    # given the generic agent on Claude, which pauses a long turn with what it wrote so far
    fake = fake_model(ANTHROPIC)
    fake.reply({**anthropic_message(text="Apollo's payments SDK"), "stop_reason": "pause_turn"})
    fake.reply(_answer(ANTHROPIC, "unused"))
    run = _ask_the_agent(demo)

    # when
    run = advanced(run)

    # then the unfinished turn is no answer: the run ends saying so, and may be sent again
    assert (run.status, run.reason_code) == ("FAILED_RETRYABLE", "MODEL_TURN_PAUSED")
    assert run.result["output"] == {"stop_reason": "pause_turn"}
    assert len(fake.requests) == 1


def test_a_draft_anthropic_paused_is_never_frozen_for_approval(demo, fake_model):
    # given the running example on Claude, which pauses its turn midway through the draft
    fake = fake_model(ANTHROPIC)
    monday, sunday = this_week()
    search = {"project_id": "apollo", "from": monday, "to": sunday}
    fake.reply(anthropic_message(tool_uses=(("c1", "project_search", search),)))
    paused = anthropic_message(text=json.dumps(apollo_draft(body="Progress of Apollo")))
    fake.reply({**paused, "stop_reason": "pause_turn"})

    # when
    run = advanced(demo_run(demo, project_id="apollo"))

    # then no approver is asked to approve half a draft
    assert (run.status, run.reason_code) == ("FAILED_RETRYABLE", "MODEL_TURN_PAUSED")
    assert not BusinessAction.objects.filter(run=run).exists()
    assert not run.events.filter(type__in=["draft.created", "approval.required"]).exists()
    assert len(fake.requests) == 2


def _search_cut(provider: str, call_id: str) -> dict:
    """A turn of one call to project_search that the provider ended at the output limit: its
    arguments as far as they went (OpenAI's text), or as a gateway or a streaming SDK
    parses what came (an object that reads whole)."""
    monday, sunday = this_week()
    search = {"project_id": "apollo", "from": monday, "to": sunday}
    if provider == OPENAI:
        reply = openai_completion(
            tool_calls=((call_id, "project_search", json.dumps(search)[:40]),)
        )
        reply["choices"][0]["finish_reason"] = "length"
        return reply
    reply = anthropic_message(tool_uses=((call_id, "project_search", search),))
    return {**reply, "stop_reason": "max_tokens"}


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
def test_a_call_cut_at_the_output_limit_is_not_run_and_the_model_is_told(
    demo, fake_model, provider
):
    # given a model whose first call stops at the output limit, then calls again whole
    fake = fake_model(provider)
    monday, sunday = this_week()
    search = {"project_id": "apollo", "from": monday, "to": sunday}
    fake.reply(_search_cut(provider, "cut_1"))
    if provider == OPENAI:
        fake.reply(read_apollo("whole_1"))
    else:
        fake.reply(anthropic_message(tool_uses=(("whole_1", "project_search", search),)))
    fake.reply(_answer(provider, json.dumps(apollo_draft())))

    # when
    run = advanced(demo_run(demo, project_id="apollo"))

    # then the cut call is never run, the model learns why, and the whole call is
    assert run.status == "WAITING_APPROVAL"
    assert not ToolCall.objects.filter(run=run, call_id="cut_1").exists()
    assert ToolCall.objects.get(run=run, call_id="whole_1").status == "completed"
    told = json.dumps(fake.requests[1].body["messages"])
    assert "cut off at the output limit of 2048 tokens" in told


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
def test_calls_cut_at_the_output_limit_twice_end_the_run_partial(demo, fake_model, provider):
    fake = fake_model(provider)
    fake.reply(_search_cut(provider, "cut_1"))
    fake.reply(_search_cut(provider, "cut_2"))

    run = advanced(demo_run(demo, project_id="apollo"))

    assert (run.status, run.reason_code) == ("PARTIAL", "DRAFT_CONTRACT_NOT_MET")
    assert not ToolCall.objects.filter(run=run).exclude(call_id__startswith="host-").exists()
    assert len(fake.requests) == 2


def _partly_cached(provider: str) -> dict:
    """A last word of 1000 input tokens, 800 of them read from the provider's prompt cache,
    and 100 output tokens, as each provider reports them: OpenAI counts the cached tokens
    within `prompt_tokens`, Anthropic beside `input_tokens` (cache writes too)."""
    if provider == OPENAI:
        reply = openai_completion(content="Not sure.")
        reply["usage"] = {
            "prompt_tokens": 1000,
            "completion_tokens": 100,
            "prompt_tokens_details": {"cached_tokens": 800},
        }
        return reply
    reply = anthropic_message(text="Not sure.")
    reply["usage"] = {
        "input_tokens": 150,
        "cache_creation_input_tokens": 50,
        "cache_read_input_tokens": 800,
        "output_tokens": 100,
    }
    return reply


@pytest.mark.parametrize("provider", [OPENAI, ANTHROPIC])
@pytest.mark.parametrize(
    ("cached_price", "cost"),
    [(Decimal("0.01"), Decimal("0.048")), (None, Decimal("0.12"))],
    ids=["cached-price", "no-cached-price"],
)
def test_cached_input_tokens_are_counted_and_paid_at_the_cached_price(
    demo, fake_model, provider, cached_price, cost
):
    """At 0.10 per 1k input tokens, 0.20 per 1k output tokens and `cached_price` per 1k cached
    input tokens (none: the input price), the 800 cached tokens of a turn's 1000 cost 0.008,
    or 0.08 when the config sets no cached price."""
    fake = fake_model(provider)
    fake.reply(_partly_cached(provider))
    for _ in range(3):
        fake.reply(_partly_cached(provider))
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_input=Decimal("0.10"),
        price_per_1k_cached_input=cached_price,
        price_per_1k_output=Decimal("0.20"),
    )

    run = advanced(demo_run(demo, project_id="apollo"))

    first = run.events.filter(type="model.responded").first().payload
    assert first["usage"] == {
        "input": 1000,
        "cached_input": 800,
        "cache_write_input": 50 if provider == ANTHROPIC else 0,
        "output": 100,
    }
    assert Decimal(first["cost"]) == cost
    span = run.spans.filter(name="model.turn").order_by("started_at").first()
    assert (span.attributes["input_tokens"], span.attributes["cached_input_tokens"]) == (1000, 800)
    assert Decimal(span.attributes["cost"]) == cost
    assert run.tokens_used >= 1100


@pytest.mark.parametrize(
    ("cache_write_price", "cost"),
    [(Decimal("0.125"), Decimal("0.04925")), (None, Decimal("0.048"))],
    ids=["cache-write-price", "no-cache-write-price"],
)
def test_anthropic_cache_writes_are_counted_and_paid_at_the_cache_write_price(
    demo, fake_model, client, cache_write_price, cost
):
    """At 0.10 per 1k input tokens, 0.01 per 1k cached input tokens, `cache_write_price` per
    1k tokens written to the cache (none: the input price) and 0.20 per 1k output tokens, a
    turn of 150 input tokens, 50 written to the cache, 800 read from it and 100 output tokens
    costs 0.015 + 0.00625 + 0.008 + 0.02, or 0.005 for the cache writes when the config sets
    no cache write price."""
    fake = fake_model(ANTHROPIC)
    for _ in range(4):
        fake.reply(_partly_cached(ANTHROPIC))
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_input=Decimal("0.10"),
        price_per_1k_cached_input=Decimal("0.01"),
        price_per_1k_cache_write=cache_write_price,
        price_per_1k_output=Decimal("0.20"),
    )

    run = advanced(demo_run(demo, project_id="apollo"))

    first = run.events.filter(type="model.responded").first().payload
    assert first["usage"] == {
        "input": 1000,
        "cached_input": 800,
        "cache_write_input": 50,
        "output": 100,
    }
    assert first["counted"]["cache_write_input"] == 50
    assert Decimal(first["cost"]) == cost
    span = run.spans.filter(name="model.turn").order_by("started_at").first()
    assert (
        span.attributes["cache_write_input_tokens"],
        span.attributes["counted_cache_write_input_tokens"],
    ) == (50, 50)
    assert Decimal(span.attributes["cost"]) == cost
    client.force_login(get_user_model().objects.get(username="carol"))
    page = client.get(reverse("runs:detail", args=[run.pk])).content.decode()
    assert "<td>1000 in (800 cached) (50 written to cache), 100 out</td>" in page


def test_a_run_pays_the_cache_write_price_its_snapshot_pinned(demo, fake_model):
    # given a run started while cache writes cost 0.125 per 1k tokens
    fake = fake_model(ANTHROPIC)
    for _ in range(4):
        fake.reply(_partly_cached(ANTHROPIC))
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_input=Decimal("0.10"),
        price_per_1k_cached_input=Decimal("0.01"),
        price_per_1k_cache_write=Decimal("0.125"),
        price_per_1k_output=Decimal("0.20"),
    )
    run = demo_run(demo, project_id="apollo")

    # when an admin doubles the cache write price before its first turn
    ModelConfig.objects.filter(name__startswith="fake-").update(
        price_per_1k_cache_write=Decimal("0.25")
    )
    run = advanced(run)

    # then the run pays the price it started with
    assert run.capability["model"]["price_per_1k_cache_write"] == "0.125000"
    first = run.events.filter(type="model.responded").first().payload
    assert Decimal(first["cost"]) == Decimal("0.04925")


def test_cache_writes_are_never_counted_beyond_the_input_a_turn_reports():
    # given an answer claiming more cache writes than the input tokens it can count
    message = anthropic_message(text="Not sure.")
    message["usage"] = {
        "input_tokens": 10,
        "cache_creation_input_tokens": TURN_TOKENS_MAX,
        "cache_read_input_tokens": 100,
        "output_tokens": 1,
    }

    # when the turn is read
    usage = anthropic_messages.model_response(message).usage

    # then the cache writes are what the input leaves once the cache reads are counted
    assert (usage.input_tokens, usage.cached_input_tokens, usage.cache_write_input_tokens) == (
        TURN_TOKENS_MAX,
        100,
        TURN_TOKENS_MAX - 100,
    )
