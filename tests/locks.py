"""Waiting, in a test, for another connection to reach a lock: tests that force an
interleaving of transactions hold a row in one and wait here until the other is blocked on it."""

import time
from collections.abc import Callable

from django.db import connection


def waiting_on_locks() -> int:
    """How many connections to the test database are waiting for a lock. Asked within a
    transaction too: PostgreSQL would otherwise answer from the snapshot of activity it took
    at the transaction's first question."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0]


def until(condition: Callable[[], object], *, seconds: float = 20) -> None:
    """Wait until `condition()` holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)
