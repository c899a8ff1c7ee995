"""Rate limit, concurrency cap and circuit breaker of a tool version, kept in the cache (Redis
in production, so every worker shares them)."""

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from django.core.cache import cache

from registry.models import ToolVersion
from runs.tools.adapters import ToolFailed
from runs.tools.envelope import ErrorCategory


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
        )


@contextmanager
def concurrency_slot(tool_version: ToolVersion) -> Iterator[None]:
    """At most `concurrency_cap` calls of a tool version at once, across workers."""
    key = f"tool-running:{tool_version.pk}"
    if _incr(key, timeout=tool_version.timeout_s * 2 + 5) > tool_version.concurrency_cap:
        cache.decr(key)
        raise ToolFailed(
            f"{tool_version.qualified_name} is at its concurrency cap.",
            category=ErrorCategory.RATE_LIMITED,
            retryable=True,
        )
    try:
        yield
    finally:
        with suppress(ValueError):
            cache.decr(key)


def _breaker_keys(tool_version: ToolVersion) -> tuple[str, str]:
    return f"tool-failures:{tool_version.tool_id}", f"tool-open:{tool_version.tool_id}"


def check_circuit(tool_version: ToolVersion) -> None:
    if tool_version.circuit_breaker and cache.get(_breaker_keys(tool_version)[1]):
        raise ToolFailed(
            f"{tool_version.qualified_name} is failing; calls are paused for a while.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
        )


def record_outcome(tool_version: ToolVersion, *, failed: bool) -> None:
    """Open the circuit after `failure_threshold` failures in `reset_after_s`; a success
    closes the count."""
    breaker = tool_version.circuit_breaker
    if not breaker:
        return
    failures_key, open_key = _breaker_keys(tool_version)
    if not failed:
        cache.delete(failures_key)
        return
    if _incr(failures_key, timeout=breaker["reset_after_s"]) >= breaker["failure_threshold"]:
        cache.set(open_key, True, timeout=breaker["reset_after_s"])
        cache.delete(failures_key)
