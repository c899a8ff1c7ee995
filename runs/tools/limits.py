"""Rate limit, concurrency cap and circuit breaker of a tool version, and the concurrency cap
of a tenant's runs, kept in the cache (Redis in production, so every worker shares them)."""

import functools
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from django.conf import settings
from django.core.cache import cache

from registry.models import ToolVersion
from runs.tools.adapters import ToolFailed
from runs.tools.envelope import ErrorCategory

# A slot outlives its call's timeout by this much before another call may take it.
SLOT_GRACE_SECONDS = 5


def _incr(key: str, *, timeout: int) -> int:
    if cache.add(key, 1, timeout=timeout):
        return 1
    try:
        return cache.incr(key)
    except ValueError:
        cache.set(key, 1, timeout=timeout)
        return 1


def check_rate_limit(tool_version: ToolVersion, *, tenant_id: int) -> None:
    """A fixed window of `requests` per `per_seconds`, per tool version and tenant."""
    limit = tool_version.rate_limit
    if not limit:
        return
    window = int(time.time() // limit["per_seconds"])
    key = f"tool-rate:{tool_version.pk}:{tenant_id}:{window}"
    if _incr(key, timeout=limit["per_seconds"] + 1) > limit["requests"]:
        raise ToolFailed(
            f"{tool_version.qualified_name} allows {limit['requests']} calls per "
            f"{limit['per_seconds']} s.",
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
            attempted=False,
        )


# Take a slot if fewer than the cap are held; each holder expires on its own, so a worker
# killed mid-call frees its slot once the call's deadline has passed.
_TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""
_local_slots: dict[str, dict[str, float]] = {}
_local_lock = threading.Lock()


def _slots_key(kind: str, owner: object) -> str:
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    return f"{prefix}:{kind}-running:{owner}"


@functools.lru_cache(maxsize=4)
def _redis(url: str) -> redis.Redis:
    """One client (with its connection pool) per Redis URL for the process."""
    return redis.Redis.from_url(url)


def _take(key: str, *, cap: int, holder: str, expires_at: float, ttl: int) -> bool:
    if settings.REDIS_URL:
        client = _redis(settings.REDIS_URL)
        return bool(client.eval(_TAKE_SLOT, 1, key, time.time(), cap, expires_at, holder, ttl))
    with _local_lock:
        holders = {h: t for h, t in _local_slots.get(key, {}).items() if t > time.time()}
        if len(holders) >= cap:
            _local_slots[key] = holders
            return False
        holders[holder] = expires_at
        _local_slots[key] = holders
        return True


def window_take(ident: str, *, cap: int, seconds: float) -> bool:
    """A sliding window: at most `cap` takes in any `seconds` per `ident`, one atomic step
    across every process sharing Redis (a read-modify-write of a cached list would let
    concurrent requests through together)."""
    return _take(
        _slots_key("window", ident),
        cap=cap,
        holder=uuid.uuid4().hex,
        expires_at=time.time() + seconds,
        ttl=int(seconds) + 1,
    )


def window_wait(ident: str) -> float:
    """Seconds until the oldest take in the window lapses (when a new take may succeed)."""
    key, now = _slots_key("window", ident), time.time()
    if settings.REDIS_URL:
        oldest = _redis(settings.REDIS_URL).zrange(key, 0, 0, withscores=True)
        lapses = oldest[0][1] if oldest else now
    else:
        with _local_lock:
            lapses = min(_local_slots.get(key, {}).values(), default=now)
    return max(0.0, lapses - now)


def _release(key: str, holder: str) -> None:
    if settings.REDIS_URL:
        _redis(settings.REDIS_URL).zrem(key, holder)
        return
    with _local_lock:
        _local_slots.get(key, {}).pop(holder, None)


@contextmanager
def concurrency_slot(tool_version: ToolVersion) -> Iterator[None]:
    """At most `concurrency_cap` calls of a tool version at once, across workers."""
    key, holder = _slots_key("tool", tool_version.pk), uuid.uuid4().hex
    lifetime = tool_version.timeout_s + SLOT_GRACE_SECONDS
    taken = _take(
        key,
        cap=tool_version.concurrency_cap,
        holder=holder,
        expires_at=time.time() + lifetime,
        ttl=lifetime * 2,
    )
    if not taken:
        raise ToolFailed(
            f"{tool_version.qualified_name} is at its concurrency cap.",
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
            attempted=False,
        )
    try:
        yield
    finally:
        _release(key, holder)


def tenant_run_slot_take(*, tenant_id: int, cap: int, run_id: str, seconds: int) -> bool:
    """Whether this run may advance now: fewer than `cap` of the tenant's runs hold a slot,
    or this one holds it already. The slot lapses after `seconds` (the run's wall-time
    budget and a grace), so a worker killed mid-run does not keep it."""
    lifetime = seconds + SLOT_GRACE_SECONDS
    key = _slots_key("tenant", tenant_id)
    if _holds(key, run_id):
        return True
    return _take(key, cap=cap, holder=run_id, expires_at=time.time() + lifetime, ttl=lifetime * 2)


def tenant_run_slot_release(*, tenant_id: int, run_id: str) -> None:
    _release(_slots_key("tenant", tenant_id), run_id)


def _holds(key: str, holder: str) -> bool:
    if settings.REDIS_URL:
        expires_at = _redis(settings.REDIS_URL).zscore(key, holder)
    else:
        with _local_lock:
            expires_at = _local_slots.get(key, {}).get(holder)
    return expires_at is not None and expires_at > time.time()


def _now() -> float:
    return time.time()


def _breaker_keys(tool_version: ToolVersion) -> tuple[str, str, str]:
    tool = tool_version.tool_id
    return f"tool-failures:{tool}", f"tool-circuit:{tool}", f"tool-trial:{tool}"


def circuit_state(tool_version: ToolVersion) -> str:
    """`closed` (calls pass), `open` (calls fail fast until `reset_after_s` has passed since
    it opened) or `half_open` (one trial call may pass; its outcome closes or reopens it)."""
    _, circuit_key, _ = _breaker_keys(tool_version)
    opened_until = cache.get(circuit_key)
    if opened_until is None:
        return "closed"
    return "open" if _now() < opened_until else "half_open"


def _fail_fast(tool_version: ToolVersion, why: str) -> ToolFailed:
    return ToolFailed(
        f"{tool_version.qualified_name} is failing; {why}.",
        category=ErrorCategory.UPSTREAM_ERROR,
        retryable=True,
        attempted=False,
    )


def check_circuit(tool_version: ToolVersion) -> None:
    """Fail fast while the circuit is open; when half-open, let one trial call through."""
    if not tool_version.circuit_breaker:
        return
    state = circuit_state(tool_version)
    if state == "open":
        raise _fail_fast(tool_version, "calls are paused for a while")
    if state == "half_open":
        _, _, trial_key = _breaker_keys(tool_version)
        if not cache.add(trial_key, 1, timeout=tool_version.timeout_s + SLOT_GRACE_SECONDS):
            raise _fail_fast(tool_version, "a trial call is under way")


def record_outcome(tool_version: ToolVersion, *, failed: bool) -> None:
    """`failure_threshold` failures within `reset_after_s` open the circuit; a failed trial
    reopens it; any success closes it."""
    breaker = tool_version.circuit_breaker
    if not breaker:
        return
    failures_key, circuit_key, trial_key = _breaker_keys(tool_version)
    reset_after = breaker["reset_after_s"]
    if not failed:
        cache.delete_many([failures_key, circuit_key, trial_key])
        return
    keep = reset_after * 10
    if circuit_state(tool_version) == "half_open":
        cache.set(circuit_key, _now() + reset_after, timeout=keep)
        cache.delete(trial_key)
        return
    if _incr(failures_key, timeout=reset_after) >= breaker["failure_threshold"]:
        cache.set(circuit_key, _now() + reset_after, timeout=keep)
        cache.delete(failures_key)
