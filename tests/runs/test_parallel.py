"""Independent read calls of one model turn run in parallel, on the calling thread and the
executor's thread pool (each pool thread on its own database connection), and their results
stay paired with their call ids."""

import json
import threading
import time

import pytest

from examples import handlers
from registry.models import ToolVersion
from runs.loop import run_execute
from runs.models import ToolCall
from runs.tools import adapters, limits, threads
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
    ran = {}
    execute = adapters.execute
    # Each read waits until the other has started: the step ends only if they overlap.
    both_started = threading.Barrier(2, timeout=10)

    def recording(tool_version, context, arguments):
        ran[context.call_id] = threading.current_thread().name
        if context.call_id in {"call_week", "call_monday"}:
            both_started.wait()
        return execute(tool_version, context, arguments)

    monkeypatch.setattr(adapters, "execute", recording)
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert ran["host-recipient"] == threading.main_thread().name
    # the calling thread took one read and a thread of the pool the other
    ran_on = sorted([ran["call_week"], ran["call_monday"]])
    assert ran_on[0] == threading.main_thread().name
    assert ran_on[1].startswith("tool-call")
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


def test_no_more_items_run_at_once_than_the_cap_and_results_keep_their_order():
    running, most = 0, 0
    lock = threading.Lock()
    # The first three items pass only together: the cap of 3 is reached, not just allowed.
    first_three = threading.Barrier(3, timeout=10)

    def slow_square(number):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        if number < 3:
            first_three.wait()
        time.sleep(0.02)
        with lock:
            running -= 1
        return number * number

    assert threads.parallel_map(slow_square, range(7), workers=3) == [0, 1, 4, 9, 16, 25, 36]
    assert most == 3


def test_no_items_no_results():
    assert threads.parallel_map(str, [], workers=4) == []


def test_an_item_that_raised_raises_once_every_item_has_run():
    finished = []

    def fails_on_one(number):
        if number == 1:
            raise ValueError("one")
        time.sleep(0.05)
        finished.append(number)
        return number

    with pytest.raises(ValueError, match="one"):
        threads.parallel_map(fails_on_one, range(4), workers=4)
    assert sorted(finished) == [0, 2, 3]


def search_calls(count: int) -> tuple:
    monday, sunday = this_week()
    arguments = json.dumps({"project_id": "apollo", "from": monday, "to": sunday})
    return tuple((f"call_{n}", "project_search", arguments) for n in range(count))


def test_more_reads_in_one_turn_than_the_tool_s_cap_all_run_in_turn(
    demo, fake_model, monkeypatch, settings
):
    """The fifth call of a turn under a cap of 4 was refused, and so were its retries, since
    its siblings gave their slots back only once the whole turn had run."""
    settings.TOOL_PARALLELISM = 8
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=search_calls(6)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    running, most = set(), []
    execute, lock = adapters.execute, threading.Lock()

    def counted(tool_version, context, arguments):
        with lock:
            running.add(context.call_id)
            most.append(len(running))
        try:
            time.sleep(0.05)
            return execute(tool_version, context, arguments)
        finally:
            with lock:
                running.discard(context.call_id)

    monkeypatch.setattr(adapters, "execute", counted)
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    calls = ToolCall.objects.filter(run=run, call_id__startswith="call_")
    assert sorted(calls.values_list("status", "attempts")) == [("completed", 1)] * 6
    cap = ToolVersion.objects.get(pk=calls.first().tool_version_id).concurrency_cap
    assert max(most) == cap == 4


def test_a_call_waiting_for_a_thread_enters_its_limits_when_it_starts(
    demo, fake_model, monkeypatch, settings
):
    """A round enters its calls' slots just before they start: a call queued behind the
    threads no longer runs on a slot counted from the step's start, which could lapse."""
    settings.TOOL_PARALLELISM = 1
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=search_calls(3)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    entered, calls_enter = [], limits.calls_enter

    def counted(tool_versions, *, tenant_id):
        entered.append(len(tool_versions))
        return calls_enter(tool_versions, tenant_id=tenant_id)

    monkeypatch.setattr(limits, "calls_enter", counted)
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    assert entered[-3:] == [1, 1, 1]
    assert ToolCall.objects.filter(run=run, status="completed").count() == 4


def test_a_call_whose_turn_comes_after_the_step_s_time_is_not_started(
    demo, fake_model, monkeypatch, settings
):
    """A round of calls started whenever the one before ended, even past the step's time,
    where Celery would stop the step mid-call and lose its work."""
    # given a step with 2 s before its task's soft time limit, one call at a time, and three
    # reads of one turn, the first of which takes 2.5 s
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    settings.TOOL_PARALLELISM = 1
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=search_calls(3)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    called, execute = [], adapters.execute

    def slow_first(tool_version, context, arguments):
        called.append(context.call_id)
        output = execute(tool_version, context, arguments)
        if context.call_id == "call_0":
            time.sleep(2.5)
        return output

    monkeypatch.setattr(adapters, "execute", slow_first)
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the first read ran; the two whose turn came after the step's time were never
    # called, and failed TIMEOUT as calls another try may pass, with nothing done
    assert [call for call in called if call.startswith("call_")] == ["call_0"]
    calls = {
        call.call_id: call for call in ToolCall.objects.filter(run=run, call_id__startswith="call_")
    }
    assert (calls["call_0"].status, calls["call_0"].attempts) == ("completed", 1)
    for late in (calls["call_1"], calls["call_2"]):
        assert (late.status, late.error_category, late.attempts) == ("failed", "TIMEOUT", 0)
        assert (late.envelope["retryable"], late.envelope["may_have_side_effect"]) == (True, False)


@pytest.mark.parametrize(
    "broken",
    [
        lambda monkeypatch: monkeypatch.delattr(handlers, "project_search"),
        lambda monkeypatch: monkeypatch.setattr(
            handlers.ProjectSearch, "authorize", lambda *args: {}["bug"]
        ),
    ],
    ids=["handler-not-installed", "authorize-raises"],
)
def test_a_handler_whose_check_fails_refuses_its_call_and_the_run_goes_on(
    demo, monkeypatch, broken
):
    """Before, the error left the step, which was retried until STEP_FAILED."""
    broken(monkeypatch)
    run = demo_run(demo, project_id="apollo")

    run_execute(run_id=str(run.pk))

    call = ToolCall.objects.get(run=run, name="project_search")
    assert (call.status, call.error_category) == ("rejected", "UNKNOWN")
    run.refresh_from_db()
    assert run.status not in ("RUNNING", "QUEUED")
    assert run.reason_code != "STEP_FAILED"
