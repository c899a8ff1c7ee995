"""The threads that run the independent calls of one step in parallel.

They live as long as the process (a Celery worker child creates them on first use, after the
fork) and each keeps its own database connection between calls: opening a connection per
call would cost more than most read calls. A connection left broken by an error is closed
after its call; `stop` closes every thread's connection and ends the threads (the test
suite calls it before dropping its database).
"""

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

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


def _serve() -> None:
    try:
        while True:
            task = _tasks.get()
            if task is _STOP:
                return
            future, function, argument = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(argument))
            except Exception as error:  # noqa: BLE001 (the caller gets it from the future)
                future.set_exception(error)
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
    """`function` over `items` on at most `workers` threads; results in the order of `items`."""
    items = list(items)
    _ensure(min(workers, len(items)))
    futures: list[Future[Any]] = []
    for item in items:
        future: Future[Any] = Future()
        _tasks.put((future, function, item))
        futures.append(future)
    return [future.result() for future in futures]


def stop() -> None:
    """End the threads, closing their database connections."""
    with _lock:
        threads, _threads[:] = list(_threads), []
    for _ in threads:
        _tasks.put(_STOP)
    for thread in threads:
        thread.join()
