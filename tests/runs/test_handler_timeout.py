"""A Python tool handler answers within its tool version's timeout, or its call fails TIMEOUT
and the run goes on: the handler is abandoned on its thread, which no later call reuses, and
what it returns later is dropped (DESIGN.md, gate 6)."""

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from examples.handlers import directory_lookup, project_search
from registry.choices import AdapterKind, Risk
from registry.models import Tenant, Tool, ToolVersion
from registry.services.tools import TOOL_CONTENT_FIELDS
from runs.loop import run_execute
from runs.models import Run, RunEvent, Source, ToolCall
from runs.tools import adapters, limits, threads
from runs.tools.adapters import ToolContext, ToolFailed, ToolOutput
from runs.tools.envelope import ErrorCategory
from tests.runs.conftest import apollo_draft, demo_run, this_week
from tests.runs.fake_provider import openai_completion
from tests.runs.test_loop import (
    assert_terminal,
    budgets,
    project_assistant_on_the_demo_model,
    publish_skill,
    publish_tool,
    seeded_tool,
)

# How long a hanging handler waits at most, should a test never release it.
HANG_MAX_SECONDS = 30
# How many times each call id still hangs before it answers.
HANGS: Counter = Counter()
RELEASED = threading.Event()
RETURNED: list[str] = []


def _hang_if_asked(context: ToolContext) -> None:
    if HANGS[context.call_id] > 0:
        HANGS[context.call_id] -= 1
        RELEASED.wait(HANG_MAX_SECONDS)
        RETURNED.append(context.call_id)


class SlowProjectSearch:
    """project_search's own handler, which hangs for the call ids in HANGS."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        project_search.authorize(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        _hang_if_asked(context)
        return project_search(context, arguments)


class SlowWrite:
    """A tool that changes something, and hangs for the call ids in HANGS."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        return None

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        _hang_if_asked(context)
        return ToolOutput(business_status="ok", raw={"written": True})


class SlowToAuthorise:
    """project_search's own handler, whose authorisation check (gate 3) hangs for the call
    ids in HANGS, as a check that asks a slow service would."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _hang_if_asked(context)
        project_search.authorize(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        return project_search(context, arguments)


class SlowDirectoryLookup:
    """directory_lookup's own handler, whose authorisation check (gate 3) hangs for the call
    ids in HANGS."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _hang_if_asked(context)
        directory_lookup.authorize(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        return directory_lookup(context, arguments)


slow_project_search = SlowProjectSearch()
slow_write = SlowWrite()
slow_to_authorise = SlowToAuthorise()
slow_directory_lookup = SlowDirectoryLookup()


def _abandoned_handlers_end() -> None:
    deadline = time.monotonic() + 10
    while threads.abandoned_count() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threads.abandoned_count() == 0


@pytest.fixture
def hanging() -> Iterator[Counter]:
    HANGS.clear()
    RETURNED.clear()
    RELEASED.clear()
    yield HANGS
    RELEASED.set()
    _abandoned_handlers_end()
    HANGS.clear()


@pytest.fixture
def retry_policy() -> dict[str, Any]:
    return {"max_attempts": 1}


@pytest.fixture
def slow_reads(demo, hanging, retry_policy) -> ToolVersion:
    """weekly-summary 3.3.0 pins project_search 2.1.0: the same tool with a 1 s timeout and
    `retry_policy`, whose handler hangs when asked."""
    return _project_search_pinned(demo, handler="slow_project_search", retry_policy=retry_policy)


@pytest.fixture
def slow_check(demo, hanging) -> ToolVersion:
    """As `slow_reads`, with a handler whose authorisation check hangs when asked."""
    return _project_search_pinned(
        demo, handler="slow_to_authorise", retry_policy={"max_attempts": 1}
    )


def _project_search_pinned(
    demo, *, handler: str, retry_policy: dict[str, Any], timeout_s: int = 1
) -> ToolVersion:
    seeded = seeded_tool(demo, "project_search")
    content = {field: getattr(seeded, field) for field in TOOL_CONTENT_FIELDS}
    content |= {
        "adapter_config": {"handler": f"{__name__}.{handler}"},
        "timeout_s": timeout_s,
        "retry_policy": retry_policy,
    }
    slow = publish_tool(demo, "project_search", "2.1.0", **content)
    publish_skill(
        demo,
        "weekly-summary",
        "3.3.0",
        tool_versions=[slow, seeded_tool(demo, "directory_lookup"), seeded_tool(demo, "mail_send")],
    )
    return slow


def week_search(call_id: str) -> tuple[str, str, str]:
    monday, sunday = this_week()
    arguments = {"project_id": "apollo", "from": monday, "to": sunday}
    return call_id, "project_search", json.dumps(arguments)


def _search_twice_the_first_hanging(demo, fake_model):
    """A run whose model calls project_search (call_slow, which hangs once), calls it again
    in its next turn (call_week), then drafts: the run as it is once executed, the fake
    model and how long the execution took."""
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(tool_calls=(week_search("call_week"),)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    HANGS["call_slow"] = 1
    run = demo_run(demo, project_id="apollo")
    started = time.monotonic()
    run_execute(run_id=str(run.pk))
    return run, fake, time.monotonic() - started


@pytest.mark.django_db(transaction=True)
def test_a_handler_past_its_timeout_fails_its_call_timeout_and_the_run_goes_on(
    demo, fake_model, slow_reads, caplog
):
    # given a model that calls project_search, whose handler hangs, then calls it again in
    # its next turn, then drafts; when the run executes
    name = slow_reads.qualified_name
    run, fake, elapsed = _search_twice_the_first_hanging(demo, fake_model)

    # then the hanging call failed TIMEOUT once its second was up, retryable, with no side
    # effect (a read), and the run went on to its draft
    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    assert elapsed < 5
    slow = ToolCall.objects.get(run=run, call_id="call_slow")
    assert (slow.status, slow.error_category, slow.attempts) == ("failed", "TIMEOUT", 1)
    assert 1000 <= slow.duration_ms < 2000
    assert slow.envelope["error"] == {
        "category": "TIMEOUT",
        "message": f"The handler of {name} did not answer within 1 s.",
    }
    assert (slow.envelope["retryable"], slow.envelope["may_have_side_effect"]) == (True, False)
    assert slow.envelope["business_status"] == "failed"
    # and the model's next turn got the error with the call's id
    answered = [
        message
        for message in fake.requests[1].body["messages"]
        if message["role"] == "tool" and message["tool_call_id"] == "call_slow"
    ]
    assert len(answered) == 1 and "TIMEOUT" in answered[0]["content"]
    # and the call of the next step ran on another thread and answered
    week = ToolCall.objects.get(run=run, call_id="call_week")
    assert (week.status, week.attempts) == ("completed", 1)
    # and the log says which handler was abandoned
    assert f"{name}: the handler did not answer within 1 s and was abandoned" in caplog.text
    # and the tool's slots are all free again
    entered = limits.calls_enter([slow_reads] * slow_reads.concurrency_cap, tenant_id=run.tenant_id)
    assert all(isinstance(each, limits.Passage) for each in entered), entered
    limits.calls_leave([(passage, None) for passage in entered])

    # when the abandoned handler returns at last
    events = list(RunEvent.objects.filter(run=run).values_list("seq", "type"))
    sources = set(Source.objects.filter(run=run).values_list("pk", flat=True))
    RELEASED.set()
    _abandoned_handlers_end()

    # then its answer was dropped: nothing about the run changed
    assert RETURNED == ["call_slow"]
    slow.refresh_from_db()
    assert (slow.status, slow.error_category) == ("failed", "TIMEOUT")
    assert list(RunEvent.objects.filter(run=run).values_list("seq", "type")) == events
    assert set(Source.objects.filter(run=run).values_list("pk", flat=True)) == sources


@pytest.mark.django_db(transaction=True)
def test_an_authorisation_check_past_the_tool_s_timeout_rejects_its_call_and_the_run_goes_on(
    demo, fake_model, slow_check, caplog
):
    # given a model that calls project_search, whose authorisation check (gate 3) hangs,
    # then calls it again in its next turn, then drafts; when the run executes
    name = slow_check.qualified_name
    run, fake, elapsed = _search_twice_the_first_hanging(demo, fake_model)

    # then the call was turned away TIMEOUT once the tool's second was up, without running,
    # instead of holding the step until the check returned
    run.refresh_from_db()
    assert elapsed < 5
    slow = ToolCall.objects.get(run=run, call_id="call_slow")
    assert (slow.status, slow.error_category) == ("rejected", "TIMEOUT")
    assert slow.envelope["error"] == {
        "category": "TIMEOUT",
        "message": f"The handler of {name} did not authorise the call within 1 s.",
    }
    # and the call, which did not run, is said to be worth trying again
    assert slow.envelope["retryable"] is True
    rejected = RunEvent.objects.get(run=run, type="tool.rejected").payload
    assert (rejected["call_id"], rejected["category"], rejected["retryable"]) == (
        "call_slow",
        "TIMEOUT",
        True,
    )
    assert f"{name}: the handler did not authorise the call within 1 s" in caplog.text
    # and the model's next turn was told, its next call was checked and ran, and the run
    # went on to its draft
    answered = [
        message
        for message in fake.requests[1].body["messages"]
        if message["role"] == "tool" and message["tool_call_id"] == "call_slow"
    ]
    assert len(answered) == 1 and "TIMEOUT" in answered[0]["content"]
    told = json.loads(json.loads(answered[0]["content"])["untrusted_data"]["content"])
    assert (told["error"]["category"], told["retryable"]) == ("TIMEOUT", True)
    week = ToolCall.objects.get(run=run, call_id="call_week")
    assert (week.status, week.attempts) == ("completed", 1)
    assert run.status == "WAITING_APPROVAL"


@pytest.mark.django_db(transaction=True)
def test_the_authorisation_checks_of_a_step_end_when_its_task_would(
    demo, fake_model, hanging, settings
):
    # given a step with 2 s before its task's soft time limit, and a model that calls
    # project_search twice in one turn, whose authorisation check (gate 3) hangs for both
    # calls and whose timeout is 5 s
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    slow = _project_search_pinned(
        demo, handler="slow_to_authorise", retry_policy={"max_attempts": 1}, timeout_s=5
    )
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_a"), week_search("call_b"))))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    HANGS["call_a"] = HANGS["call_b"] = 1
    run = demo_run(demo, project_id="apollo")

    # when
    started = time.monotonic()
    run_execute(run_id=str(run.pk))

    # then the checks ended with the step's 2 s, not 5 s each one after the other: the first
    # was abandoned then, and the second was not asked, both calls turned away TIMEOUT as
    # calls another try may pass
    assert time.monotonic() - started < 4
    calls = {call.call_id: call for call in ToolCall.objects.filter(run=run, step=1)}
    for call in (calls["call_a"], calls["call_b"]):
        assert (call.status, call.error_category) == ("rejected", "TIMEOUT")
        assert call.envelope["retryable"] is True
    assert calls["call_b"].envelope["error"]["message"] == (
        f"The handler of {slow.qualified_name} was not asked to authorise the call: "
        "its step had no time left for it."
    )
    assert RETURNED == []


@pytest.mark.django_db(transaction=True)
def test_the_check_of_a_confirmed_recipient_s_project_ends_when_its_task_would(
    demo, hanging, settings
):
    # given alice confirmed hermes's lead dir-2002 in a session, under weekly-summary 3.3.0,
    # whose directory_lookup (timeout 5 s) has an authorisation check that may hang
    seeded = seeded_tool(demo, "directory_lookup")
    content = {field: getattr(seeded, field) for field in TOOL_CONTENT_FIELDS}
    content |= {"adapter_config": {"handler": f"{__name__}.slow_directory_lookup"}, "timeout_s": 5}
    slow = publish_tool(demo, "directory_lookup", "1.1.0", **content)
    publish_skill(
        demo,
        "weekly-summary",
        "3.3.0",
        tool_versions=[seeded_tool(demo, "project_search"), slow, seeded_tool(demo, "mail_send")],
    )
    session = demo_run(demo, project_id="hermes").session_id
    run_execute(run_id=str(Run.objects.get(session_id=session).pk))
    confirmed = demo_run(demo, session_id=session, recipient_record_id="dir-2002")
    run_execute(run_id=str(confirmed.pk))
    confirmed.refresh_from_db()
    assert confirmed.status == "WAITING_APPROVAL", confirmed.result

    # when a later message in the session reuses the confirmation, in a step with 2 s
    # before its task's soft time limit, and the check of the project hangs
    settings.RUN_TASK_SECONDS, settings.CELERY_TASK_SOFT_TIME_LIMIT = 240, 242
    HANGS["host-recipient"] = 1
    run = demo_run(demo, session_id=session)
    started = time.monotonic()
    run_execute(run_id=str(run.pk))

    # then the check ended with the step's 2 s, not the tool's 5 s, and the run, whose
    # project was not found within reach in time, may be retried
    assert time.monotonic() - started < 4
    assert not ToolCall.objects.filter(run=run, call_id="host-recipient").exists()
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("FAILED_RETRYABLE", "DIRECTORY_TIMEOUT")


def test_the_tool_calls_of_a_step_end_with_the_run_s_wall_time(demo, fake_model, hanging):
    # given a run of 4 s wall time whose model calls project_search, whose handler hangs,
    # whose timeout is 10 s and whose retry policy allows 2 attempts
    budgets(demo, max_seconds=4)
    _project_search_pinned(
        demo,
        handler="slow_project_search",
        retry_policy={"max_attempts": 2, "backoff_s": 0.01, "jitter": False},
        timeout_s=10,
    )
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    HANGS["call_slow"] = 2
    run = demo_run(demo, project_id="apollo")

    # when
    started = time.monotonic()
    run_execute(run_id=str(run.pk))

    # then the call was cut when the run's time ran out, not after its 10 s (twice), and
    # failed TIMEOUT as a call another try may pass, tried once
    assert time.monotonic() - started < 8
    slow = ToolCall.objects.get(run=run, call_id="call_slow")
    assert (slow.status, slow.error_category, slow.attempts) == ("failed", "TIMEOUT", 1)
    assert slow.envelope["retryable"] is True
    # and the run ended with its time spent, the model not asked again
    assert_terminal(run, "BUDGET_EXHAUSTED", "TIME_BUDGET")
    assert len(fake.requests) == 1
    types = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type", flat=True))
    assert types[-2:] == ["tool.failed", "run.finished"]


def assistant_question(demo, search: ToolVersion):
    """A question to the project-assistant, whose generic agent may call `search` only."""
    project_assistant_on_the_demo_model(demo, search=search)
    return demo_run(
        demo, text="What happened in Apollo?", agent="project-assistant", project_id="apollo"
    )


@pytest.mark.django_db(transaction=True)
def test_a_generic_agent_whose_calls_were_turned_away_by_a_slow_check_may_be_retried(
    demo, fake_model, slow_check
):
    # given the generic agent on a model that calls project_search, whose authorisation
    # check hangs, then answers without a result
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(content="The search did not answer."))
    HANGS["call_slow"] = 1
    run = assistant_question(demo, slow_check)

    # when
    run_execute(run_id=str(run.pk))

    # then the call was turned away, retryably, and the run says a retry may get the
    # answer, as it does when the call itself timed out, instead of a PARTIAL with no result
    slow = ToolCall.objects.get(run=run, call_id="call_slow")
    assert (slow.status, slow.error_category, slow.envelope["retryable"]) == (
        "rejected",
        "TIMEOUT",
        True,
    )
    result = assert_terminal(run, "FAILED_RETRYABLE", "EVIDENCE_UNAVAILABLE")
    assert result["output"] == {
        "answer": "The search did not answer.",
        "unavailable_tools": ["project_search"],
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("slow", ["slow_reads", "slow_check"], ids=["failed", "turned-away"])
def test_a_generic_agent_that_answers_empty_after_its_calls_timed_out_may_be_retried(
    demo, fake_model, request, slow
):
    # given the generic agent on a model that calls project_search, whose handler (or its
    # authorisation check) hangs, then ends its turns with no content, even once told
    search = request.getfixturevalue(slow)
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(content=None))
    fake.reply(openai_completion(content=None))
    HANGS["call_slow"] = 1
    run = assistant_question(demo, search)

    # when
    run_execute(run_id=str(run.pk))

    # then, after one correction, the run says a retry may reach the tool, as it does when
    # the model answers something, instead of a PARTIAL that blames the empty answer alone
    assert len(fake.requests) == 3
    assert "The answer is empty." in json.dumps(fake.requests[2].body["messages"][-1])
    result = assert_terminal(run, "FAILED_RETRYABLE", "EVIDENCE_UNAVAILABLE")
    assert result["output"] == {"unavailable_tools": ["project_search"]}


@pytest.mark.django_db(transaction=True)
def test_a_weekly_summary_whose_searches_were_turned_away_by_a_slow_check_may_be_retried(
    demo, fake_model, slow_check
):
    # given a weekly summary whose only search is turned away by an authorisation check
    # that hangs, and a model that drafts anyway
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    HANGS["call_slow"] = 1
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the run, without evidence, says a retry may find it, instead of failing for good
    assert ToolCall.objects.get(run=run, call_id="call_slow").status == "rejected"
    result = assert_terminal(run, "FAILED_RETRYABLE", "EVIDENCE_UNAVAILABLE")
    assert result["output"] == {"unavailable_tools": ["project_search"]}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("retry_policy", [{"max_attempts": 2, "backoff_s": 0.01, "jitter": False}])
def test_a_timed_out_read_is_retried_under_its_retry_policy_on_another_thread(
    demo, fake_model, slow_reads
):
    # given a retry policy of two attempts, and a handler that hangs on the first only
    fake = fake_model()
    fake.reply(openai_completion(tool_calls=(week_search("call_slow"),)))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    HANGS["call_slow"] = 1
    run = demo_run(demo, project_id="apollo")

    # when
    run_execute(run_id=str(run.pk))

    # then the second attempt answered, and the first attempt's late answer counts for nothing
    slow = ToolCall.objects.get(run=run, call_id="call_slow")
    assert (slow.status, slow.attempts) == ("completed", 2)
    run.refresh_from_db()
    assert run.status == "WAITING_APPROVAL"
    RELEASED.set()
    _abandoned_handlers_end()
    assert RETURNED == ["call_slow"]
    assert ToolCall.objects.get(run=run, call_id="call_slow").attempts == 2


def write_tool() -> ToolVersion:
    """A Python tool that changes something (not saved: the adapter reads only its
    configuration)."""
    return ToolVersion(
        tool=Tool(name="slow_write"),
        version="1.0.0",
        adapter_kind=AdapterKind.PYTHON,
        adapter_config={"handler": f"{__name__}.slow_write"},
        risk=Risk.INTERNAL_WRITE,
        timeout_s=1,
    )


def call_context(call_id: str) -> ToolContext:
    return ToolContext(
        run_id="run-1",
        call_id=call_id,
        tenant=Tenant(slug="acme"),
        actor=get_user_model()(username="alice"),
        idempotency_key=f"run-1:{call_id}",
    )


def test_a_write_past_its_timeout_may_have_had_its_effect_and_the_next_call_answers(hanging):
    HANGS["call-1"] = 1

    started = time.monotonic()
    with pytest.raises(ToolFailed) as raised:
        adapters.execute(write_tool(), call_context("call-1"), {})
    elapsed = time.monotonic() - started

    assert raised.value.category == ErrorCategory.TIMEOUT
    assert (raised.value.retryable, raised.value.may_have_side_effect) == (True, True)
    # (it waited its 1 s timeout, not for the hung write, which answers only when released)
    assert 1 <= elapsed < 5
    assert threads.abandoned_count() == 1
    # the next call does not wait behind the abandoned one
    output = adapters.execute(write_tool(), call_context("call-2"), {})
    assert output.raw == {"written": True}


def test_a_handler_thread_that_answered_is_reused_and_an_abandoned_one_never_is(hanging):
    def where() -> str:
        return threading.current_thread().name

    def hang() -> str:
        RELEASED.wait(HANG_MAX_SECONDS)
        return "late"

    first = threads.call_within(where, seconds=1)
    assert threads.call_within(where, seconds=1) == first
    with pytest.raises(threads.Overran):
        threads.call_within(hang, seconds=0.2)
    later = {threads.call_within(where, seconds=1) for _ in range(3)}
    assert len(later) == 1 and first not in later
    RELEASED.set()
    _abandoned_handlers_end()
    assert threads.call_within(lambda: "answer", seconds=1) == "answer"
    with pytest.raises(KeyError):
        threads.call_within(lambda: {}["missing"], seconds=1)


@pytest.mark.django_db(transaction=True)
def test_the_query_an_abandoned_handler_waits_on_is_cancelled_and_its_thread_ends():
    def slow_query() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(%s)", [HANG_MAX_SECONDS])
        return "late"

    started = time.monotonic()
    with pytest.raises(threads.Overran):
        threads.call_within(slow_query, seconds=0.5)

    _abandoned_handlers_end()
    assert time.monotonic() - started < 5
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE %s",
            ["SELECT pg_sleep%"],
        )
        assert cursor.fetchone() == (0,)
