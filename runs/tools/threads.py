"""The threads that run the independent calls of one step in parallel.

The calling thread takes part: it runs calls of the step too, and the pool's threads take
the others as they come free, so a step's calls never wait behind each other more than the
cap requires, and a step whose calls do not block hands little over between threads.
The pool's threads live as long as the process (a Celery worker child creates them on
first use, after the fork) and each keeps its own database connection between calls:
opening a connection per call would cost more than most read calls. A connection left
broken by an error is closed after its call; `stop` closes every thread's connection and
ends the threads (the test suite calls it before dropping its database).
"""

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from django.db import connections

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()
_lock = threading.Lock()
_tasks: queue.SimpleQueue = queue.SimpleQueue()
_threads: list[threading.Thread] = []


def _close_broken_connections() -> None:
    """A connection that saw a database error is closed (the next call opens a new one);
    asking a healthy one whether it is usable would cost a round trip per call."""
    for connection in connections.all(initialized_only=True):
        if connection.errors_occurred:
            connection.close()


class _Batch(Generic[T, R]):
    """The items of one `parallel_map`, taken one at a time by whichever thread is free."""

    def __init__(self, function: Callable[[T], R], items: list[T]) -> None:
        self._function = function
        self._items = items
        self._outcomes: list[Any] = [None] * len(items)
        self._failed: list[bool] = [False] * len(items)
        self._next = 0
        self._left = len(items)
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not items:
            self._done.set()

    def _take(self) -> int | None:
        with self._lock:
            if self._next == len(self._items):
                return None
            self._next += 1
            return self._next - 1

    def work(self) -> None:
        """Run items until none is left to take."""
        while (index := self._take()) is not None:
            try:
                self._outcomes[index] = self._function(self._items[index])
            except BaseException as error:  # noqa: BLE001 (the caller raises it)
                self._outcomes[index], self._failed[index] = error, True
            with self._lock:
                self._left -= 1
                if not self._left:
                    self._done.set()

    def results(self) -> list[R]:
        """Once every item has run: the results in the order of the items, or the first
        item's error."""
        self._done.wait()
        for outcome, failed in zip(self._outcomes, self._failed, strict=True):
            if failed:
                raise outcome
        return self._outcomes


def _serve() -> None:
    try:
        while True:
            batch = _tasks.get()
            if batch is _STOP:
                return
            try:
                batch.work()
            finally:
                _close_broken_connections()
    finally:
        connections.close_all()


def _ensure(count: int) -> None:
    with _lock:
        _threads[:] = [thread for thread in _threads if thread.is_alive()]
        while len(_threads) < count:
            thread = threading.Thread(
                target=_serve, name=f"tool-call-{len(_threads) + 1}", daemon=True
            )
            thread.start()
            _threads.append(thread)


def parallel_map(function: Callable[[T], R], items: Iterable[T], *, workers: int) -> list[R]:
    """`function` over `items`, at most `workers` at a time (the calling thread and up to
    `workers - 1` of the pool's); results in the order of `items`. An item that raised
    raises once every item has run."""
    items = list(items)
    batch = _Batch(function, items)
    helpers = min(workers, len(items)) - 1
    if helpers > 0:
        _ensure(helpers)
        for _ in range(helpers):
            _tasks.put(batch)
    batch.work()
    return batch.results()


def stop() -> None:
    """End the threads, closing their database connections."""
    with _lock:
        threads, _threads[:] = list(_threads), []
    for _ in threads:
        _tasks.put(_STOP)
    for thread in threads:
        thread.join()
