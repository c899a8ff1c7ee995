"""Scheduled tasks in the admin: created through the service with its beat schedule, refused
field by field, paused and resumed by actions, scoped to the tenants one administers; their
occurrences are read-only."""

import json
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from registry.choices import Role
from registry.services.common import registry_object_save
from registry.services.tenancy import membership_add
from runs.models import ScheduledTask, TaskOccurrence
from runs.services import schedules
from runs.services.scheduler import scheduled_task_fire
from runs.services.schedules import scheduled_task_pause, scheduled_task_save
from tests.locks import until, waiting_on_locks
from tests.runs.conftest import RUNNING_EXAMPLE_TEXT

TASKS = "/admin/runs/scheduledtask/"
OCCURRENCES = "/admin/runs/taskoccurrence/"
NO_OCCURRENCES = {
    "occurrences-TOTAL_FORMS": "0",
    "occurrences-INITIAL_FORMS": "0",
    "occurrences-MIN_NUM_FORMS": "0",
    "occurrences-MAX_NUM_FORMS": "1000",
}


def task_form(demo, **overrides) -> dict:
    return {
        "tenant": str(demo.acme.pk),
        "name": "apollo weekly",
        "owner": str(demo.alice.pk),
        "agent_config": str(demo.agent.pk),
        "goal": RUNNING_EXAMPLE_TEXT,
        "project_id": "apollo",
        "recipient_record_id": "dir-1001",
        "interval_seconds": "",
        "crontab": "0 9 * * 1",
        "deadline_seconds": "3600",
        "max_attempts": "3",
        "is_enabled": "on",
        **NO_OCCURRENCES,
        **overrides,
    }


def saved_task(demo, *, tenant=None, owner=None, agent=None, name="apollo weekly"):
    return scheduled_task_save(
        actor=demo.admin,
        task=ScheduledTask(
            tenant=tenant or demo.acme,
            name=name,
            owner=owner or demo.alice,
            agent_config=agent or demo.agent,
            goal=RUNNING_EXAMPLE_TEXT,
            project_id="apollo",
            crontab="0 9 * * 1",
        ),
    )


def as_opened(page) -> dict:
    """What a task's change page carries of the task as it was opened, to post back."""
    form = page.context["adminform"].form
    return {name: form[name].value() for name in form.fields if name.endswith("_when_opened")}


def next_monday_at_nine() -> datetime:
    now = timezone.now()
    monday = now.replace(hour=9, minute=0, second=0, microsecond=0) + timedelta(
        days=-now.weekday() % 7
    )
    return monday if monday > now else monday + timedelta(days=7)


def messages_of(response) -> list[tuple[str, str]]:
    return [(message.level_tag, str(message)) for message in response.context["messages"]]


def test_creating_a_task_in_the_admin_schedules_it_through_the_service(client, demo):
    client.force_login(demo.admin)

    response = client.post(f"{TASKS}add/", task_form(demo))

    assert response.status_code == 302, response.context["adminform"].form.errors
    task = ScheduledTask.objects.get()
    assert (task.owner, task.project_id, task.recipient_record_id, task.is_enabled) == (
        demo.alice,
        "apollo",
        "dir-1001",
        True,
    )
    periodic = PeriodicTask.objects.get(scheduled_task=task)
    assert periodic.task == "runs.tasks.scheduled_task_fire"
    assert json.loads(periodic.kwargs) == {"task_id": str(task.pk)}
    assert periodic.enabled is True
    assert task.history.get().history_change_reason == "saved in admin"
    assert task.history.get().history_user == demo.admin


def test_the_admin_form_shows_each_refusal_next_to_its_field_and_saves_nothing(client, demo):
    client.force_login(demo.admin)
    erin = get_user_model().objects.get(username="erin")

    response = client.post(
        f"{TASKS}add/", task_form(demo, crontab="0 25 * * 1", owner=str(erin.pk))
    )

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "Invalid end range" in errors["crontab"][0]
    assert "erin is not a member of" in errors["owner"][0]
    assert not ScheduledTask.objects.exists()
    assert not PeriodicTask.objects.filter(task="runs.tasks.scheduled_task_fire").exists()


def test_a_recipient_record_spelled_with_a_look_alike_letter_is_a_form_error(client, demo):
    # given dir-1001 with a Cyrillic i (U+0456), which reads as the directory's record but is not it
    client.force_login(demo.admin)

    response = client.post(f"{TASKS}add/", task_form(demo, recipient_record_id="d\u0456r-1001"))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "letters, numbers, underscores or hyphens" in errors["recipient_record_id"][0]
    assert not ScheduledTask.objects.exists()
    assert not PeriodicTask.objects.filter(task="runs.tasks.scheduled_task_fire").exists()


def test_a_goal_holding_a_credential_is_a_form_error_and_is_kept_nowhere(client, demo):
    client.force_login(demo.admin)
    goal = f"{RUNNING_EXAMPLE_TEXT} Authorization: Bearer 9f8e7d6c5b4a39281706f5e4"

    response = client.post(f"{TASKS}add/", task_form(demo, goal=goal))

    assert response.status_code == 200
    assert "looks like a credential" in response.context["adminform"].form.errors["goal"][0]
    assert not ScheduledTask.objects.exists()
    assert not ScheduledTask.history.exists()


def test_a_saved_tasks_tenant_is_shown_and_not_offered_for_change(client, demo):
    task = saved_task(demo)
    client.force_login(demo.admin)

    page = client.get(f"{TASKS}{task.pk}/change/")
    response = client.post(
        f"{TASKS}{task.pk}/change/",
        task_form(demo, tenant=str(demo.globex.pk), **as_opened(page)),
    )

    assert "tenant" not in page.context["adminform"].form.fields
    assert response.status_code == 302
    assert ScheduledTask.objects.get(pk=task.pk).tenant == demo.acme


def test_pausing_in_the_admin_disables_the_beat_row_and_resuming_enables_it(client, demo):
    task = saved_task(demo)
    client.force_login(demo.admin)

    response = client.post(
        TASKS, {"action": "pause", "_selected_action": [str(task.pk)]}, follow=True
    )

    assert messages_of(response) == [("success", "apollo weekly is paused.")]
    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is False
    assert PeriodicTask.objects.get(scheduled_task=task).enabled is False

    client.post(TASKS, {"action": "resume", "_selected_action": [str(task.pk)]})

    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is True
    assert PeriodicTask.objects.get(scheduled_task=task).enabled is True


def _owner_removed(demo) -> str:
    demo.alice.memberships.all().delete()
    return (
        "owner: alice is not a member of acme who may start runs; the task's runs act as its owner."
    )


def _agent_switched_off(demo) -> str:
    demo.agent.is_active = False
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="switched off")
    return "agent_config: weekly-reporter is not active."


@pytest.mark.parametrize("put_wrong", [_owner_removed, _agent_switched_off])
def test_a_task_paused_for_a_refused_start_is_not_resumed_until_it_is_put_right(
    client, demo, put_wrong
):
    # given a task the platform paused when its start was refused
    task = saved_task(demo)
    reason = put_wrong(demo)
    scheduled_task_fire(task_id=task.pk)
    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is False
    client.force_login(demo.admin)

    # when an admin resumes it without putting it right
    response = client.post(
        TASKS, {"action": "resume", "_selected_action": [str(task.pk)]}, follow=True
    )

    # then it is refused, saying why, and the task stays paused
    assert messages_of(response) == [("error", f"The scheduled task is not valid. {reason}")]
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.is_enabled, task.periodic_task.enabled) == (False, False)
    assert task.history.order_by("history_id").last().history_change_reason.startswith("paused")


def test_a_page_opened_before_the_platform_paused_the_task_does_not_resume_it(client, demo):
    # given a task's page opened while it fires, then the platform pausing the task
    task = saved_task(demo)
    client.force_login(demo.admin)
    page = client.get(f"{TASKS}{task.pk}/change/")
    opened = as_opened(page)
    schedules.scheduled_task_refused_pause(task=task, refusal="agent_inactive: switched off")

    # when the admin saves the page as it was opened, with a new goal
    response = client.post(
        f"{TASKS}{task.pk}/change/",
        task_form(demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.", **opened),
    )

    # then the form asks to reload it, and the task stays paused, as it was
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["is_enabled"] == [
        "The task was paused since this page was opened: reload the page to see it as it is "
        "now (its history says why), then save again."
    ]
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.goal, task.is_enabled, task.periodic_task.enabled) == (
        RUNNING_EXAMPLE_TEXT,
        False,
        False,
    )
    assert task.history.order_by("history_id").last().history_change_reason == (
        "paused: agent_inactive: switched off"
    )


def test_a_page_opened_after_a_pause_saves_and_may_resume_the_task(client, demo):
    task = saved_task(demo)
    scheduled_task_pause(actor=demo.admin, task=task)
    client.force_login(demo.admin)
    page = client.get(f"{TASKS}{task.pk}/change/")
    opened = as_opened(page)

    response = client.post(f"{TASKS}{task.pk}/change/", task_form(demo, **opened))

    assert response.status_code == 302
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.is_enabled, task.periodic_task.enabled) == (True, True)


def test_a_save_that_does_not_say_how_its_page_found_the_task_does_not_resume_it(client, demo):
    # given a paused task
    task = saved_task(demo)
    scheduled_task_pause(actor=demo.admin, task=task)
    client.force_login(demo.admin)

    # when a save posted without the page's record of the task's switch (a script, a page
    # drawn before the form carried it) asks for the task to fire, with a new goal
    response = client.post(
        f"{TASKS}{task.pk}/change/", task_form(demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.")
    )

    # then it is refused as from a stale page, and the task stays paused, unchanged
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["is_enabled"] == [
        "This save does not say whether the task was paused when its page was opened, so it "
        "could undo a pause made since: reload the page, then save again."
    ]
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.goal, task.is_enabled, task.periodic_task.enabled) == (
        RUNNING_EXAMPLE_TEXT,
        False,
        False,
    )
    assert [record.history_change_reason for record in task.history.order_by("history_id")] == [
        "saved",
        "paused",
    ]


def test_a_page_opened_before_another_admin_saved_the_task_does_not_undo_their_change(client, demo):
    # given two admins with the task's page open, and the first moving it to Tuesdays
    task = saved_task(demo)
    client.force_login(demo.admin)
    first = client.get(f"{TASKS}{task.pk}/change/")
    second = client.get(f"{TASKS}{task.pk}/change/")
    as_saved = {"recipient_record_id": ""}
    moved = client.post(
        f"{TASKS}{task.pk}/change/",
        task_form(demo, crontab="0 9 * * 2", **as_saved, **as_opened(first)),
    )
    assert moved.status_code == 302

    # when the second saves the page as they opened it, with a new goal
    response = client.post(
        f"{TASKS}{task.pk}/change/",
        task_form(
            demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.", **as_saved, **as_opened(second)
        ),
    )

    # then it is refused, naming what changed and asking to reload; the first change stands
    # and nothing of the second is written
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert form.non_field_errors() == [
        "The scheduled task was changed since this page was opened: crontab. Reload the page "
        "to see it as it is now, then make your change again."
    ]
    assert form.errors["crontab"] == ["Changed since this page was opened."]
    task = ScheduledTask.objects.select_related("periodic_task__crontab").get(pk=task.pk)
    assert (task.goal, task.crontab, task.periodic_task.crontab.day_of_week) == (
        RUNNING_EXAMPLE_TEXT,
        "0 9 * * 2",
        "2",
    )
    assert [record.history_change_reason for record in task.history.order_by("history_id")] == [
        "saved",
        "saved in admin",
    ]


def test_a_save_that_does_not_say_which_version_its_page_showed_changes_nothing(client, demo):
    task = saved_task(demo)
    client.force_login(demo.admin)
    page = client.get(f"{TASKS}{task.pk}/change/")
    opened = {"is_enabled_when_opened": as_opened(page)["is_enabled_when_opened"]}

    response = client.post(
        f"{TASKS}{task.pk}/change/",
        task_form(demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.", **opened),
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.non_field_errors() == [
        "This save does not say which version of the task its page was opened at, so it could "
        "undo a change made since: reload the page, then save again."
    ]
    task = ScheduledTask.objects.get(pk=task.pk)
    assert task.goal == RUNNING_EXAMPLE_TEXT
    assert task.history.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_task_saved_in_the_admin_while_another_save_holds_it_is_refused_after_it(
    client, demo, monkeypatch
):
    # given a task's page opened, and another save of the task that has taken its row and
    # is about to switch its beat row to Tuesdays
    task = saved_task(demo)
    client.force_login(demo.admin)
    page = f"{TASKS}{task.pk}/change/"
    opened = as_opened(client.get(page))
    switch_beat_row = schedules._periodic_task_sync
    saving_holds_the_task = threading.Event()

    def moved_to_tuesdays() -> None:
        try:
            other = ScheduledTask.objects.get(pk=task.pk)
            other.crontab = "0 9 * * 2"
            scheduled_task_save(actor=demo.admin, task=other)
        finally:
            connection.close()

    saving = threading.Thread(target=moved_to_tuesdays)

    def switched_once_the_save_waits(each: ScheduledTask):
        if threading.current_thread() is saving:
            saving_holds_the_task.set()
            until(lambda: waiting_on_locks() == 1)
        return switch_beat_row(each)

    monkeypatch.setattr(schedules, "_periodic_task_sync", switched_once_the_save_waits)
    saving.start()
    assert saving_holds_the_task.wait(timeout=20)

    # when the admin saves the page with a new goal meanwhile
    response = client.post(
        page, task_form(demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.", **opened)
    )
    saving.join(timeout=30)

    # then the save waits for the other, finds the crontab changed since the page was
    # opened, and is refused: the other save stands, and nothing of this one is written
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["crontab"] == [
        "Changed since this page was opened."
    ]
    task = ScheduledTask.objects.select_related("periodic_task__crontab").get(pk=task.pk)
    assert (task.goal, task.crontab, task.periodic_task.crontab.day_of_week) == (
        RUNNING_EXAMPLE_TEXT,
        "0 9 * * 2",
        "2",
    )
    assert task.history.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_task_saved_in_the_admin_while_it_is_being_paused_is_refused_after_the_pause(
    client, demo, monkeypatch
):
    # given a task's page opened while it fires, and a pause that has taken the task's row
    # and is about to switch its beat row
    task = saved_task(demo)
    client.force_login(demo.admin)
    page = f"{TASKS}{task.pk}/change/"
    opened = as_opened(client.get(page))
    switch_beat_row = schedules._periodic_task_sync
    pausing_holds_the_task = threading.Event()
    outcomes = {}

    def pause() -> None:
        try:
            outcomes["pause"] = scheduled_task_pause(actor=demo.admin, task=task)
        finally:
            connection.close()

    pausing = threading.Thread(target=pause)

    def switched_once_the_save_waits(each: ScheduledTask):
        if threading.current_thread() is pausing:
            pausing_holds_the_task.set()
            until(lambda: waiting_on_locks() == 1)
        return switch_beat_row(each)

    monkeypatch.setattr(schedules, "_periodic_task_sync", switched_once_the_save_waits)
    pausing.start()
    assert pausing_holds_the_task.wait(timeout=20)

    # when the admin saves the page with a new goal meanwhile
    response = client.post(
        page,
        task_form(demo, goal=f"{RUNNING_EXAMPLE_TEXT} Keep it short.", **opened),
    )
    pausing.join(timeout=30)

    # then the save waits for the pause, finds the task paused since the page was opened,
    # and is refused: the task stays paused, and its beat row with it
    assert response.status_code == 200
    assert "is_enabled" in response.context["adminform"].form.errors
    assert outcomes["pause"].is_enabled is False
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.goal, task.is_enabled, task.periodic_task.enabled) == (
        RUNNING_EXAMPLE_TEXT,
        False,
        False,
    )
    assert [record.history_change_reason for record in task.history.order_by("history_id")] == [
        "saved",
        "paused",
    ]


@pytest.mark.django_db(transaction=True)
def test_a_task_named_as_one_another_admin_created_meanwhile_is_a_form_error(
    client, demo, monkeypatch
):
    # given another admin creating acme's "apollo weekly" just after this form was checked
    check = schedules.full_clean_or_raise

    def created_meanwhile() -> None:
        try:
            saved_task(demo)
        finally:
            connection.close()

    creating = threading.Thread(target=created_meanwhile)

    def checked_then_created_meanwhile(task: ScheduledTask, **kwargs) -> None:
        check(task, **kwargs)
        # once, after this form's check: the other admin's own save is checked too
        if creating.ident is None:
            creating.start()
            creating.join(timeout=30)

    monkeypatch.setattr(schedules, "full_clean_or_raise", checked_then_created_meanwhile)
    client.force_login(demo.admin)

    # when this admin creates a task of that name
    response = client.post(f"{TASKS}add/", task_form(demo, crontab="0 10 * * 1"))

    # then the form says once that the name is taken, and the other task alone is scheduled
    assert response.status_code == 200
    assert response.content.decode().count("Scheduled task with this Tenant and Name") == 1
    assert response.context["adminform"].form.non_field_errors() == [
        "Scheduled task with this Tenant and Name already exists.",
        "The submitted values are not valid.",
    ]
    task = ScheduledTask.objects.get()
    assert task.periodic_task.crontab.hour == "9"
    assert PeriodicTask.objects.filter(task="runs.tasks.scheduled_task_fire").get() == (
        task.periodic_task
    )


@pytest.mark.parametrize("row", ["periodictask", "crontabschedule"])
def test_the_beat_rows_a_task_fires_by_are_not_deleted_from_under_it(client, demo, row):
    # given a task, and a platform admin deleting in the beat's admin the row that fires it,
    # or the crontab that row runs on
    task = saved_task(demo)
    periodic = task.periodic_task
    pk = periodic.pk if row == "periodictask" else periodic.crontab_id
    client.force_login(demo.admin)

    response = client.post(f"/admin/django_celery_beat/{row}/{pk}/delete/", {"post": "yes"})

    # then it is refused for the scheduled task that needs it, and the task still fires by it
    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>Cannot delete" in html
    assert "<li>scheduled task</li>" in html
    task.refresh_from_db()
    assert task.periodic_task == periodic
    assert PeriodicTask.objects.get(scheduled_task=task).crontab_id == periodic.crontab_id
    assert periodic.enabled is True


BEAT = "/admin/django_celery_beat"
NO_PERIODIC_TASKS = {
    "periodictask_set-TOTAL_FORMS": "0",
    "periodictask_set-INITIAL_FORMS": "0",
    "periodictask_set-MIN_NUM_FORMS": "0",
    "periodictask_set-MAX_NUM_FORMS": "1000",
}


def beat_change(task, row: str) -> tuple[str, dict, Callable[[], object]]:
    """The change page of a beat row the task fires by, a valid form moving the task's
    firing elsewhere, and what of the row that form would change."""
    periodic = task.periodic_task
    if row == "periodictask":
        form = {
            "name": periodic.name,
            "task": periodic.task,
            "description": "",
            "crontab": str(periodic.crontab_id or ""),
            "interval": str(periodic.interval_id or ""),
            "args": "[]",
            "kwargs": periodic.kwargs,
            "headers": "{}",
        }
        return (
            f"{BEAT}/periodictask/{periodic.pk}/change/",
            form,
            lambda: PeriodicTask.objects.get(pk=periodic.pk).enabled,
        )
    if row == "crontabschedule":
        crontab = periodic.crontab
        form = {
            "minute": "30",
            "hour": "9",
            "day_of_month": "*",
            "month_of_year": "*",
            "day_of_week": "1",
            "timezone": "Europe/Paris",
            **NO_PERIODIC_TASKS,
        }
        return (
            f"{BEAT}/crontabschedule/{crontab.pk}/change/",
            form,
            lambda: CrontabSchedule.objects.values_list("minute", "timezone").get(pk=crontab.pk),
        )
    interval = periodic.interval
    return (
        f"{BEAT}/intervalschedule/{interval.pk}/change/",
        {"every": "7200", "period": "seconds", **NO_PERIODIC_TASKS},
        lambda: IntervalSchedule.objects.values_list("every", flat=True).get(pk=interval.pk),
    )


@pytest.mark.parametrize("row", ["periodictask", "crontabschedule", "intervalschedule"])
def test_the_beat_rows_a_task_fires_by_are_shown_read_only_and_not_changed(client, demo, row):
    # given a task, and a platform admin changing in the beat's admin the row that fires it
    # (switching it off), or the crontab or interval it runs on
    task = saved_task(demo)
    if row == "intervalschedule":
        task.crontab, task.interval_seconds = "", 3600
        task = scheduled_task_save(actor=demo.admin, task=task)
    page, form, state = beat_change(task, row)
    before = state()
    client.force_login(demo.admin)

    shown = client.get(page)
    response = client.post(page, form, follow=True)

    # then the page shows the row read-only and says the task's page changes it, and a change
    # posted anyway is refused with that message: the task fires as its page says
    link = f'<a href="{TASKS}{task.pk}/change/">apollo weekly (acme)</a>'
    assert shown.status_code == 200
    assert shown.context["has_change_permission"] is False
    assert [(level, text) for level, text in messages_of(shown) if link in text]
    assert response.redirect_chain == [(page, 302)]
    error = [text for level, text in messages_of(response) if level == "error"]
    assert len(error) == 1 and error[0].startswith("Nothing was changed.") and link in error[0]
    assert state() == before
    assert PeriodicTask.objects.get(scheduled_task=task).enabled is True


@pytest.mark.parametrize("row", ["periodictask", "crontabschedule", "intervalschedule"])
def test_the_beat_rows_a_task_fires_by_name_it_to_no_one_who_may_not_see_them(client, demo, row):
    # given acme's task, and globex's tenant admin, staff, who may not see the beat's rows
    task = saved_task(demo)
    if row == "intervalschedule":
        task.crontab, task.interval_seconds = "", 3600
        task = scheduled_task_save(actor=demo.admin, task=task)
    page, form, state = beat_change(task, row)
    before = state()
    globex_admin = get_user_model().objects.create_user(username="gina", is_staff=True)
    membership_add(actor=None, user=globex_admin, tenant=demo.globex, role=Role.ADMIN)
    client.force_login(globex_admin)

    # when they open the row's page, or post a change to it, and then go to their admin
    shown = client.get(page)
    posted = client.post(page, form)
    home = client.get("/admin/")

    # then both are refused, nothing changed, and no message names acme's task
    assert (shown.status_code, posted.status_code) == (403, 403)
    assert state() == before
    assert messages_of(home) == []
    assert "apollo weekly" not in home.content.decode()


@pytest.mark.parametrize("action", ["disable_tasks", "toggle_tasks", "enable_tasks", "run_tasks"])
def test_the_beats_bulk_actions_leave_a_tasks_periodic_task_alone_and_say_so(client, demo, action):
    # given a task, paused or not, and another periodic task, both selected for a bulk action
    task = saved_task(demo)
    if action == "enable_tasks":
        task = scheduled_task_pause(actor=demo.admin, task=task)
    enabled = task.periodic_task.enabled
    other = PeriodicTask.objects.create(
        name="nightly",
        task="runs.tasks.memories_expire",
        interval=IntervalSchedule.objects.create(every=1, period=IntervalSchedule.DAYS),
        enabled=action != "enable_tasks",
    )
    selection = [str(task.periodic_task.pk)] + ([] if action == "run_tasks" else [str(other.pk)])
    client.force_login(demo.admin)

    response = client.post(
        f"{BEAT}/periodictask/", {"action": action, "_selected_action": selection}, follow=True
    )

    # then the task's periodic task is skipped with a message pointing to the task's page,
    # and the other one is handled
    assert PeriodicTask.objects.get(pk=task.periodic_task.pk).enabled is enabled
    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is enabled
    said = messages_of(response)
    assert said[0] == (
        "warning",
        f'Skipped the periodic tasks of the scheduled tasks <a href="{TASKS}{task.pk}/change/">'
        "apollo weekly (acme)</a>: pause, resume or change a scheduled task on its own page.",
    )
    if action == "run_tasks":
        assert said == said[:1]
    else:
        assert PeriodicTask.objects.get(pk=other.pk).enabled is (action == "enable_tasks")
        assert len(said) == 2


def test_a_crontab_the_platform_runs_on_stays_its_to_change_when_a_task_has_the_same(client, demo):
    # given a platform periodic task on Mondays at 09:00, then a task on the same crontab
    platform = PeriodicTask.objects.create(
        name="monday report",
        task="runs.tasks.memories_expire",
        crontab=CrontabSchedule.objects.create(minute="0", hour="9", day_of_week="1"),
    )
    task = saved_task(demo)
    page = f"{BEAT}/crontabschedule/{platform.crontab_id}/change/"
    form = {
        "minute": "30",
        "hour": "9",
        "day_of_month": "*",
        "month_of_year": "*",
        "day_of_week": "1",
        "timezone": "UTC",
        "periodictask_set-TOTAL_FORMS": "1",
        "periodictask_set-INITIAL_FORMS": "1",
        "periodictask_set-MIN_NUM_FORMS": "0",
        "periodictask_set-MAX_NUM_FORMS": "1000",
        "periodictask_set-0-id": str(platform.pk),
        "periodictask_set-0-crontab": str(platform.crontab_id),
    }
    client.force_login(demo.admin)

    # when the platform admin moves their crontab to 09:30
    response = client.post(page, form)

    # then it moves, and the task, on a crontab of its own, still fires at 09:00
    assert response.status_code == 302
    assert CrontabSchedule.objects.get(pk=platform.crontab_id).minute == "30"
    crontab = PeriodicTask.objects.get(scheduled_task=task).crontab
    assert (crontab.minute, crontab.hour, crontab.day_of_week) == ("0", "9", "1")


def test_a_tenant_admin_sees_and_offers_only_their_tenants_tasks_owners_and_agents(client, demo):
    acme_admin = get_user_model().objects.create_user(
        username="ada", password="x", email="ada@example.com", is_staff=True
    )
    membership_add(actor=None, user=acme_admin, tenant=demo.acme, role=Role.ADMIN)
    erin = get_user_model().objects.get(username="erin")
    acme_task = saved_task(demo)
    client.force_login(acme_admin)

    listed = client.get(TASKS)
    add = client.get(f"{TASKS}add/")

    assert [row.pk for row in listed.context["cl"].result_list] == [acme_task.pk]
    form = add.context["adminform"].form
    assert erin not in form.fields["owner"].queryset
    assert demo.alice in form.fields["owner"].queryset
    assert list(form.fields["agent_config"].queryset) == [demo.agent]
    assert list(form.fields["tenant"].queryset) == [demo.acme]


def test_a_member_cannot_open_the_scheduled_tasks(client, demo):
    demo.alice.is_staff = True
    demo.alice.save(update_fields=["is_staff"])
    saved_task(demo)
    client.force_login(demo.alice)

    assert client.get(TASKS).status_code == 403
    assert client.get(OCCURRENCES).status_code == 403


def test_a_task_page_shows_its_next_run_and_its_occurrences_read_only(client, demo):
    task = saved_task(demo)
    occurrence = scheduled_task_fire(task_id=task.pk)
    client.force_login(demo.admin)

    page = client.get(f"{TASKS}{task.pk}/change/")
    occurrence_page = client.get(f"{OCCURRENCES}{occurrence.pk}/change/")
    edit = client.post(f"{OCCURRENCES}{occurrence.pk}/change/", {"status": "completed"})

    assert page.status_code == 200
    html = page.content.decode()
    assert f'href="/runs/{occurrence.run_id}/"' in html
    assert "running" in html
    assert f"{next_monday_at_nine():%Y-%m-%d %H:%M:%S}" in html
    assert occurrence_page.status_code == 200
    assert f'href="/runs/{occurrence.run_id}/"' in occurrence_page.content.decode()
    assert edit.status_code == 403
    assert TaskOccurrence.objects.get(pk=occurrence.pk).status == "running"
    assert client.get(f"{OCCURRENCES}add/").status_code == 403


@pytest.mark.parametrize(
    "crontab",
    ["0,,1 9 * * 1", "- 9 * * 1", "0 9 * * " + ",".join(["1", "2", "3", "4", "5"] * 7)],
    ids=["empty-part", "negative", "day-of-week-too-long"],
)
def test_a_crontab_celery_cannot_parse_or_beat_cannot_store_is_a_form_error(client, demo, crontab):
    client.force_login(demo.admin)

    response = client.post(f"{TASKS}add/", task_form(demo, crontab=crontab))

    assert response.status_code == 200
    assert "crontab" in response.context["adminform"].form.errors
    assert not ScheduledTask.objects.exists()
