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


def test_a_call_that_raises_leaves_no_slot_of_its_step_held(demo, fake_model, monkeypatch):
    fake = fake_model()
    monday, sunday = this_week()
    both = tuple(
        (call_id, "project_search", json.dumps({"project_id": "apollo", "from": monday, "to": day}))
        for call_id, day in (("call_week", sunday), ("call_monday", monday))
    )
    fake.reply(openai_completion(tool_calls=both))
    execute = adapters.execute

    def failing_on_monday(tool_version, context, arguments):
        if context.call_id == "call_monday":
            raise RuntimeError("the handler has a bug")
        return execute(tool_version, context, arguments)

    monkeypatch.setattr(adapters, "execute", failing_on_monday)
    run = demo_run(demo, project_id="apollo")

    with pytest.raises(RuntimeError, match="the handler has a bug"):
        run_execute(run_id=str(run.pk))

    project_search = ToolVersion.objects.get(
        pk=next(tool["id"] for tool in run.capability["tools"] if tool["name"] == "project_search")
    )
    entered = limits.calls_enter(
        [project_search] * project_search.concurrency_cap, tenant_id=run.tenant_id
    )
    assert all(isinstance(each, limits.Passage) for each in entered), entered
