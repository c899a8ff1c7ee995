"""Limits kept in Redis: concurrency caps of tools and tenants (with holders that expire), a
tool's rate limit and circuit breaker."""

import time

import pytest

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


def test_the_cap_refuses_a_second_call_until_the_first_ends(tool_version):
    with limits.concurrency_slot(tool_version):
        with pytest.raises(ToolFailed) as refused, limits.concurrency_slot(tool_version):
            pass
        assert refused.value.category == ErrorCategory.RATE_LIMITED
        assert refused.value.retryable

    with limits.concurrency_slot(tool_version):
        pass


def test_a_slot_left_by_a_killed_worker_frees_itself_after_its_deadline(tool_version):
    key = limits._slots_key("tool", tool_version.pk)
    assert limits._take(key, cap=1, holder="live", expires_at=time.time() + 60, ttl=120)
    with pytest.raises(ToolFailed), limits.concurrency_slot(tool_version):
        pass
    limits._release(key, "live")
    assert limits._take(key, cap=1, holder="killed", expires_at=time.time() - 1, ttl=120)

    with limits.concurrency_slot(tool_version):
        pass


def test_the_rate_limit_counts_calls_per_tenant_in_a_window(tool_version, acme, globex):
    limits.check_rate_limit(tool_version, tenant_id=acme.pk)
    limits.check_rate_limit(tool_version, tenant_id=acme.pk)

    with pytest.raises(ToolFailed) as refused:
        limits.check_rate_limit(tool_version, tenant_id=acme.pk)

    assert refused.value.category == ErrorCategory.RATE_LIMITED
    limits.check_rate_limit(tool_version, tenant_id=globex.pk)


def test_the_circuit_opens_after_the_threshold_and_a_success_resets_the_count(tool_version):
    limits.record_outcome(tool_version, failed=True)
    limits.record_outcome(tool_version, failed=False)
    limits.record_outcome(tool_version, failed=True)
    limits.check_circuit(tool_version)

    limits.record_outcome(tool_version, failed=True)

    with pytest.raises(ToolFailed) as refused:
        limits.check_circuit(tool_version)
    assert refused.value.category == ErrorCategory.UPSTREAM_ERROR


def test_the_breaker_opens_fails_fast_half_opens_for_one_trial_and_closes(
    tool_version, monkeypatch
):
    clock = [1_000_000.0]
    monkeypatch.setattr(limits, "_now", lambda: clock[0])
    limits.record_outcome(tool_version, failed=True)
    limits.record_outcome(tool_version, failed=True)

    assert limits.circuit_state(tool_version) == "open"
    with pytest.raises(ToolFailed, match="paused"):
        limits.check_circuit(tool_version)

    clock[0] += 31  # reset_after_s has passed: one trial call, and only one
    assert limits.circuit_state(tool_version) == "half_open"
    limits.check_circuit(tool_version)
    with pytest.raises(ToolFailed, match="trial call is under way"):
        limits.check_circuit(tool_version)

    limits.record_outcome(tool_version, failed=True)  # the trial failed: open again
    assert limits.circuit_state(tool_version) == "open"
    clock[0] += 31
    limits.check_circuit(tool_version)
    limits.record_outcome(tool_version, failed=False)  # the trial succeeded: closed
    assert limits.circuit_state(tool_version) == "closed"
    limits.check_circuit(tool_version)
    limits.check_circuit(tool_version)


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
