"""The Celery application of the data plane; configuration comes from Django settings."""

import logging
import os

from celery import Celery
from celery.signals import (
    task_postrun,
    task_prerun,
    worker_process_init,
    worker_process_shutdown,
)
from kombu.exceptions import OperationalError

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

logger = logging.getLogger(__name__)

app = Celery("agentgov")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_process_init.connect
def _keep_database_connections(**kwargs) -> None:
    """A worker process runs one task after another: it keeps its database connections for
    WORKER_DB_CONN_MAX_AGE seconds, with Django's health check before a task reuses one,
    instead of opening a PostgreSQL backend per task (about as much CPU as a whole run)."""
    from django.conf import settings
    from django.db import connections

    for alias in connections:
        connections.settings[alias]["CONN_MAX_AGE"] = settings.WORKER_DB_CONN_MAX_AGE
        connections.settings[alias]["CONN_HEALTH_CHECKS"] = True


@worker_process_shutdown.connect
def _send_spans_held(**kwargs) -> None:
    """A pool process ends with os._exit, which runs no exit hook: the spans its export
    batch still holds are sent before it goes."""
    from runs import otel

    otel.shutdown()


@task_prerun.connect
@task_postrun.connect
def _close_old_database_connections(*, task, **kwargs) -> None:
    """Around each task in a worker, as Django does around each request: a connection past
    its age, or left unusable by an error, is closed. An eager task runs inside its caller's
    request or transaction, which owns the connection."""
    from django.db import close_old_connections

    if not task.request.is_eager:
        close_old_connections()


def task_send(task, *, countdown: float | None = None, **kwargs) -> bool:
    """Send `task` with these arguments now, to run now or `countdown` seconds from now. With
    the broker unreachable (kombu gave up after its publish retries), log it and leave the
    work where it is: every task sent this way has a sweep that finds work whose task was
    lost and sends it again. The caller's request, whose work is already committed, is not
    failed for a broker down for a moment. Returns whether the task was sent."""
    try:
        task.apply_async(kwargs=kwargs, countdown=countdown)
    except OperationalError:
        logger.warning(
            "%s%s not sent: the broker is unreachable; its sweep will send it", task.name, kwargs
        )
        return False
    return True
