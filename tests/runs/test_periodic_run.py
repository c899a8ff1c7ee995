"""`manage.py periodic_run`: the periodic work of the embedded default, where no beat and no
worker run. It sends the due entries of the beat's own schedule (django-celery-beat's, as
`celery beat` reads it), which Celery in eager mode runs in its process. Each pass runs as
`make run` starts it, without REDIS_URL, here on the test's PostgreSQL."""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from approvals.choices import ActionStatus
from approvals.models import BusinessAction
from runs.models import Run, TaskOccurrence
from tests.approvals.conftest import waiting_run
from tests.celery_worker import database_url
from tests.config.test_settings import _run
from tests.runs.test_schedules import task_of


def periodic_run_once() -> str:
    """One pass of `manage.py periodic_run --once`; its log."""
    result = _run("manage.py", "periodic_run", "--once", DEBUG="1", DATABASE_URL=database_url())
    assert result.returncode == 0, result.stderr
    return result.stderr


def expired_approval(demo) -> tuple[Run, BusinessAction]:
    run, action = waiting_run(demo)
    BusinessAction.objects.filter(pk=action.pk).update(expires_at=action.created_at)
    return run, action


def assert_waiting(run: Run, action: BusinessAction) -> None:
    assert Run.objects.get(pk=run.pk).status == "WAITING_APPROVAL"
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.WAITING_APPROVAL


def last_ran(*, seconds_ago: float, **names) -> None:
    PeriodicTask.objects.filter(**names).update(
        last_run_at=timezone.now() - timedelta(seconds=seconds_ago)
    )


def test_a_pass_runs_the_due_sweep_that_ends_an_expired_approval_and_nothing_not_due(
    transactional_db, demo
):
    # given a task scheduled Mondays at 09:00 and an approval past its expiry
    task = task_of(demo)
    run, action = expired_approval(demo)

    # while the approvals sweep is not due (the first pass installs the beat's schedule, each
    # entry as last run then), a pass leaves it waiting
    periodic_run_once()
    assert_waiting(run, action)

    # when the sweep last ran more than its minute ago, a pass runs it
    last_ran(name="actions-sweep", seconds_ago=61)
    periodic_run_once()

    # then the approval is ended, and the task, not due, has not fired
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("CANCELLED", "APPROVAL_EXPIRED")
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.EXPIRED
    assert not TaskOccurrence.objects.filter(task=task).exists()

    # and a pass right after does not run the sweep again: a new expired approval waits
    later_run, later_action = expired_approval(demo)
    periodic_run_once()
    assert_waiting(later_run, later_action)


def test_every_due_periodic_task_runs_in_the_pass_none_is_left_to_a_worker(transactional_db):
    # given every task of the beat's schedule last run two hours ago
    periodic_run_once()
    last_ran(name__in=settings.CELERY_BEAT_SCHEDULE, seconds_ago=7200)

    # when a pass runs, then each ran in it, none was sent to a broker no worker reads
    ran = [line for line in periodic_run_once().splitlines() if " succeeded in " in line]
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        assert any(f"Task {entry['task']}[" in line for line in ran), entry["task"]
