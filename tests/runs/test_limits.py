"""Limits kept in Redis: concurrency caps of tools and tenants (with holders that expire), a
tool's rate limit and circuit breaker, each decided in one script for all the calls of a step."""

import time

import pytest

from registry.schemas import CIRCUIT_BREAKER_SCHEMA
from runs.tools import limits
from runs.tools.adapters import ToolFailed
from runs.tools.envelope import ErrorCategory


@pytest.fixture
def tool_version(make_tool_version):
    return make_tool_version(
        concurrency_cap=1,
        timeout_s=5,
        rate_limit={"requests": 2, "per_seconds": 60},
        circuit_breaker={"failure_threshold": 2, "reset_after_s": 30},
    )


def enter(tool_version, tenant_id=1) -> limits.Passage | ToolFailed:
    [entered] = limits.calls_enter([tool_version], tenant_id=tenant_id)
    return entered


def call(tool_version, *, failed: bool = False, tenant_id=1) -> None:
    """One call that passes its limits and ends as `failed` says."""
    passage = enter(tool_version, tenant_id)
    assert isinstance(passage, limits.Passage), passage
    limits.calls_leave([(passage, failed)])


def test_the_cap_refuses_a_second_call_until_the_first_ends(tool_version):
    first = enter(tool_version)

    refused = enter(tool_version)

    assert isinstance(first, limits.Passage)
    assert isinstance(refused, ToolFailed)
    assert refused.category == ErrorCategory.RATE_LIMITED
    assert refused.retryable and not refused.attempted
    limits.calls_leave([(first, False)])
    assert isinstance(enter(tool_version), limits.Passage)


def test_the_calls_of_one_step_enter_together_and_share_the_cap(tool_version, make_tool_version):
    other = make_tool_version(name="directory_lookup", concurrency_cap=1)

    entered = limits.calls_enter([tool_version, other, tool_version], tenant_id=1)

    assert [type(each) for each in entered] == [limits.Passage, limits.Passage, ToolFailed]
    assert "concurrency cap" in str(entered[2])
    limits.calls_leave([(entered[0], False), (entered[1], False)])
    assert all(
        isinstance(each, limits.Passage)
        for each in limits.calls_enter([tool_version, other], tenant_id=1)
    )


def test_a_slot_left_by_a_killed_worker_frees_itself_after_its_deadline(tool_version):
    key = limits._slots_key("tool", tool_version.pk)
    assert limits._take(key, cap=1, holder="live", expires_at=time.time() + 60, ttl=120)
    assert isinstance(enter(tool_version), ToolFailed)
    limits._release(key, "live")
    assert limits._take(key, cap=1, holder="killed", expires_at=time.time() - 1, ttl=120)

    assert isinstance(enter(tool_version), limits.Passage)


def test_the_rate_limit_counts_calls_per_tenant_in_a_window(tool_version, acme, globex):
    call(tool_version, tenant_id=acme.pk)
    call(tool_version, tenant_id=acme.pk)

    refused = enter(tool_version, acme.pk)

    assert isinstance(refused, ToolFailed)
    assert refused.category == ErrorCategory.RATE_LIMITED
    assert "allows 2 calls per 60 s" in str(refused)
    call(tool_version, tenant_id=globex.pk)


def test_the_rate_limit_holds_for_any_stretch_of_its_length_across_a_window_boundary(
    tool_version, monkeypatch
):
    """Counted in fixed windows, two calls at the end of one minute and two at the start of
    the next all passed: four calls within a second of a tool that allows 2 per 60 s."""
    # given two calls a second before a minute's boundary
    clock = [60_000.0 - 1]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    call(tool_version)
    call(tool_version)

    # when two more are asked for a second after it, and again just before the first two
    # are a minute old, and once they are
    clock[0] += 2
    after_the_boundary = enter(tool_version)
    clock[0] = 60_000.0 - 1 + 59.9
    within_the_minute = enter(tool_version)
    clock[0] = 60_000.0 - 1 + 60
    call(tool_version)
    call(tool_version)

    # then none passes within 60 s of the first two; a minute after them, two pass again
    assert isinstance(after_the_boundary, ToolFailed)
    assert "allows 2 calls per 60 s" in str(after_the_boundary)
    assert isinstance(within_the_minute, ToolFailed)
    assert isinstance(enter(tool_version), ToolFailed)


def test_a_call_the_rate_limit_refuses_is_told_when_the_window_frees_a_place(
    tool_version, monkeypatch
):
    # given two calls 10 s apart of a tool that allows 2 per 60 s
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    call(tool_version)
    clock[0] += 10
    call(tool_version)

    # when a third is asked for 15 s after the first
    clock[0] += 5
    refused = enter(tool_version)

    # then it is refused until the first is a minute old, 45 s on, and told so
    assert isinstance(refused, ToolFailed)
    assert (refused.category, refused.retryable, refused.turned_away) == (
        ErrorCategory.RATE_LIMITED,
        True,
        True,
    )
    assert refused.retry_after == 45
    assert "allows 2 calls per 60 s; try again in 45 s" in str(refused)
    clock[0] += 44.9
    assert isinstance(enter(tool_version), ToolFailed)
    clock[0] += 0.1
    assert isinstance(enter(tool_version), limits.Passage)


def test_after_the_rate_was_lowered_a_refused_call_waits_for_enough_calls_to_lapse(
    tool_version, monkeypatch
):
    # given three calls a second apart, then the tool's rate lowered to 1 per 60 s
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    tool_version.rate_limit = {"requests": 3, "per_seconds": 60}
    for _ in range(3):
        call(tool_version)
        clock[0] += 1
    tool_version.rate_limit = {"requests": 1, "per_seconds": 60}

    # when
    refused = enter(tool_version)

    # then it may pass only once the newest is a minute old, not the oldest
    assert refused.retry_after == 59
    clock[0] += 58.9
    assert isinstance(enter(tool_version), ToolFailed)
    clock[0] += 0.1
    assert isinstance(enter(tool_version), limits.Passage)


def test_a_new_version_of_a_tool_shares_its_rate_window(tool_version, make_tool_version, acme):
    """Counted per version, each publish of a tool brought a fresh window: a tenant could
    pass its rate limit by publishing a new version."""
    # given a tool whose two calls of the window were made with its first version
    call(tool_version, tenant_id=acme.pk)
    call(tool_version, tenant_id=acme.pk)
    newer = make_tool_version(
        version="1.1.0",
        concurrency_cap=1,
        timeout_s=5,
        rate_limit={"requests": 2, "per_seconds": 60},
    )
    assert newer.tool_id == tool_version.tool_id

    # when a call of its new version is asked
    refused = enter(newer, acme.pk)

    # then the window of the tool refuses it
    assert isinstance(refused, ToolFailed)
    assert "allows 2 calls per 60 s" in str(refused)


def test_a_call_the_concurrency_cap_refuses_is_told_no_time(tool_version):
    held = enter(tool_version)

    refused = enter(tool_version)

    assert "concurrency cap" in str(refused)
    assert refused.retry_after is None
    limits.calls_leave([(held, False)])


def test_a_call_one_limit_refuses_takes_nothing_from_the_others(tool_version):
    held = enter(tool_version)
    assert isinstance(enter(tool_version), ToolFailed)  # the cap: not counted in the window
    limits.calls_leave([(held, False)])

    call(tool_version)  # the second call of the window

    assert "allows 2 calls" in str(enter(tool_version))


def test_the_circuit_opens_after_the_threshold_and_a_success_resets_the_count(tool_version):
    call(tool_version, failed=True)
    call(tool_version, failed=False)
    tool_version.rate_limit = {}
    call(tool_version, failed=True)
    passage = enter(tool_version)
    assert isinstance(passage, limits.Passage)

    limits.calls_leave([(passage, True)])

    refused = enter(tool_version)
    assert isinstance(refused, ToolFailed)
    assert refused.category == ErrorCategory.UPSTREAM_ERROR
    assert limits.circuit_state(tool_version) == "open"


def test_a_call_the_open_circuit_refuses_is_told_when_it_half_opens(tool_version, monkeypatch):
    # given a tool whose circuit opened (for 30 s) on its second failure
    tool_version.rate_limit = {}
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    call(tool_version, failed=True)
    call(tool_version, failed=True)

    # when a call is asked for 12.5 s later
    clock[0] += 12.5
    refused = enter(tool_version)

    # then it is refused until the circuit lets a trial through, 17.5 s on, and told so
    assert isinstance(refused, ToolFailed)
    assert (refused.category, refused.retryable, refused.turned_away) == (
        ErrorCategory.UPSTREAM_ERROR,
        True,
        True,
    )
    assert refused.retry_after == 17.5
    assert "calls are paused; try again in 18 s" in str(refused)
    clock[0] += 17.4
    assert isinstance(enter(tool_version), ToolFailed)
    clock[0] += 0.1
    assert isinstance(enter(tool_version), limits.Passage)


def test_a_call_refused_while_the_trial_is_under_way_is_told_when_it_ends(
    tool_version, monkeypatch
):
    # given a half-open circuit whose trial call (of at most 5 s and a 5 s grace) just began
    tool_version.rate_limit = {}
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    call(tool_version, failed=True)
    call(tool_version, failed=True)
    clock[0] += 31
    trial = enter(tool_version)
    assert isinstance(trial, limits.Passage)

    # when another call is asked
    refused = enter(tool_version)

    # then it is refused until the trial's time is over, and told so
    assert isinstance(refused, ToolFailed)
    assert (refused.category, refused.retryable, refused.turned_away) == (
        ErrorCategory.UPSTREAM_ERROR,
        True,
        True,
    )
    assert 9 < refused.retry_after <= 10
    assert str(refused).endswith("is failing; a trial call is under way; try again in 10 s.")
    limits.calls_leave([(trial, False)])


def test_the_longest_reset_a_tool_version_may_have_still_opens_its_circuit(make_tool_version):
    longest = CIRCUIT_BREAKER_SCHEMA["properties"]["reset_after_s"]["maximum"]
    tool_version = make_tool_version(
        circuit_breaker={"failure_threshold": 1, "reset_after_s": longest}
    )

    call(tool_version, failed=True)

    assert limits.circuit_state(tool_version) == "open"
    assert isinstance(enter(tool_version), ToolFailed)


def test_a_call_that_never_reached_its_tool_tells_the_breaker_nothing(tool_version):
    tool_version.rate_limit = {}
    for _ in range(3):
        passage = enter(tool_version)
        limits.calls_leave([(passage, None)])

    assert limits.circuit_state(tool_version) == "closed"
    assert isinstance(enter(tool_version), limits.Passage)


def test_the_breaker_opens_fails_fast_half_opens_for_one_trial_and_closes(
    tool_version, monkeypatch
):
    tool_version.rate_limit = {}
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    call(tool_version, failed=True)
    call(tool_version, failed=True)

    assert limits.circuit_state(tool_version) == "open"
    assert "paused" in str(enter(tool_version))

    clock[0] += 31  # reset_after_s has passed: one trial call, and only one
    assert limits.circuit_state(tool_version) == "half_open"
    trial = enter(tool_version)
    assert isinstance(trial, limits.Passage)
    assert "trial call is under way" in str(enter(tool_version))
    assert "trial call is under way" in str(enter(tool_version, tenant_id=2))

    limits.calls_leave([(trial, True)])  # the trial failed: open again
    assert limits.circuit_state(tool_version) == "open"
    clock[0] += 31
    call(tool_version, failed=False)  # the trial succeeded: closed
    assert limits.circuit_state(tool_version) == "closed"
    call(tool_version)
    call(tool_version)


def test_a_tenant_s_run_slots_admit_the_cap_and_the_holder_again(acme, globex):
    take = limits.tenant_run_slot_take

    assert take(tenant_id=acme.pk, cap=1, run_id="run-1", seconds=60)
    assert take(tenant_id=acme.pk, cap=1, run_id="run-1", seconds=60)
    assert not take(tenant_id=acme.pk, cap=1, run_id="run-2", seconds=60)
    assert take(tenant_id=globex.pk, cap=1, run_id="run-3", seconds=60)
    limits.tenant_run_slot_release(tenant_id=acme.pk, run_id="run-1")
    assert take(tenant_id=acme.pk, cap=1, run_id="run-2", seconds=60)


def test_a_tenant_slot_left_by_a_killed_worker_lapses(acme, monkeypatch):
    monkeypatch.setattr(limits, "SLOT_GRACE_SECONDS", 0)
    assert limits.tenant_run_slot_take(tenant_id=acme.pk, cap=1, run_id="killed", seconds=1)
    assert not limits.tenant_run_slot_take(tenant_id=acme.pk, cap=1, run_id="next", seconds=1)

    time.sleep(1.1)

    assert limits.tenant_run_slot_take(tenant_id=acme.pk, cap=1, run_id="next", seconds=1)
