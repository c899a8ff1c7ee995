"""Scheduled tasks through the services: the beat schedule a task keeps, the slot a firing is
for, one run per occurrence across retried starts, the deadline, the owner's one
notification, and a goal, project and recipient nothing but the task decides."""

import json
import logging
from datetime import UTC, datetime, timedelta

import pytest
from django.db import OperationalError
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from approvals import services as approvals
from approvals.choices import ActionStatus, Decision
from approvals.errors import AlreadyDecided
from approvals.models import ApprovalDecision, BusinessAction
from examples.models import DirectoryRecord, MailDelivery
from registry.models import AgentConfig, Policy
from registry.services.common import registry_object_save
from runs.choices import OccurrenceStatus, RunStatus
from runs.errors import PermissionDenied, ValidationFailed
from runs.loop import run_advance_step, run_execute
from runs.models import (
    CancelRequest,
    IngressRecord,
    Run,
    ScheduledTask,
    Session,
    TaskOccurrence,
    ToolCall,
)
from runs.services import scheduler
from runs.services.ingress import message_ingest
from runs.services.runs import run_cancel
from runs.services.scheduler import (
    occurrence_start,
    occurrences_sweep,
    scheduled_task_fire,
)
from runs.services.schedules import (
    schedule_next_run,
    schedule_slot,
    scheduled_task_pause,
    scheduled_task_resume,
    scheduled_task_save,
)
from tests.approvals import conftest as approvals_fixtures
from tests.celery_worker import alice_client
from tests.runs.conftest import (
    MESSAGES,
    RUNNING_EXAMPLE_TEXT,
    apollo_draft,
    event_types,
    events_of,
    message_body,
    read_apollo,
    this_week,
)
from tests.runs.fake_provider import openai_completion

bob = approvals_fixtures.bob
smtp_server = approvals_fixtures.smtp_server

MONDAYS_AT_NINE = "0 9 * * 1"
LEASE = timedelta(seconds=61)
PAST_DEADLINE = timedelta(seconds=3601)


def task_of(demo, *, name: str = "apollo weekly", **fields) -> ScheduledTask:
    """A task of acme saved by its tenant admin, acting as alice, Mondays at 09:00."""
    values = {
        "tenant": demo.acme,
        "name": name,
        "owner": demo.alice,
        "agent_config": demo.agent,
        "goal": RUNNING_EXAMPLE_TEXT,
        "project_id": "apollo",
        "crontab": MONDAYS_AT_NINE,
        "deadline_seconds": 3600,
        **fields,
    }
    return scheduled_task_save(actor=demo.admin, task=ScheduledTask(**values))


def fired(demo, **fields) -> TaskOccurrence:
    """A task fired now, with its run created and queued."""
    occurrence = scheduled_task_fire(task_id=task_of(demo, **fields).pk)
    assert occurrence.run.status == RunStatus.QUEUED
    return occurrence


def refreshed(occurrence: TaskOccurrence) -> TaskOccurrence:
    return TaskOccurrence.objects.select_related("run").get(pk=occurrence.pk)


def fired_and_approved(demo, bob) -> tuple[TaskOccurrence, BusinessAction]:
    """A task fired now, its run waiting for approval of its mail, and bob's approval."""
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    action = BusinessAction.objects.get(run_id=occurrence.run_id)
    approvals_fixtures.approve(action, bob)
    return occurrence, action


def crash_first_starts(monkeypatch, crashes: int) -> list[str]:
    """The first `crashes` starts lose their database connection inside the ingress, as a
    worker that dies there would leave it: nothing of the start is committed."""
    keys: list[str] = []
    ingest = scheduler.message_ingest

    def flaky(**kwargs):
        keys.append(kwargs["idempotency_key"])
        if len(keys) <= crashes:
            raise OperationalError("server closed the connection unexpectedly")
        return ingest(**kwargs)

    monkeypatch.setattr(scheduler, "message_ingest", flaky)
    return keys


# --- the task and its beat schedule ------------------------------------------------------


def test_saving_a_task_keeps_its_beat_schedule_and_pausing_disables_it(demo):
    task = task_of(demo)

    periodic = PeriodicTask.objects.get(scheduled_task=task)
    assert periodic.task == "runs.tasks.scheduled_task_fire"
    assert json.loads(periodic.kwargs) == {"task_id": str(task.pk)}
    assert periodic.enabled is True
    assert periodic.interval is None
    crontab = periodic.crontab
    assert (
        crontab.minute,
        crontab.hour,
        crontab.day_of_month,
        crontab.month_of_year,
        crontab.day_of_week,
        str(crontab.timezone),
    ) == ("0", "9", "*", "*", "1", "UTC")
    assert task.history.get().history_change_reason == "saved"

    scheduled_task_pause(actor=demo.admin, task=task)

    periodic.refresh_from_db()
    assert periodic.enabled is False
    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is False
    assert scheduled_task_fire(task_id=task.pk) is None
    assert not TaskOccurrence.objects.exists()

    scheduled_task_resume(actor=demo.admin, task=task)

    periodic.refresh_from_db()
    assert periodic.enabled is True
    assert [record.history_change_reason for record in task.history.order_by("history_id")] == [
        "saved",
        "paused",
        "resumed",
    ]


def test_changing_the_schedule_to_an_interval_changes_the_same_beat_row(demo):
    task = task_of(demo)
    task.crontab, task.interval_seconds = "", 900

    scheduled_task_save(actor=demo.admin, task=task)

    periodic = PeriodicTask.objects.get(scheduled_task=task)
    assert (periodic.interval.every, periodic.interval.period, periodic.crontab) == (
        900,
        "seconds",
        None,
    )
    assert PeriodicTask.objects.filter(task="runs.tasks.scheduled_task_fire").count() == 1


def test_an_interval_task_not_fired_yet_shows_its_next_run_one_interval_after_its_schedule(demo):
    # given an hourly task scheduled ten minutes ago, and one paused and resumed then: the
    # beat counts the first interval from when their schedule was last saved
    task = task_of(demo, crontab="", interval_seconds=3600)
    resumed = task_of(demo, name="apollo hourly", crontab="", interval_seconds=3600)
    scheduled_task_pause(actor=demo.admin, task=resumed)
    scheduled_task_resume(actor=demo.admin, task=resumed)
    scheduled_at = timezone.now().replace(microsecond=0) - timedelta(minutes=10)
    PeriodicTask.objects.filter(scheduled_task__in=[task, resumed]).update(
        date_changed=scheduled_at
    )

    # then each fires an hour after that, not an hour after the page is read
    for each in (task, resumed):
        assert schedule_next_run(ScheduledTask.objects.get(pk=each.pk)) == (
            scheduled_at + timedelta(hours=1)
        )


def test_saving_a_task_keeps_what_the_beat_recorded_of_its_firings_meanwhile(demo):
    # given an hourly task loaded for a change while the beat fires it and records its last
    # firing and its count on its row
    task = task_of(demo, crontab="", interval_seconds=3600)
    loaded = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    last_run_at = timezone.now().replace(microsecond=0) - timedelta(minutes=5)
    PeriodicTask.objects.filter(scheduled_task=task).update(
        last_run_at=last_run_at, total_run_count=7
    )

    # when the change is saved, every 15 minutes
    loaded.interval_seconds = 900
    scheduled_task_save(actor=demo.admin, task=loaded)

    # then the beat's record stands: the task fires 15 minutes after its last firing, not at
    # once into the hour it already fired for
    periodic = PeriodicTask.objects.get(scheduled_task=task)
    assert (periodic.interval.every, periodic.last_run_at, periodic.total_run_count) == (
        900,
        last_run_at,
        7,
    )
    assert schedule_next_run(ScheduledTask.objects.get(pk=task.pk)) == last_run_at + timedelta(
        minutes=15
    )

    # and paused and resumed, it keeps the count, and counts its next firing from the resume
    scheduled_task_pause(actor=demo.admin, task=task)
    scheduled_task_resume(actor=demo.admin, task=task)

    periodic.refresh_from_db()
    assert (periodic.enabled, periodic.last_run_at, periodic.total_run_count) == (True, None, 7)


def test_a_task_keeps_its_schedule_row_until_its_schedule_changes_and_then_deletes_it(demo):
    # given two tasks on the same crontab
    task = task_of(demo)
    other = task_of(demo, name="apollo monthly")
    crontab = task.periodic_task.crontab

    # then each runs on a crontab row of its own, kept while its schedule stays
    assert other.periodic_task.crontab != crontab
    task.goal = f"{RUNNING_EXAMPLE_TEXT} Keep it short."
    assert scheduled_task_save(actor=demo.admin, task=task).periodic_task.crontab == crontab

    # and changed to an interval, the task's crontab row goes, the other task's stays
    task.crontab, task.interval_seconds = "", 900
    scheduled_task_save(actor=demo.admin, task=task)

    assert not CrontabSchedule.objects.filter(pk=crontab.pk).exists()
    assert CrontabSchedule.objects.filter(pk=other.periodic_task.crontab_id).exists()


def _globex_agent(demo) -> AgentConfig:
    policy = registry_object_save(
        instance=Policy(tenant=demo.globex, name="globex-policy"), actor=demo.admin
    )
    return registry_object_save(
        instance=AgentConfig(
            tenant=demo.globex,
            name="globex-agent",
            model_config=demo.agent.model_config,
            policy=policy,
        ),
        actor=demo.admin,
    )


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        pytest.param({"crontab": "61 9 * * 1"}, "crontab", "Invalid end range", id="bad-minute"),
        pytest.param({"crontab": "0 9 * *"}, "crontab", "five fields", id="four-fields"),
        pytest.param({"crontab": "0 0 31 2 *"}, "crontab", "never occurs", id="feb-31"),
        pytest.param(
            {"interval_seconds": 3600}, "interval_seconds", "not both", id="interval-and-crontab"
        ),
        pytest.param(
            {"crontab": "", "interval_seconds": 30}, "interval_seconds", "60", id="too-often"
        ),
        pytest.param({"owner": "erin"}, "owner", "not a member of", id="owner-of-globex"),
        pytest.param({"owner": "bob"}, "owner", "may start runs", id="owner-may-not-run"),
        pytest.param({"agent_config": "globex"}, "agent_config", "another tenant", id="agent"),
        pytest.param(
            {"agent_config": "model off"}, "agent_config", "model that is not active", id="model"
        ),
        pytest.param({"deadline_seconds": 10}, "deadline_seconds", "60", id="short-deadline"),
        pytest.param(
            {"goal": f"{RUNNING_EXAMPLE_TEXT} api_key=sk-live-4f9c2a7e81b3d605"},
            "goal",
            "looks like a credential",
            id="secret-in-goal",
        ),
        pytest.param(
            {"goal": f"{RUNNING_EXAMPLE_TEXT}，邮箱密码是 Tr0ub4dor3"},  # noqa: RUF001
            "goal",
            "looks like a credential",
            id="secret-in-goal-zh",
        ),
        pytest.param(
            {"recipient_record_id": "d\u0456r-1001"},
            "recipient_record_id",
            "letters, numbers, underscores or hyphens",
            id="recipient-with-a-cyrillic-i",
        ),
        pytest.param(
            {"goal": "\u200b\u2800\u3164\ufeff"},
            "goal",
            "it cannot be empty",
            id="goal-of-invisible-characters",
        ),
        pytest.param(
            {"goal": "汇总本周项目状态并发给研发负责人" * 400},
            "goal",
            "too long for the model's context: about 6400 tokens, at most 6000",
            id="goal-too-long",
        ),
    ],
)
def test_an_invalid_task_is_refused_field_by_field_and_nothing_is_scheduled(
    demo, fields, field, message
):
    if "owner" in fields:
        fields["owner"] = type(demo.alice).objects.get(username=fields["owner"])
    if fields.get("agent_config") == "globex":
        fields["agent_config"] = _globex_agent(demo)
    if fields.get("agent_config") == "model off":
        demo.agent.model_config.is_active = False
        registry_object_save(instance=demo.agent.model_config, actor=demo.admin, reason="off")
        fields["agent_config"] = demo.agent

    with pytest.raises(ValidationFailed) as refused:
        task_of(demo, **fields)

    assert refused.value.code == "VALIDATION_ERROR"
    assert message in " ".join(refused.value.details[field])
    assert not ScheduledTask.objects.exists()
    assert not PeriodicTask.objects.filter(task="runs.tasks.scheduled_task_fire").exists()


def test_only_a_tenant_admin_schedules_tasks(demo):
    with pytest.raises(PermissionDenied):
        scheduled_task_save(
            actor=demo.alice,
            task=ScheduledTask(
                tenant=demo.acme,
                name="mine",
                owner=demo.alice,
                agent_config=demo.agent,
                goal=RUNNING_EXAMPLE_TEXT,
                crontab=MONDAYS_AT_NINE,
            ),
        )

    assert not ScheduledTask.objects.exists()


def test_a_task_stays_in_its_tenant_with_its_occurrences(demo):
    # given acme's task, fired once, and a platform admin moving it to globex
    task = task_of(demo)
    occurrence = scheduled_task_fire(task_id=task.pk)
    moved = ScheduledTask.objects.get(pk=task.pk)
    moved.tenant = demo.globex
    moved.agent_config = _globex_agent(demo)
    moved.owner = type(demo.alice).objects.get(username="erin")

    # when it is saved, then it is refused on its tenant and stays acme's
    with pytest.raises(ValidationFailed) as refused:
        scheduled_task_save(actor=demo.admin, task=moved)

    assert "stays in the tenant it was created in" in refused.value.details["tenant"][0]
    assert ScheduledTask.objects.get(pk=task.pk).tenant == demo.acme
    assert TaskOccurrence.objects.filter(task__tenant=demo.acme).get() == occurrence


# --- slots -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "moment", "slot"),
    [
        # Monday 2 March 2026: two beats a few seconds apart, and one a minute late
        ({"crontab": MONDAYS_AT_NINE}, "2026-03-02T09:00:00.2", "2026-03-02T09:00"),
        ({"crontab": MONDAYS_AT_NINE}, "2026-03-02T09:00:59.9", "2026-03-02T09:00"),
        ({"crontab": MONDAYS_AT_NINE}, "2026-03-02T09:01:30", "2026-03-02T09:00"),
        # before Monday's time, the slot is the Monday before
        ({"crontab": MONDAYS_AT_NINE}, "2026-03-02T08:59:59", "2026-02-23T09:00"),
        ({"crontab": "*/15 8-17 * * 1-5"}, "2026-03-04T12:44:10", "2026-03-04T12:30"),
        ({"crontab": "*/15 8-17 * * 1-5"}, "2026-03-07T12:00:00", "2026-03-06T17:45"),
        ({"crontab": "0 0 29 2 *"}, "2026-03-02T09:00:00", "2024-02-29T00:00"),
        ({"interval_seconds": 3600}, "2026-03-02T10:17:23", "2026-03-02T10:00"),
        ({"interval_seconds": 3600}, "2026-03-02T10:59:59", "2026-03-02T10:00"),
        ({"interval_seconds": 900}, "2026-03-02T10:31:00", "2026-03-02T10:30"),
    ],
)
def test_a_firing_maps_to_the_latest_scheduled_time_at_or_before_it(schedule, moment, slot):
    task = ScheduledTask(**{"crontab": "", **schedule})

    computed = schedule_slot(task, datetime.fromisoformat(moment).replace(tzinfo=UTC))

    assert computed == datetime.fromisoformat(slot).replace(tzinfo=UTC)


# --- firing ------------------------------------------------------------------------------


def test_firing_creates_one_occurrence_whose_run_acts_as_the_owner_on_the_task_channel(demo):
    task = task_of(demo, recipient_record_id="dir-1001")
    now = timezone.now()

    occurrence = scheduled_task_fire(task_id=task.pk, now=now)
    again = scheduled_task_fire(task_id=task.pk, now=now + timedelta(seconds=5))

    assert again is None
    occurrence = refreshed(occurrence)
    slot = schedule_slot(task, now)
    assert (occurrence.slot, occurrence.status, occurrence.attempts) == (slot, "running", 1)
    assert occurrence.deadline_at == now + timedelta(seconds=3600)
    run = occurrence.run
    assert (run.status, run.channel, run.actor, run.agent_config) == (
        RunStatus.QUEUED,
        "task",
        demo.alice,
        demo.agent,
    )
    assert run.message["message"]["parts"] == [{"type": "text", "text": RUNNING_EXAMPLE_TEXT}]
    assert run.message["metadata"] == {
        "agent": "weekly-reporter",
        "project_id": "apollo",
        "recipient_record_id": "dir-1001",
        "task": {
            "id": str(task.pk),
            "name": "apollo weekly",
            "occurrence_id": str(occurrence.pk),
            "slot": slot.isoformat(),
        },
    }
    assert IngressRecord.objects.get(run=run).idempotency_key == (
        f"task {task.pk} {slot.isoformat()}"
    )
    assert TaskOccurrence.objects.count() == 1
    assert Run.objects.count() == 1


def test_a_firing_whose_slot_an_earlier_schedule_used_is_logged_naming_the_task_and_slot(
    demo, caplog
):
    # given an hourly task fired at the top of the hour, then changed to every 15 minutes
    task = task_of(demo, crontab="", interval_seconds=3600)
    hour = schedule_slot(task, timezone.now())
    scheduled_task_fire(task_id=task.pk, now=hour)
    task.interval_seconds = 900
    scheduled_task_save(actor=demo.admin, task=task)

    # when it fires within the first quarter of that hour
    with caplog.at_level(logging.WARNING, logger="runs.services.scheduler"):
        dropped = scheduled_task_fire(task_id=task.pk, now=hour + timedelta(minutes=5))

    # then nothing more starts, and the log says which task and slot it was
    assert dropped is None
    assert TaskOccurrence.objects.get().slot == hour
    assert Run.objects.count() == 1
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert f"apollo weekly ({task.pk})" in caplog.text
    assert hour.isoformat() in caplog.text


def test_no_client_key_can_claim_an_occurrence_before_it_fires(demo):
    # given a client posting, before the slot fires, with every key the slot's could be read
    # as (its task id and slot are in earlier runs' metadata)
    task = task_of(demo)
    now = timezone.now()
    slot = schedule_slot(task, now).isoformat()
    client = alice_client()
    for key in (f"task:{task.pk}:{slot}", f"task {task.pk} {slot}"):
        client.post(
            MESSAGES,
            message_body(metadata={"project_id": "apollo"}),
            format="json",
            HTTP_IDEMPOTENCY_KEY=key,
        )

    # when the slot fires, then its occurrence makes its own run
    occurrence = scheduled_task_fire(task_id=task.pk, now=now)
    occurrence.refresh_from_db()
    assert occurrence.status != OccurrenceStatus.FAILED, occurrence.detail
    assert occurrence.run.channel == "task"


def test_an_owner_who_lost_the_right_to_start_runs_fails_the_occurrence_and_pauses_the_task(
    demo,
):
    task = task_of(demo)
    demo.alice.memberships.all().delete()

    occurrence = refreshed(scheduled_task_fire(task_id=task.pk))

    assert occurrence.status == OccurrenceStatus.FAILED
    assert occurrence.detail == "PERMISSION_DENIED: You may not start runs in this tenant."
    assert occurrence.run is None
    assert not Run.objects.exists()
    # and the task is paused, saying why, so its later slots fail no more occurrences unseen
    task = ScheduledTask.objects.select_related("periodic_task").get(pk=task.pk)
    assert (task.is_enabled, task.periodic_task.enabled) == (False, False)
    paused = task.history.order_by("history_id").last()
    assert (paused.history_change_reason, paused.history_user) == (
        "paused: PERMISSION_DENIED: You may not start runs in this tenant.",
        None,
    )
    assert scheduled_task_fire(task_id=task.pk, now=timezone.now() + timedelta(days=7)) is None
    assert TaskOccurrence.objects.count() == 1


def _agent_renamed_and_its_name_taken(demo, *, is_active: bool = True) -> AgentConfig:
    """demo.agent renamed (and switched off unless `is_active`), and a new agent of acme
    under the name it had."""
    demo.agent.name, demo.agent.is_active = "weekly-reporter-2025", is_active
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="renamed")
    return registry_object_save(
        instance=AgentConfig(
            tenant=demo.acme,
            name="weekly-reporter",
            model_config=demo.agent.model_config,
            policy=demo.agent.policy,
        ),
        actor=demo.admin,
    )


def test_a_start_again_after_the_tasks_agent_was_renamed_runs_with_that_agent(demo, monkeypatch):
    # given a start that died inside the ingress, and the task's agent renamed before the
    # sweep starts it again, a new agent taking the name it had
    crash_first_starts(monkeypatch, crashes=1)
    task = task_of(demo)
    now = timezone.now()
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task.pk, now=now)
    _agent_renamed_and_its_name_taken(demo)

    assert occurrences_sweep(now=now + LEASE)["restarted"] == 1

    # then the run is the task's agent's, not the one now of that name
    run = refreshed(TaskOccurrence.objects.get()).run
    assert run.agent_config == demo.agent
    assert run.agent_config.name == "weekly-reporter-2025"


def test_a_start_again_after_the_tasks_agent_was_switched_off_fails_though_its_name_was_taken(
    demo, monkeypatch
):
    crash_first_starts(monkeypatch, crashes=1)
    task = task_of(demo)
    now = timezone.now()
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task.pk, now=now)
    _agent_renamed_and_its_name_taken(demo, is_active=False)

    occurrences_sweep(now=now + LEASE)

    occurrence = refreshed(TaskOccurrence.objects.get())
    assert occurrence.status == OccurrenceStatus.FAILED
    assert occurrence.detail == "NOT_FOUND: No such agent in this tenant."
    assert occurrence.run is None
    assert not Run.objects.exists()
    assert ScheduledTask.objects.get(pk=task.pk).is_enabled is False


def test_a_client_cannot_choose_an_agent_by_id_in_the_metadata(demo):
    # given two agents of acme, and a client naming one and giving the other's id
    other = _agent_renamed_and_its_name_taken(demo)

    response = alice_client().post(
        MESSAGES,
        message_body(metadata={"agent": "weekly-reporter-2025", "agent_config_id": other.pk}),
        format="json",
        HTTP_IDEMPOTENCY_KEY="agent-by-id",
    )

    # then the run has the agent the client named: only the server gives an agent by id
    assert response.status_code == 202, response.json()
    assert Run.objects.get(pk=response.json()["run_id"]).agent_config == demo.agent


def test_a_start_whose_worker_died_is_restarted_once_its_lease_lapsed_and_makes_one_run(
    demo, monkeypatch
):
    # given a start that died inside the ingress
    keys = crash_first_starts(monkeypatch, crashes=1)
    task = task_of(demo)
    now = timezone.now()
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task.pk, now=now)
    occurrence = TaskOccurrence.objects.get()
    first_lease_owner = occurrence.lease_owner
    assert (occurrence.status, occurrence.attempts, occurrence.run) == ("pending", 1, None)

    # while its lease runs, the sweep leaves it to its worker
    assert occurrences_sweep(now=now + timedelta(seconds=30))["restarted"] == 0
    assert TaskOccurrence.objects.get().attempts == 1

    # when the lease lapsed, the sweep starts it again
    counts = occurrences_sweep(now=now + LEASE)

    occurrence = refreshed(occurrence)
    assert counts["restarted"] == 1
    assert (occurrence.status, occurrence.attempts) == ("running", 2)
    assert occurrence.lease_owner != first_lease_owner
    assert occurrence.run.status == RunStatus.QUEUED
    assert keys == [occurrence.idempotency_key] * 2

    # and neither the first worker coming back nor a later sweep makes a second run
    assert occurrence_start(occurrence_id=occurrence.pk, lease_owner=first_lease_owner) is None
    assert occurrences_sweep(now=now + 2 * LEASE)["restarted"] == 0
    assert Run.objects.count() == 1
    assert IngressRecord.objects.count() == 1


def test_an_occurrence_whose_starts_keep_dying_fails_after_max_attempts_without_a_run(
    demo, monkeypatch
):
    crash_first_starts(monkeypatch, crashes=2)
    task = task_of(demo, max_attempts=2)
    now = timezone.now()
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task.pk, now=now)
    with pytest.raises(OperationalError):
        occurrences_sweep(now=now + LEASE)
    assert TaskOccurrence.objects.get().attempts == 2

    occurrences_sweep(now=now + 2 * LEASE)

    occurrence = TaskOccurrence.objects.get()
    assert (occurrence.status, occurrence.attempts) == ("failed", 2)
    assert occurrence.detail == "MAX_ATTEMPTS: 2 starts did not finish."
    assert occurrence.finished_at is not None
    assert not Run.objects.exists()


# --- the deadline ------------------------------------------------------------------------


def test_a_deadline_passing_while_the_run_waits_for_approval_ends_it_and_nothing_is_sent(
    demo, bob, smtp_server
):
    # given an occurrence whose run waits for approval of its mail
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.run.status) == ("waiting_approval", "WAITING_APPROVAL")
    action = BusinessAction.objects.get(run=occurrence.run)

    # when the deadline passes
    counts = occurrences_sweep(now=timezone.now() + PAST_DEADLINE)

    # then the occurrence and its run end, and the run says why
    assert counts["deadline_passed"] == 1
    occurrence = refreshed(occurrence)
    run = occurrence.run
    assert (occurrence.status, occurrence.detail) == ("deadline_passed", "DEADLINE_PASSED")
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "DEADLINE_PASSED")
    assert event_types(run)[-2:] == ["approval.invalidated", "run.finished"]
    assert events_of(run, "approval.invalidated") == [
        {"action_id": str(action.pk), "reasons": ["DEADLINE_PASSED"]}
    ]
    assert events_of(run, "run.finished") == [
        {"status": "CANCELLED", "reason_code": "DEADLINE_PASSED", "cancelled_by": None}
    ]
    action.refresh_from_db()
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, "DEADLINE_PASSED")

    # and an approval that comes afterwards sends nothing, even if a resume is delivered
    with pytest.raises(AlreadyDecided):
        approvals.approval_decide(
            action_id=action.pk,
            approver=bob,
            decision=Decision.APPROVE,
            payload_hash=action.payload_hash,
        )
    approvals.action_execute(action_id=action.pk)
    assert not ApprovalDecision.objects.exists()
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED
    assert not ToolCall.objects.filter(run=run, name="mail_send").exists()
    assert not MailDelivery.objects.exists()
    assert smtp_server.messages == []


def test_a_task_s_send_turned_away_for_now_tells_its_owner_the_next_occurrence_tries_again(
    demo, bob, smtp_server
):
    """Before, the task's run told its owner to send the message again with a new
    Idempotency-Key, as a chat's run does: a task has no message to send again, and its next
    occurrence makes a new draft of its own."""
    occurrence, action = fired_and_approved(demo, bob)
    smtp_server.data_replies = ["451 4.3.0 Temporary failure, try again"]

    approvals.action_execute(action_id=action.pk)

    occurrence = refreshed(occurrence)
    run = occurrence.run
    assert (run.status, run.reason_code) == (RunStatus.FAILED_RETRYABLE, "ACTION_FAILED")
    assert occurrence.status == OccurrenceStatus.FAILED
    assert run.result["next_step"] == (
        "Nothing was sent. The task's next occurrence tries again; its new draft needs a new "
        "approval."
    )
    assert smtp_server.messages == []


def test_a_task_s_approval_that_expired_tells_its_owner_the_next_occurrence_tries_again(demo):
    # given a task fired now, its run waiting for an approval no one gave in time
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    action = BusinessAction.objects.get(run_id=occurrence.run_id)
    BusinessAction.objects.filter(pk=action.pk).update(expires_at=action.created_at)

    # when the sweep ends it
    approvals.actions_expire()

    # then its owner is told nothing was sent and that the next occurrence tries again
    run = refreshed(occurrence).run
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "APPROVAL_EXPIRED")
    assert run.result["next_step"] == (
        "Nothing was sent: no approver decided in time. The task's next occurrence tries "
        "again; its new draft needs a new approval."
    )


def test_a_task_s_rejected_draft_tells_its_owner_why_and_that_the_next_occurrence_tries_again(
    demo, bob
):
    # given a task fired now, its run waiting for approval of its mail
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    action = BusinessAction.objects.get(run_id=occurrence.run_id)

    # when bob turns the draft down
    approvals.approval_decide(
        action_id=action.pk,
        approver=bob,
        decision=Decision.REJECT,
        payload_hash=action.payload_hash,
        comment="Wrong week.",
    )

    # then its owner is told who turned it down, why, and that the next occurrence drafts anew
    run = refreshed(occurrence).run
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "APPROVAL_REJECTED")
    assert run.result["next_step"] == (
        'Nothing was sent: bob turned the draft down, saying "Wrong week.". Change the task '
        "as needed; its next occurrence drafts again, and its new draft needs a new approval."
    )


def test_a_task_s_invalidated_approval_tells_its_owner_the_next_occurrence_tries_again(demo, bob):
    # given a task's approved mail whose recipient's directory record changed before the send
    occurrence, action = fired_and_approved(demo, bob)
    DirectoryRecord.objects.filter(record_id="dir-1001").update(version=4)

    approvals.action_execute(action_id=action.pk)

    run = refreshed(occurrence).run
    assert (run.status, run.reason_code) == (RunStatus.FAILED_FINAL, "APPROVAL_INVALIDATED")
    assert run.result["next_step"] == (
        "Nothing was sent: the approval no longer held when the send was due, because the "
        "recipient's directory record changed. The task's next occurrence drafts again with "
        "what holds then; its new draft needs a new approval."
    )


def test_an_approval_given_before_the_deadline_but_not_yet_executed_sends_nothing_after_it(
    demo, bob, smtp_server
):
    occurrence, action = fired_and_approved(demo, bob)

    occurrences_sweep(now=timezone.now() + PAST_DEADLINE)
    approvals.action_execute(action_id=action.pk)

    action.refresh_from_db()
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, "DEADLINE_PASSED")
    assert refreshed(occurrence).status == "deadline_passed"
    assert smtp_server.messages == []


def test_a_deadline_passing_while_the_run_works_stops_it_at_its_next_step(demo):
    occurrence = fired(demo)
    assert run_advance_step(run_id=str(occurrence.run_id)) is True
    assert Run.objects.get(pk=occurrence.run_id).status == RunStatus.RUNNING

    occurrences_sweep(now=timezone.now() + PAST_DEADLINE)

    assert refreshed(occurrence).status == "running"
    run_execute(run_id=str(occurrence.run_id))
    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.run.status, occurrence.run.reason_code) == (
        "deadline_passed",
        RunStatus.CANCELLED,
        "DEADLINE_PASSED",
    )
    assert not BusinessAction.objects.exists()


def test_a_task_run_whose_agent_was_switched_off_stops_and_says_to_change_the_task(demo):
    occurrence = fired(demo)
    assert run_advance_step(run_id=str(occurrence.run_id)) is True
    demo.agent.is_active = False
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="retired")

    run_execute(run_id=str(occurrence.run_id))

    occurrence = refreshed(occurrence)
    run = occurrence.run
    assert (occurrence.status, occurrence.detail) == (
        OccurrenceStatus.FAILED,
        "AGENT_CONFIG_INACTIVE",
    )
    assert (run.status, run.reason_code) == (RunStatus.FAILED_FINAL, "AGENT_CONFIG_INACTIVE")
    assert run.result["next_step"] == (
        "An admin switched the task's agent off; nothing more is done under it. Change the "
        "task's agent to one that is on, or ask a tenant admin to switch it back on: until "
        "then each occurrence is refused and pauses the task."
    )
    assert not BusinessAction.objects.exists()


def test_a_run_its_deadline_stopped_names_no_one_as_cancelling_it_though_its_owner_asked_later(
    demo,
):
    # given a task's run working when its deadline passes, stopped by the sweep
    occurrence = fired(demo)
    assert run_advance_step(run_id=str(occurrence.run_id)) is True
    occurrences_sweep(now=timezone.now() + PAST_DEADLINE)

    # when its owner cancels it before its next step, which ends it
    run_cancel(run=Run.objects.get(pk=occurrence.run_id), actor=demo.alice)
    run_execute(run_id=str(occurrence.run_id))

    # then the run ends for its deadline, cancelled by no one
    run = Run.objects.get(pk=occurrence.run_id)
    assert (run.status, run.reason_code, run.cancelled_by) == (
        RunStatus.CANCELLED,
        "DEADLINE_PASSED",
        None,
    )
    assert events_of(run, "run.finished") == [
        {"status": "CANCELLED", "reason_code": "DEADLINE_PASSED", "cancelled_by": None}
    ]


def test_a_cancel_kept_beside_a_waiting_task_run_before_its_deadline_is_the_one_it_ends_with(
    demo,
):
    # given a task's run waiting for approval, whose owner asked to cancel it while a step
    # held its row: the request was kept beside the run
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    CancelRequest.objects.create(
        run_id=occurrence.run_id, reason="CANCELLED_BY_USER", requested_by=demo.alice
    )

    # when the deadline passes before any step took the request in
    occurrences_sweep(now=timezone.now() + PAST_DEADLINE)

    # then the run ends as its owner asked, the one who cancelled it, and what it waited for
    # is withdrawn for that reason
    run = Run.objects.get(pk=occurrence.run_id)
    assert (run.status, run.reason_code, run.cancelled_by) == (
        RunStatus.CANCELLED,
        "CANCELLED_BY_USER",
        demo.alice,
    )
    assert events_of(run, "run.finished") == [
        {"status": "CANCELLED", "reason_code": "CANCELLED_BY_USER", "cancelled_by": "alice"}
    ]
    action = BusinessAction.objects.get(run=run)
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, "CANCELLED_BY_USER")
    assert not CancelRequest.objects.exists()


def test_a_deadline_passing_before_any_start_succeeded_ends_the_occurrence_without_a_run(
    demo, monkeypatch
):
    crash_first_starts(monkeypatch, crashes=1)
    now = timezone.now()
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task_of(demo).pk, now=now)

    counts = occurrences_sweep(now=now + PAST_DEADLINE)

    occurrence = TaskOccurrence.objects.get()
    assert counts == {"deadline_passed": 1, "restarted": 0, "notified": 0}
    assert (occurrence.status, occurrence.attempts, occurrence.run) == ("deadline_passed", 1, None)
    assert not Run.objects.exists()


def test_a_sweep_whose_clock_reading_is_stale_starts_no_run_past_the_deadline(demo, monkeypatch):
    # given a start that died an hour ago, its deadline passed a moment ago, and a sweep that
    # read its clock before that deadline (a long sweep reaches it only later)
    crash_first_starts(monkeypatch, crashes=1)
    fired_at = timezone.now() - timedelta(seconds=3600 + 5)
    with pytest.raises(OperationalError):
        scheduled_task_fire(task_id=task_of(demo).pk, now=fired_at)

    counts = occurrences_sweep(now=fired_at + timedelta(seconds=3600 - 1))

    # then it starts no run after the deadline, and the next sweep ends the occurrence
    assert counts["restarted"] == 0
    assert (TaskOccurrence.objects.get().attempts, Run.objects.count()) == (1, 0)
    assert occurrences_sweep()["deadline_passed"] == 1
    occurrence = TaskOccurrence.objects.get()
    assert (occurrence.status, occurrence.run) == ("deadline_passed", None)


def test_a_firing_delivered_late_has_the_deadline_counted_from_when_the_beat_sent_it(demo):
    task = task_of(demo, crontab="", interval_seconds=3600)
    now = timezone.now()
    sent_at = now - timedelta(minutes=20)

    occurrence = refreshed(scheduled_task_fire(task_id=task.pk, now=now, sent_at=sent_at))

    assert occurrence.deadline_at == sent_at + timedelta(seconds=3600)
    assert occurrence.run.status == RunStatus.QUEUED


def test_a_firing_delivered_after_its_deadline_ends_deadline_passed_without_a_run(demo):
    # given a firing the beat sent longer ago than the task's deadline (a backlog, a broker
    # or every worker down), delivered now, and again
    task = task_of(demo, crontab="", interval_seconds=3600)
    now = timezone.now()
    sent_at = now - PAST_DEADLINE

    late = scheduled_task_fire(task_id=task.pk, now=now, sent_at=sent_at)
    again = scheduled_task_fire(task_id=task.pk, now=now, sent_at=sent_at)

    # then its occurrence is recorded as past its deadline, and nothing ran
    assert again is None
    occurrence = refreshed(late)
    assert (occurrence.slot, occurrence.status, occurrence.detail) == (
        schedule_slot(task, sent_at),
        OccurrenceStatus.DEADLINE_PASSED,
        "DEADLINE_PASSED",
    )
    assert (occurrence.attempts, occurrence.run, occurrence.finished_at is not None) == (
        0,
        None,
        True,
    )
    assert occurrence.deadline_at == sent_at + timedelta(seconds=3600)
    assert not Run.objects.exists()
    assert not IngressRecord.objects.exists()
    assert occurrences_sweep(now=now) == {"deadline_passed": 0, "restarted": 0, "notified": 0}


def test_a_deadline_that_passed_before_its_sweep_came_still_sends_nothing(demo, bob, smtp_server):
    """The sweep comes every 30 s: an approval given and executed before it, after the
    deadline, sent the mail."""
    occurrence = fired(demo)
    run_execute(run_id=str(occurrence.run_id))
    action = BusinessAction.objects.get(run_id=occurrence.run_id)
    TaskOccurrence.objects.filter(pk=occurrence.pk).update(
        deadline_at=timezone.now() - timedelta(seconds=5)
    )

    with pytest.raises(AlreadyDecided, match="cancelled"):
        approvals.approval_decide(
            action_id=action.pk,
            approver=bob,
            decision=Decision.APPROVE,
            payload_hash=action.payload_hash,
        )
    approvals.action_execute(action_id=action.pk)

    run = Run.objects.get(pk=occurrence.run_id)
    assert (run.status, run.reason_code) == (RunStatus.CANCELLED, "DEADLINE_PASSED")
    assert refreshed(occurrence).status == "deadline_passed"
    assert smtp_server.messages == []
    assert not MailDelivery.objects.exists()


def test_overdue_runs_already_stopping_do_not_starve_the_deadline_sweep(demo, monkeypatch):
    monkeypatch.setattr(scheduler, "SWEEP_BATCH", 2)
    task = task_of(demo, crontab="", interval_seconds=60)
    now = timezone.now()
    waiting = scheduler.scheduled_task_fire(task_id=task.pk, now=now - timedelta(hours=5))
    run_execute(run_id=str(waiting.run_id))
    stopping = [
        scheduler.scheduled_task_fire(task_id=task.pk, now=now - timedelta(hours=4, minutes=n))
        for n in range(2)
    ]
    Run.objects.filter(pk__in=[o.run_id for o in stopping]).update(
        status=RunStatus.RUNNING, cancel_requested_at=now, cancel_reason="DEADLINE_PASSED"
    )
    TaskOccurrence.objects.update(deadline_at=now - timedelta(minutes=1))

    occurrences_sweep(now=now)

    assert refreshed(waiting).status == "deadline_passed"


# --- no waiting on a user ----------------------------------------------------------------


def test_a_question_ends_the_occurrence_needs_owner_and_mails_the_owner_once(
    demo, smtp_server, django_capture_on_commit_callbacks
):
    # hermes has two R&D leads and the task names neither
    occurrence = fired(demo, name="hermes weekly", project_id="hermes")

    with django_capture_on_commit_callbacks(execute=True):
        run_execute(run_id=str(occurrence.run_id))

    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.detail) == (
        "needs_owner",
        "RECIPIENT_NOT_UNIQUE_OR_EMAIL_MISSING",
    )
    assert occurrence.run.status == RunStatus.NEEDS_CLARIFICATION
    assert occurrence.owner_notified_at is not None
    (mail,) = smtp_server.messages
    assert mail["To"] == "alice@example.com"
    assert mail["Subject"] == "Scheduled task 'hermes weekly' needs you"
    body = mail.get_payload()
    assert "Who should receive the summary?" in body
    assert "RECIPIENT_NOT_UNIQUE_OR_EMAIL_MISSING" in body
    assert str(occurrence.run_id) in body
    assert "@acme.example" not in body

    assert occurrences_sweep()["notified"] == 0
    assert len(smtp_server.messages) == 1


def test_a_notification_the_mail_server_refused_is_sent_by_the_next_sweep_once(
    demo, smtp_server, settings, django_capture_on_commit_callbacks, free_tcp_port_factory
):
    occurrence = fired(demo, name="hermes weekly", project_id="hermes")
    settings.EMAIL_PORT = free_tcp_port_factory()

    with django_capture_on_commit_callbacks(execute=True):
        run_execute(run_id=str(occurrence.run_id))

    assert refreshed(occurrence).status == "needs_owner"
    assert refreshed(occurrence).owner_notified_at is None
    assert occurrences_sweep()["notified"] == 0

    settings.EMAIL_PORT = smtp_server.port
    assert occurrences_sweep()["notified"] == 1
    assert occurrences_sweep()["notified"] == 0
    assert [mail["To"] for mail in smtp_server.messages] == ["alice@example.com"]


# --- what only the task decides ----------------------------------------------------------


def test_a_frozen_recipient_is_used_as_confirmed_when_the_directory_still_has_it(demo):
    occurrence = fired(demo, project_id="hermes", recipient_record_id="dir-2002")

    run_execute(run_id=str(occurrence.run_id))

    occurrence = refreshed(occurrence)
    assert occurrence.status == "waiting_approval"
    recipient = BusinessAction.objects.get(run=occurrence.run).payload["recipient_snapshot"]
    assert (recipient["record_id"], recipient["corporate_email"], recipient["confirmed"]) == (
        "dir-2002",
        "chen.jie@acme.example",
        True,
    )


def test_a_frozen_recipient_no_longer_in_the_directory_is_never_replaced_by_another(demo):
    # given a task for hermes' lead dir-2001, who has left: dir-2002 is the only lead now
    occurrence = fired(demo, project_id="hermes", recipient_record_id="dir-2001")
    DirectoryRecord.objects.filter(record_id="dir-2001").update(is_active=False)

    run_execute(run_id=str(occurrence.run_id))

    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.detail) == ("needs_owner", "TASK_RECIPIENT_UNAVAILABLE")
    assert "dir-2001" in occurrence.run.result["question"]
    assert not BusinessAction.objects.exists()


def test_a_message_in_the_task_runs_session_changes_neither_its_project_nor_its_recipient(demo):
    # given apollo with a second R&D lead, and a task frozen on apollo's dir-1001
    lead = DirectoryRecord.objects.get(record_id="dir-1001")
    DirectoryRecord.objects.create(
        project=lead.project,
        record_id="dir-1002",
        role=lead.role,
        display_name="Mallory",
        corporate_email="mallory@elsewhere.example",
    )
    occurrence = fired(demo, recipient_record_id="dir-1001")
    task_run = occurrence.run

    # when the owner, in the task run's session, picks the other lead and another project
    chat = message_ingest(
        actor=demo.alice,
        tenant=demo.acme,
        idempotency_key="chat-in-task-session",
        channel="chat",
        parts=[{"type": "text", "text": RUNNING_EXAMPLE_TEXT}],
        metadata={"project_id": "apollo", "recipient_record_id": "dir-1002"},
        session_id=task_run.session_id,
    ).run
    run_execute(run_id=str(chat.pk))
    assert Run.objects.get(pk=chat.pk).state["recipient"]["record_id"] == "dir-1002"
    run_execute(run_id=str(task_run.pk))

    # then the task's run still drafts apollo for dir-1001
    task_run = Run.objects.get(pk=task_run.pk)
    assert task_run.status == RunStatus.WAITING_APPROVAL
    assert task_run.state["inputs"]["project_id"] == "apollo"
    recipient = BusinessAction.objects.get(run=task_run).payload["recipient_snapshot"]
    assert recipient["record_id"] == "dir-1001"


def test_a_task_without_a_project_does_not_take_one_from_its_session(demo):
    occurrence = fired(demo, project_id="")
    Session.objects.filter(pk=occurrence.run.session_id).update(state={"project_id": "hermes"})

    run_execute(run_id=str(occurrence.run_id))

    occurrence = refreshed(occurrence)
    assert (occurrence.status, occurrence.detail) == ("needs_owner", "MISSING_PROJECT_SCOPE")
    assert occurrence.run.state["inputs"]["project_id"] is None


@pytest.mark.parametrize(
    ("fields", "reason_code", "answer"),
    [
        (
            {"project_id": "hermes"},
            "RECIPIENT_NOT_UNIQUE_OR_EMAIL_MISSING",
            "Change the task's recipient to one of the candidates that has an email.",
        ),
        ({"project_id": ""}, "MISSING_PROJECT_SCOPE", "Change the task's project"),
        (
            {"goal": "Summarise this week and the week before last for the R&D lead."},
            "DATE_RANGE_UNCLEAR",
            "Change the task's goal to name one of them.",
        ),
    ],
    ids=["recipient", "project", "week"],
)
def test_a_task_run_s_question_is_answered_by_changing_the_task(demo, fields, reason_code, answer):
    """Before, a task's run asked its owner to send the message again in its session with
    metadata set, as a chat's run does: a message there starts a run of its own and never
    changes the task (its project and recipient are the task's), so the next occurrence
    asked the same question again."""
    occurrence = fired(demo, **fields)

    run_execute(run_id=str(occurrence.run_id))

    run = refreshed(occurrence).run
    assert (run.status, run.reason_code) == (RunStatus.NEEDS_CLARIFICATION, reason_code)
    assert answer in run.result["question"]
    assert "metadata" not in run.result["question"]
    assert "Send the message again" not in run.result["question"]
    assert run.result["next_step"] == (
        "Answer the question by changing the task; its next occurrence runs with the change."
    )


def test_a_model_cannot_move_a_task_run_to_another_project(demo, fake_model):
    fake = fake_model()
    monday, sunday = this_week()
    other = json.dumps({"project_id": "hermes", "from": monday, "to": sunday})
    fake.reply(openai_completion(tool_calls=(("call_other", "project_search", other),)))
    fake.reply(read_apollo("call_read"))
    fake.reply(openai_completion(content=json.dumps(apollo_draft())))
    occurrence = fired(demo)

    run_execute(run_id=str(occurrence.run_id))

    rejected = ToolCall.objects.get(run_id=occurrence.run_id, call_id="call_other")
    assert (rejected.status, rejected.error_category) == ("rejected", "PERMISSION_DENIED")
    occurrence = refreshed(occurrence)
    assert occurrence.status == "waiting_approval"
    assert occurrence.run.state["inputs"]["project_id"] == "apollo"


def test_clients_cannot_post_on_the_task_channel(demo):
    response = alice_client().post(
        MESSAGES,
        message_body(channel="task", metadata={"project_id": "apollo"}),
        format="json",
        HTTP_IDEMPOTENCY_KEY="forged-task",
    )

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "VALIDATION_ERROR"
    assert "channel" in response.json()["error"]["details"]
    assert not Run.objects.exists()
