"""Scheduled tasks on real connections: the beat's database schedule holds an enabled task;
beats firing one slot at once make one occurrence and one run; a task fired as the beat fires
it runs through a real worker to its approval."""

import json
import threading
from datetime import datetime, timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from django_celery_beat.schedulers import DatabaseScheduler

from config.celery import app
from registry.models import AgentConfig, Tenant
from runs import tasks
from runs.choices import OccurrenceStatus, RunStatus
from runs.models import IngressRecord, Run, ScheduledTask, TaskOccurrence
from runs.services.scheduler import scheduled_task_fire
from runs.services.schedules import schedule_slot, scheduled_task_pause, scheduled_task_save
from tests.celery_worker import (
    EXAMPLE_EVENTS,
    event_types,
    example_seed,
    queue_purge,
    queued_run_ids,
    queued_tasks,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "Summarise this week's project status and mail it to the R&D lead."


def weekly_task(**fields) -> ScheduledTask:
    """acme's weekly apollo summary, acting as alice, saved by acme's admin."""
    users = get_user_model().objects
    return scheduled_task_save(
        actor=users.get(username="admin"),
        task=ScheduledTask(
            tenant=Tenant.objects.get(slug="acme"),
            name="apollo weekly",
            owner=users.get(username="alice"),
            agent_config=AgentConfig.objects.get(name="weekly-reporter"),
            goal=GOAL,
            project_id="apollo",
            **{"crontab": "0 9 * * 1", **fields},
        ),
    )


def test_the_beat_fires_an_enabled_task_and_sweeps_and_drops_the_task_once_paused():
    example_seed()
    # every hour: the scheduler loads a crontab only within two hours of its hour
    task = weekly_task(crontab="0 * * * *")

    entries = DatabaseScheduler(app=app).schedule

    fire = entries[f"scheduled-task:{task.pk}"]
    assert (fire.task, fire.kwargs) == ("runs.tasks.scheduled_task_fire", {"task_id": str(task.pk)})
    assert "runs.tasks.scheduled_task_fire" in app.tasks
    sweep = entries["scheduled-tasks-sweep"]
    assert sweep.task == "runs.tasks.scheduled_tasks_sweep"
    assert sweep.schedule.run_every == timedelta(seconds=30)
    assert "runs.tasks.scheduled_tasks_sweep" in app.tasks

    scheduled_task_pause(actor=get_user_model().objects.get(username="admin"), task=task)

    assert f"scheduled-task:{task.pk}" not in DatabaseScheduler(app=app).schedule


@pytest.mark.parametrize("beats", [2, 8])
def test_beats_firing_one_slot_at_once_make_one_occurrence_and_one_run(celery_queue, beats):
    # given a task, and beats that fire it at the same moment, each on its own connection
    example_seed()
    task = weekly_task()
    queue_purge()
    barrier = threading.Barrier(beats)
    outcomes: list[TaskOccurrence | None] = []

    def beat() -> None:
        barrier.wait()
        try:
            outcomes.append(scheduled_task_fire(task_id=task.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=beat) for _ in range(beats)]

    # when
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # then one beat made the occurrence and its run, the others did nothing
    try:
        assert sorted(outcome is None for outcome in outcomes) == [False] + [True] * (beats - 1)
        occurrence = TaskOccurrence.objects.select_related("run").get()
        assert (occurrence.status, occurrence.attempts) == (OccurrenceStatus.RUNNING, 1)
        assert Run.objects.count() == 1
        assert IngressRecord.objects.count() == 1
        assert occurrence.run.status == RunStatus.QUEUED
        assert queued_run_ids() == [str(occurrence.run_id)]
    finally:
        queue_purge()


def test_a_firing_is_for_the_slot_the_beat_sent_it_in_however_late_it_is_delivered(celery_queue):
    # given an hourly task with a deadline of two hours, and what the beat sends for it an
    # hour ago and now
    example_seed()
    task = weekly_task(crontab="", interval_seconds=3600, deadline_seconds=7200)
    queue_purge()
    periodic = task.periodic_task
    before = timezone.now()
    app.send_task(periodic.task, kwargs=json.loads(periodic.kwargs))
    after = timezone.now()
    [(name, sent)] = queued_tasks()
    queue_purge()
    assert name == "runs.tasks.scheduled_task_fire"
    assert before <= datetime.fromisoformat(sent["sent_at"]) <= after
    an_hour_ago = {**sent, "sent_at": (before - timedelta(hours=1)).isoformat()}

    # when the firing sent an hour ago is delivered now, twice (a redelivery), then today's
    try:
        late = tasks.scheduled_task_fire(**an_hour_ago)
        redelivered = tasks.scheduled_task_fire(**an_hour_ago)
        on_time = tasks.scheduled_task_fire(**sent)

        # then the late one fires the slot it was sent in, once, and today's its own
        assert late is not None and on_time is not None and redelivered is None
        slots = {str(pk): slot for pk, slot in TaskOccurrence.objects.values_list("pk", "slot")}
        assert slots == {
            late: schedule_slot(task, before - timedelta(hours=1)),
            on_time: schedule_slot(task, before),
        }
        assert Run.objects.count() == 2
    finally:
        queue_purge()


def test_a_task_fired_as_the_beat_fires_it_waits_for_approval_through_the_worker(start_worker):
    example_seed()
    task = weekly_task()
    queue_purge()
    worker = start_worker()

    # what the beat sends for the task's PeriodicTask
    periodic = task.periodic_task
    app.send_task(periodic.task, kwargs=json.loads(periodic.kwargs))

    occurrence = wait_until(
        lambda: TaskOccurrence.objects.filter(
            task=task, status=OccurrenceStatus.WAITING_APPROVAL
        ).first(),
        seconds=60,
        what="the occurrence to wait for approval",
        worker=worker,
    )
    run = Run.objects.get(pk=occurrence.run_id)
    assert (run.status, run.channel, run.actor.username) == (
        RunStatus.WAITING_APPROVAL,
        "task",
        "alice",
    )
    assert event_types(str(run.pk)) == EXAMPLE_EVENTS
    assert run.state["inputs"]["project_id"] == "apollo"
    assert run.state["recipient"]["corporate_email"] == "li.wei@acme.example"
    assert run.action.status == "waiting_approval"
    assert worker.tasks_succeeded("runs.tasks.scheduled_task_fire") == 1
    assert worker.tasks_succeeded("runs.tasks.run_advance") == 1
    assert Run.objects.count() == 1
