"""What a tool or a model sends is kept in a form PostgreSQL stores, whatever it is: NUL
characters, unpaired surrogates, numbers JSON has no spelling for, objects JSON has no type
for, and nesting deeper than a run keeps. Before, each of these broke the step's write (or
its walk over the data) with an exception, so the step was retried and its tool calls made
again."""

import dataclasses
import datetime
import decimal
import json
from collections.abc import Callable

import pytest

from config.jsontext import MAX_DEPTH, TOO_DEEP
from registry.choices import ModelProvider
from runs.loop import run_execute
from runs.models import Run, RunEvent, ToolCall
from runs.tools import adapters
from tests.runs.conftest import apollo_draft, demo_run, this_week
from tests.runs.fake_provider import anthropic_message, openai_completion

pytestmark = pytest.mark.django_db(transaction=True)


def _nested(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"next": [value]}
    return value


def _read_call(call_id: str = "call_week") -> tuple[str, str, str]:
    monday, sunday = this_week()
    return (
        call_id,
        "project_search",
        json.dumps({"project_id": "apollo", "from": monday, "to": sunday}),
    )


def _run_answering(demo, fake_model, monkeypatch, answers: dict[str, Callable]) -> Run:
    """A run whose model reads apollo's week once per call id of `answers`, then drafts; what
    the tool answers each of those calls goes through its function first."""
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=tuple(_read_call(call_id) for call_id in answers)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    execute = adapters.execute

    def answering(tool_version, context, arguments):
        output = execute(tool_version, context, arguments)
        return answers[context.call_id](output) if context.call_id in answers else output

    monkeypatch.setattr(adapters, "execute", answering)
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    run.refresh_from_db()
    return run


@pytest.mark.parametrize(
    ("returned", "kept"),
    [
        ({"text": "a\x00b", "k\x00": 1}, {"text": "a\ufffdb", "k\ufffd": 1}),
        ({"text": "a\ud800b"}, {"text": "a\ufffdb"}),
        ({"x": float("nan"), "y": float("-inf")}, {"x": None, "y": None}),
        (
            {"at": datetime.datetime(2026, 12, 2, 9, 30), "cost": decimal.Decimal("1.50")},
            {"at": "2026-12-02T09:30:00", "cost": "1.50"},
        ),
        (
            {"ids": {7}, "pair": (1, "two"), (1, 2): "tuple key"},
            {"ids": [7], "pair": [1, "two"], "(1, 2)": "tuple key"},
        ),
        ({"blob": b"\x00\xff"}, {"blob": "b'\\x00\\xff'"}),
    ],
    ids=["nul", "surrogate", "not-finite", "time-and-decimal", "set-tuple-and-tuple-key", "bytes"],
)
def test_a_tool_output_postgresql_would_refuse_is_kept_storable_and_the_run_goes_on(
    demo, fake_model, monkeypatch, returned, kept
):
    run = _run_answering(
        demo,
        fake_model,
        monkeypatch,
        {"call_week": lambda output: dataclasses.replace(output, raw={"odd": returned})},
    )

    assert run.status == "WAITING_APPROVAL"
    call = ToolCall.objects.get(run=run, call_id="call_week")
    assert call.status == "completed"
    assert call.envelope["raw"] == {"odd": kept}


def test_a_tool_output_nested_deeper_than_a_run_keeps_is_cut_at_that_depth(
    demo, fake_model, monkeypatch
):
    run = _run_answering(
        demo,
        fake_model,
        monkeypatch,
        {"call_week": lambda output: dataclasses.replace(output, raw=_nested(600))},
    )

    assert run.status == "WAITING_APPROVAL"
    raw = ToolCall.objects.get(run=run, call_id="call_week").envelope["raw"]
    # each step down is an object and an array: the value at depth MAX_DEPTH stands for the rest
    for _ in range(MAX_DEPTH // 2 - 1):
        raw = raw["next"][0]
    assert raw == {"next": [TOO_DEEP]}


def test_openai_output_with_nul_and_arguments_nested_too_deep_for_json_is_kept(demo, fake_model):
    fake = fake_model()
    deep_arguments = "[" * 3000 + "]" * 3000
    fake.reply(
        openai_completion(
            content="Looking\x00 it up.",
            tool_calls=(("call\x00deep", "project_search", deep_arguments), _read_call()),
        )
    )
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    responded = RunEvent.objects.filter(run=run, type="model.responded").order_by("seq").first()
    assert responded.payload["text"] == "Looking\ufffd it up."
    deep = next(call for call in responded.payload["tool_calls"] if call.get("provider_call_id"))
    assert deep["provider_call_id"] == "call\ufffddeep"
    rejected = ToolCall.objects.get(run=run, call_id=deep["call_id"])
    assert (rejected.status, rejected.error_category) == ("rejected", "INVALID_ARGUMENT")
    assert rejected.arguments == deep_arguments
    assert ToolCall.objects.get(run=run, call_id="call_week").status == "completed"


def test_anthropic_arguments_nested_deeper_than_a_run_keeps_are_refused(demo, fake_model):
    fake = fake_model(ModelProvider.ANTHROPIC)
    monday, sunday = this_week()
    deep = {"project_id": "apollo", "more": _nested(100)}
    week = {"project_id": "apollo", "from": monday, "to": sunday}
    calls = (("toolu_deep", "project_search", deep), ("toolu_read", "project_search", week))
    fake.reply(anthropic_message(tool_uses=calls))
    fake.reply(anthropic_message(text=json.dumps(apollo_draft())))

    run_execute(run_id=str(demo_run(demo, project_id="apollo").pk))

    rejected = ToolCall.objects.get(call_id="toolu_deep")
    assert rejected.run.status == "WAITING_APPROVAL"
    assert (rejected.status, rejected.error_category) == ("rejected", "INVALID_ARGUMENT")
    assert rejected.arguments == TOO_DEEP


def test_a_draft_nested_too_deep_is_sent_back_for_a_correction(demo, fake_model):
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(_read_call(),)))
    fake.reply(openai_completion(content="[" * 3000 + "]" * 3000))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert run.state["corrections"] == 1


@pytest.mark.parametrize(
    "answer",
    [
        None,
        {"business_status": "ok"},
        adapters.ToolOutput(business_status=None, raw={}),
        adapters.ToolOutput(business_status="ok", raw={}, sources=[{"reference": "r"}]),
    ],
    ids=["none", "dict", "status-not-text", "sources-not-drafts"],
)
def test_a_handler_answer_that_is_not_a_tool_output_fails_its_call_and_the_run_goes_on(
    demo, fake_model, monkeypatch, answer
):
    run = _run_answering(
        demo,
        fake_model,
        monkeypatch,
        {"call_odd": lambda output: answer, "call_week": lambda output: output},
    )

    assert run.status == "WAITING_APPROVAL"
    odd = ToolCall.objects.get(run=run, call_id="call_odd")
    assert (odd.status, odd.error_category) == ("failed", "UNKNOWN")
    assert ToolCall.objects.get(run=run, call_id="call_week").status == "completed"


def test_a_draft_whose_json_escapes_a_nul_is_kept_storable(demo, fake_model):
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(_read_call(),)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft(subject="Weekly\x00 status"))))
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert run.state["draft"]["subject"] == "Weekly\ufffd status"
