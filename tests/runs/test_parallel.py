"""Independent read calls of one model turn run in parallel on the executor's thread pool,
each on its own database connection, and their results stay paired with their call ids."""

import json
import threading

import pytest

from registry.models import ToolVersion
from runs.loop import run_execute
from runs.models import ToolCall
from runs.tools import adapters, limits
from tests.runs.conftest import apollo_draft, demo_run, this_week
from tests.runs.fake_provider import openai_completion

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_reads_of_one_turn_run_in_parallel_and_answer_in_order(demo, fake_model, monkeypatch):
    fake = fake_model()
    monday, sunday = this_week()
    both = (
        (
            "call_week",
            "project_search",
            json.dumps({"project_id": "apollo", "from": monday, "to": sunday}),
        ),
        (
            "call_monday",
            "project_search",
            json.dumps({"project_id": "apollo", "from": monday, "to": monday}),
        ),
    )
    fake.reply(openai_completion(tool_calls=both))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    threads = {}
    execute = adapters.execute

    def recording(tool_version, context, arguments):
        threads[context.call_id] = threading.current_thread().name
        return execute(tool_version, context, arguments)

    monkeypatch.setattr(adapters, "execute", recording)
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert threads["host-recipient"] == threading.main_thread().name
    assert threads["call_week"].startswith("tool-call")
    assert threads["call_monday"].startswith("tool-call")
    results = [entry for entry in run.transcript if entry["kind"] == "tool_result"]
    assert [entry["call_id"] for entry in results] == ["call_week", "call_monday"]
    calls = {call.call_id: call for call in ToolCall.objects.filter(run=run, step=1)}
    assert calls["call_week"].status == calls["call_monday"].status == "completed"
    assert calls["call_week"].envelope["normalized"]["updates"] == 4
    assert calls["call_monday"].envelope["normalized"]["updates"] == 1


def test_a_handler_that_raises_fails_its_call_the_run_goes_on_and_no_slot_stays_held(
    demo, fake_model, monkeypatch, caplog
):
    # given two reads of one turn, one of whose handlers has a bug
    fake = fake_model()
    monday, sunday = this_week()
    both = tuple(
        (call_id, "project_search", json.dumps({"project_id": "apollo", "from": monday, "to": day}))
        for call_id, day in (("call_week", sunday), ("call_monday", monday))
    )
    fake.reply(openai_completion(tool_calls=both))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    execute = adapters.execute

    def failing_on_monday(tool_version, context, arguments):
        if context.call_id == "call_monday":
            raise RuntimeError("the handler has a bug: token sk-live-0123456789abcdef")
        return execute(tool_version, context, arguments)

    monkeypatch.setattr(adapters, "execute", failing_on_monday)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then that call failed (its handler's message kept out of the record), the other ran,
    # and the run went on to its draft
    calls = {call.call_id: call for call in ToolCall.objects.filter(run=run, step=1)}
    assert (calls["call_monday"].status, calls["call_monday"].error_category) == (
        "failed",
        "UNKNOWN",
    )
    assert calls["call_monday"].envelope["error"]["message"] == (
        "The handler of project_search@2.0.0 failed unexpectedly."
    )
    assert calls["call_week"].status == "completed"
    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    # the log says which exception and where, never what it said
    assert "project_search@2.0.0: the handler raised RuntimeError at " in caplog.text
    assert "sk-live-0123456789abcdef" not in caplog.text
    # and every slot of the step was given back
    project_search = ToolVersion.objects.get(
        pk=next(tool["id"] for tool in run.capability["tools"] if tool["name"] == "project_search")
    )
    entered = limits.calls_enter(
        [project_search] * project_search.concurrency_cap, tenant_id=run.tenant_id
    )
    assert all(isinstance(each, limits.Passage) for each in entered), entered
