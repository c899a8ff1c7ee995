"""The threads that run the independent calls of one step in parallel, and the threads that
run Python tool handlers under their timeout.

The calling thread takes part: it runs calls of the step too, and the pool's threads take
the others as they come free, so a step's calls never wait behind each other more than the
cap requires, and a step whose calls do not block hands little over between threads.
The pool's threads live as long as the process (a Celery worker child creates them on
first use, after the fork) and each keeps its own database connection between calls:
opening a connection per call would cost more than most read calls. A connection left
broken by an error is closed after its call; `stop` closes every thread's connection and
ends the threads (the test suite calls it before dropping its database).

A Python handler runs on a handler thread of its own, so the call can stop waiting for it
(`call_within`): Python cannot stop a thread, so a handler that has not answered in time is
abandoned. The statement its database connections are running then is cancelled: a handler
waiting on a slow query gets an error at once and usually returns. Its thread is never
given work again: it runs on until its handler returns, then drops the late answer, closes
its database connections (rolling back whatever the handler left open) and ends; the next
call takes another thread. The limit: until then an abandoned handler still holds its thread
and its database connection, and keeps doing whatever else it does. A handler that
answered in time leaves its thread idle for the next call, which reuses it and its
connection (closed first if it saw a database error); a handler that left a transaction
open ends its thread, whose connections close, rolling the transaction back.
"""

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()
# How long cancelling an abandoned handler's statement may take to reach the database.
CANCEL_TIMEOUT_SECONDS = 5
_lock = threading.Lock()
_tasks: queue.SimpleQueue = queue.SimpleQueue()
_threads: list[threading.Thread] = []


def _close_broken_connections() -> None:
    """A connection that saw a database error is closed (the next call opens a new one);
    asking a healthy one whether it is usable would cost a round trip per call."""
    for connection in connections.all(initialized_only=True):
        if connection.errors_occurred:
            connection.close()


def _transaction_left_open() -> bool:
    """Whether a connection of this thread is still inside a transaction."""
    return any(
        connection.in_atomic_block
        or (connection.connection is not None and not connection.autocommit)
        for connection in connections.all(initialized_only=True)
    )


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


class Overran(Exception):
    """The function did not return within its time: its thread was abandoned."""


class _HandlerThread:
    """A thread that runs one function at a time for `call_within`, on its own database
    connection, until it is stopped or abandoned."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.is_abandoned = False
        self.abandoned_at = 0.0
        self.databases: list[BaseDatabaseWrapper] = []
        self.thread = threading.Thread(
            target=self._serve, name=f"tool-handler-{next(_handler_numbers)}", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        self.databases = [connections[alias] for alias in connections]
        try:
            while True:
                job = self.work.get()
                if job is _STOP:
                    return
                function, arguments = job
                try:
                    answer = (True, function(*arguments))
                except BaseException as error:  # noqa: BLE001 (the caller raises it)
                    answer = (False, error)
                is_reusable = not _transaction_left_open()
                _close_broken_connections()
                with _lock:
                    if self.is_abandoned:
                        _abandoned.discard(self)
                        logger.warning(
                            "A handler abandoned %.1f s ago returned; its answer was dropped "
                            "and its thread ends.",
                            time.monotonic() - self.abandoned_at,
                        )
                        return
                    self.answers.put((*answer, is_reusable))
                if not is_reusable:
                    return
        finally:
            connections.close_all()

    def statements_cancel(self) -> None:
        """Ask the database to cancel what each connection of the thread is running, from
        another thread (PostgreSQL: a cancel request on a connection of its own; SQLite: an
        interrupt). A connection running nothing ignores it."""
        for database in self.databases:
            driver = database.connection
            if driver is None or getattr(driver, "closed", False):
                continue
            try:
                if database.vendor == "postgresql":
                    driver.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
                elif database.vendor == "sqlite":
                    driver.interrupt()
            except Exception as error:  # noqa: BLE001 (the call has failed TIMEOUT already)
                logger.warning("The abandoned handler's statement was not cancelled: %s", error)


_handler_numbers = itertools.count(1)
_idle: list[_HandlerThread] = []
_abandoned: set[_HandlerThread] = set()


def call_within(function: Callable[..., R], *arguments: Any, seconds: float) -> R:
    """`function(*arguments)` on a handler thread, waited for at most `seconds`: its result, or
    what it raised; Overran when it has not returned by then (it runs on, abandoned, and
    what it returns or raises later is dropped)."""
    with _lock:
        handler = _idle.pop() if _idle else None
    if handler is None:
        handler = _HandlerThread()
    handler.work.put((function, arguments))
    try:
        answer = handler.answers.get(timeout=seconds)
    except queue.Empty:
        answer = _answer_or_abandon(handler)
        if answer is None:
            handler.statements_cancel()
            raise Overran(
                f"No answer within {seconds:g} s; {abandoned_count()} abandoned handler "
                "thread(s) still run."
            ) from None
    returned, outcome, is_reusable = answer
    if is_reusable:
        with _lock:
            _idle.append(handler)
    if not returned:
        raise outcome
    return outcome


def _answer_or_abandon(handler: _HandlerThread) -> tuple | None:
    """The answer that came as the wait ended, or None: the handler is abandoned."""
    with _lock:
        try:
            return handler.answers.get_nowait()
        except queue.Empty:
            handler.is_abandoned, handler.abandoned_at = True, time.monotonic()
            _abandoned.add(handler)
            return None


def abandoned_count() -> int:
    """How many abandoned handler threads still run."""
    with _lock:
        return len(_abandoned)


def stop(*, abandoned_wait_s: float = 0) -> None:
    """End the threads, closing their database connections; wait up to `abandoned_wait_s`
    for abandoned handler threads to end."""
    with _lock:
        threads, _threads[:] = list(_threads), []
        handlers, _idle[:] = list(_idle), []
        abandoned = list(_abandoned)
    for _ in threads:
        _tasks.put(_STOP)
    for handler in handlers:
        handler.work.put(_STOP)
    for thread in [*threads, *(handler.thread for handler in handlers)]:
        thread.join()
    deadline = time.monotonic() + abandoned_wait_s
    for handler in abandoned:
        handler.thread.join(max(deadline - time.monotonic(), 0))
