"""Rate limit, concurrency cap and circuit breaker of a tool version, and the concurrency cap
of a tenant's runs, kept in Redis so that every worker shares them. The embedded default has
one process and no Redis: the same scripts then run on a Redis of its own, in memory.

A tool call passes all its limits or takes nothing: `calls_enter` decides every call of a step
in one script (one round trip), and `calls_leave` gives their slots back and tells each
breaker how its call ended in one more.
"""

import functools
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fakeredis
import redis
from django.conf import settings
from redis.commands.core import Script

from registry.models import ToolVersion
from runs.tools.adapters import ToolFailed
from runs.tools.envelope import ErrorCategory

# A slot outlives its call's timeout by this much before another call may take it.
SLOT_GRACE_SECONDS = 5
# A circuit that opened is remembered this many times its `reset_after_s`.
CIRCUIT_MEMORY = 10

# Slots are a sorted set of holders scored by when each expires: a worker killed mid-call
# frees its slot once the call's deadline has passed.
_SLOTS = """
local function slots_full(slots, now, cap)
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  return redis.call('ZCARD', slots) >= tonumber(cap)
end
local function slot_hold(slots, holder, expires_at, ttl)
  redis.call('ZADD', slots, expires_at, holder)
  redis.call('EXPIRE', slots, ttl)
end
"""
# Take a slot if fewer than the cap are held.
_TAKE_SLOT = (
    _SLOTS
    + """
if slots_full(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
slot_hold(KEYS[1], ARGV[4], ARGV[3], ARGV[5])
return 1
"""
)

# For each call (4 keys: circuit, trial, rate window, slots; 9 arguments after `now`): 0 when
# it passes, and then it takes the half-open circuit's trial, a place in the rate window
# (held as a slot is, until `per_seconds` after the call) and a slot; otherwise what refused
# it (1 circuit open, 2 trial under way, 3 rate, 4 cap). With the codes, for each call, when
# its circuit lets a trial through if the open circuit refused it, when the trial's time is
# over if the trial under way refused it, when its rate window frees a place if the rate
# refused it (the `requests`-th newest place lapses: the oldest, unless the rate was
# lowered), else ''.
_ENTER = (
    _SLOTS
    + """
local now = tonumber(ARGV[1])
local codes, frees = {}, {}
for i = 0, #KEYS / 4 - 1 do
  local k = i * 4
  local circuit, trial, rate, slots = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local a = i * 9 + 1
  local requests, cap = tonumber(ARGV[a + 3]), ARGV[a + 5]
  local code, half_open, free = 0, false, ''
  if ARGV[a + 1] == '1' then
    local opened_until = redis.call('GET', circuit)
    if opened_until then
      if now < tonumber(opened_until) then
        code, free = 1, opened_until
      else
        local trial_left = redis.call('PTTL', trial)
        if trial_left >= 0 then
          code, free = 2, tostring(now + trial_left / 1000)
        else
          half_open = true
        end
      end
    end
  end
  if code == 0 and requests > 0 and slots_full(rate, now, requests) then
    code = 3
    free = redis.call('ZRANGE', rate, -requests, -requests, 'WITHSCORES')[2]
  end
  if code == 0 and slots_full(slots, now, cap) then code = 4 end
  if code == 0 then
    if half_open then redis.call('SET', trial, '1', 'EX', ARGV[a + 2]) end
    if requests > 0 then slot_hold(rate, ARGV[a + 6], ARGV[a + 9], ARGV[a + 4]) end
    slot_hold(slots, ARGV[a + 6], ARGV[a + 7], ARGV[a + 8])
  end
  codes[#codes + 1] = code
  frees[#frees + 1] = free
end
return {codes, frees}
"""
)

# For each call (4 keys: slots, failures, circuit, trial; 6 arguments after `now`): give the
# slot back; a success closes the circuit and forgets the failures; a failure of the trial
# call reopens it, any other failure counts, and `threshold` of them open it.
_LEAVE = """
local now = tonumber(ARGV[1])
for i = 0, #KEYS / 4 - 1 do
  local k = i * 4
  local slots, failures, circuit, trial = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local a = i * 6 + 1
  local outcome, opened_until, memory = ARGV[a + 2], ARGV[a + 3], ARGV[a + 6]
  redis.call('ZREM', slots, ARGV[a + 1])
  if outcome == 'ok' then
    redis.call('DEL', failures, circuit, trial)
  elseif outcome == 'failed' then
    local open_until = tonumber(redis.call('GET', circuit))
    if open_until and now >= open_until then
      redis.call('SET', circuit, opened_until, 'EX', memory)
      redis.call('DEL', trial)
    else
      local count = redis.call('INCR', failures)
      if count == 1 then redis.call('EXPIRE', failures, ARGV[a + 5]) end
      if count >= tonumber(ARGV[a + 4]) then
        redis.call('SET', circuit, opened_until, 'EX', memory)
        redis.call('DEL', failures)
      end
    end
  end
end
return 0
"""


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    """One client (with its connection pool) per Redis URL for the process; without a URL,
    the process's own Redis in memory."""
    if url:
        return redis.Redis.from_url(url)
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def _redis() -> redis.Redis:
    return _client(settings.REDIS_URL)


@functools.lru_cache(maxsize=16)
def _script(url: str, text: str) -> Script:
    return _client(url).register_script(text)


def _eval(text: str, keys: list[str], arguments: list[object]) -> Any:
    """Run a script by its digest (EVALSHA), loading it into Redis the first time."""
    return _script(settings.REDIS_URL, text)(keys=keys, args=arguments)


def _now() -> float:
    return time.time()


def _key(kind: str, owner: object) -> str:
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    return f"{prefix}:{kind}:{owner}"


def _slots_key(kind: str, owner: object) -> str:
    return _key(f"{kind}-running", owner)


def _breaker_keys(tool_version: ToolVersion) -> tuple[str, str, str]:
    """The failures counted, the time the open circuit lets a trial through, the trial."""
    tool = tool_version.tool_id
    return _key("tool-failures", tool), _key("tool-circuit", tool), _key("tool-trial", tool)


@dataclass(frozen=True)
class Passage:
    """A call that passed its tool's limits and holds one of its slots until it leaves."""

    tool_version: ToolVersion
    holder: str


def _slot_lifetime(tool_version: ToolVersion) -> int:
    return tool_version.timeout_s + SLOT_GRACE_SECONDS


def _refusal(tool_version: ToolVersion, code: int, wait: float | None) -> ToolFailed:
    """Why a call was turned away; `wait`: the seconds until its circuit lets a trial
    through, when the open circuit refused it, until the trial's time is over (it may end
    sooner), when the trial under way refused it, or until its rate window frees a place,
    when the rate refused it, which the refusal tells (`retry_after`) and says."""
    name = tool_version.qualified_name
    if code in (1, 2):
        why = "calls are paused" if code == 1 else "a trial call is under way"
        return ToolFailed(
            f"{name} is failing; {why}; try again in {math.ceil(wait)} s.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            turned_away=True,
            retry_after=wait,
        )
    if code == 3:
        limit = tool_version.rate_limit
        message = (
            f"{name} allows {limit['requests']} calls per {limit['per_seconds']} s; "
            f"try again in {math.ceil(wait)} s."
        )
    else:
        message = f"{name} is at its concurrency cap."
    return ToolFailed(
        message,
        category=ErrorCategory.RATE_LIMITED,
        retryable=True,
        turned_away=True,
        retry_after=wait,
    )


def calls_enter(
    tool_versions: Sequence[ToolVersion], *, tenant_id: int
) -> list[Passage | ToolFailed]:
    """Whether each call (of these tool versions, in order, for this tenant) may run now: its
    tool's circuit is closed (or half-open and it is the one trial), its tool has calls left in
    this tenant's rate window (a sliding window: fewer than `requests` calls in the last
    `per_seconds`, so that no stretch of that length, across a minute's boundary or not, sees
    more) and a slot under its version's concurrency cap. The window and the circuit are the
    tool's, whatever version a call uses: a new publish neither empties the window nor closes
    the circuit. A call that passes holds what it took; one refused takes nothing."""
    if not tool_versions:
        return []
    now = _now()
    keys: list[str] = []
    arguments: list[object] = [now]
    holders = [uuid.uuid4().hex for _ in tool_versions]
    for tool_version, holder in zip(tool_versions, holders, strict=True):
        _, circuit, trial = _breaker_keys(tool_version)
        limit = tool_version.rate_limit or {}
        per_seconds = limit.get("per_seconds", 1)
        lifetime = _slot_lifetime(tool_version)
        keys += [
            circuit,
            trial,
            _key("tool-rate", f"{tool_version.tool_id}:{tenant_id}"),
            _slots_key("tool", tool_version.pk),
        ]
        arguments += [
            1 if tool_version.circuit_breaker else 0,
            lifetime,
            limit.get("requests", 0),
            per_seconds + 1,
            tool_version.concurrency_cap,
            holder,
            now + lifetime,
            lifetime * 2,
            now + per_seconds,
        ]
    codes, frees = _eval(_ENTER, keys, arguments)
    return [
        Passage(tool_version, holder)
        if code == 0
        else _refusal(tool_version, code, max(0.0, float(free) - now) if free else None)
        for tool_version, holder, code, free in zip(
            tool_versions, holders, codes, frees, strict=True
        )
    ]


def calls_leave(passages: Sequence[tuple[Passage, bool | None]]) -> None:
    """Give back the slots of calls that ended, each with whether it failed (None: the tool
    was not reached, so its breaker learns nothing)."""
    if not passages:
        return
    now = _now()
    keys: list[str] = []
    arguments: list[object] = [now]
    for passage, failed in passages:
        tool_version = passage.tool_version
        failures, circuit, trial = _breaker_keys(tool_version)
        breaker = tool_version.circuit_breaker
        outcome = "none" if failed is None or not breaker else "failed" if failed else "ok"
        reset_after = breaker["reset_after_s"] if breaker else 1
        keys += [_slots_key("tool", tool_version.pk), failures, circuit, trial]
        arguments += [
            passage.holder,
            outcome,
            now + reset_after,
            breaker["failure_threshold"] if breaker else 0,
            reset_after,
            reset_after * CIRCUIT_MEMORY,
        ]
    _eval(_LEAVE, keys, arguments)


def circuit_state(tool_version: ToolVersion) -> str:
    """`closed` (calls pass), `open` (calls fail fast until `reset_after_s` has passed since
    it opened) or `half_open` (one trial call may pass; its outcome closes or reopens it)."""
    _, circuit, _ = _breaker_keys(tool_version)
    opened_until = _redis().get(circuit)
    if opened_until is None:
        return "closed"
    return "open" if _now() < float(opened_until) else "half_open"


def _take(key: str, *, cap: int, holder: str, expires_at: float, ttl: int) -> bool:
    return bool(_eval(_TAKE_SLOT, [key], [_now(), cap, expires_at, holder, ttl]))


def _release(key: str, holder: str) -> None:
    _redis().zrem(key, holder)


def window_take(ident: str, *, cap: int, seconds: float) -> str | None:
    """A sliding window: at most `cap` takes in any `seconds` per `ident`, one atomic step
    across every process sharing Redis (a read-modify-write of a cached list would let
    concurrent requests through together). Returns the take (to give back), or None."""
    holder = uuid.uuid4().hex
    taken = _take(
        _slots_key("window", ident),
        cap=cap,
        holder=holder,
        expires_at=_now() + seconds,
        ttl=int(seconds) + 1,
    )
    return holder if taken else None


def window_give_back(ident: str, holder: str) -> None:
    """A take of a request that was refused after all (by another window)."""
    _release(_slots_key("window", ident), holder)


def window_wait(ident: str, *, cap: int) -> float:
    """Seconds until a new take of at most `cap` may succeed: until the `cap`-th newest take
    in the window lapses. That is the oldest while the window holds `cap` takes, but not
    after the cap was lowered, when it holds more."""
    now = _now()
    freeing = _redis().zrange(_slots_key("window", ident), -cap, -cap, withscores=True)
    return max(0.0, (freeing[0][1] if freeing else now) - now)


def tenant_run_slot_take(*, tenant_id: int, cap: int, run_id: str, seconds: int) -> bool:
    """Whether this run may advance now: fewer than `cap` of the tenant's runs hold a slot,
    or this one holds it already. The slot lapses after `seconds` (the run's wall-time
    budget and a grace), so a worker killed mid-run does not keep it."""
    lifetime = seconds + SLOT_GRACE_SECONDS
    key = _slots_key("tenant", tenant_id)
    expires_at = _redis().zscore(key, run_id)
    if expires_at is not None and expires_at > _now():
        return True
    return _take(key, cap=cap, holder=run_id, expires_at=_now() + lifetime, ttl=lifetime * 2)


def tenant_run_slot_release(*, tenant_id: int, run_id: str) -> None:
    _release(_slots_key("tenant", tenant_id), run_id)
