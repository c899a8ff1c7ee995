"""Scheduled tasks: their validation, their django-celery-beat row, and the slot a firing is
for.

A task fires `runs.tasks.scheduled_task_fire` through the PeriodicTask this module keeps in
step with it (the beat runs on the DatabaseScheduler). Every beat and worker maps a moment to
the same slot: the latest scheduled time at or before it. For a crontab that is the latest
matching minute; for an interval of N seconds it is the start of the N-second window (counted
from the Unix epoch) the moment falls in. So at most one occurrence exists per scheduled time
or window, however many beats fire for it.
"""

import hashlib
import json
from datetime import UTC, date, datetime, timedelta

from celery.schedules import ParseException
from celery.schedules import crontab as Crontab
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from registry.choices import Action
from registry.selectors import user_can
from registry.services.common import audited_save, audited_unique_save, full_clean_or_raise
from runs.context import message_max_tokens, text_shows_something
from runs.errors import PermissionDenied, ValidationFailed
from runs.models import ScheduledTask
from runs.redaction import secrets_removed
from runs.tokens import estimate_tokens

FIRE_TASK = "runs.tasks.scheduled_task_fire"
MIN_INTERVAL_SECONDS = 60
MIN_DEADLINE_SECONDS = 60
MAX_ATTEMPTS = 10
# The fields a task's change page edits, as `scheduled_task_version` records them; whether it
# fires is carried on its own (`scheduled_task_save`'s `is_enabled_when_read`).
VERSIONED_FIELDS = (
    "name",
    "owner",
    "agent_config",
    "goal",
    "project_id",
    "recipient_record_id",
    "interval_seconds",
    "crontab",
    "deadline_seconds",
    "max_attempts",
)
CRONTAB_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
# How far back the latest matching day of a crontab is looked for: 28 years, after which
# the calendar's dates fall on the same weekdays again, so any day a crontab can name is found.
CRONTAB_LOOKBACK_DAYS = 366 * 28


def _crontab_parse(expression: str) -> Crontab:
    """A five-field crontab as Celery reads it; ValueError names what is wrong."""
    fields = expression.split()
    if len(fields) != len(CRONTAB_FIELDS):
        raise ValueError("A crontab has five fields: minute hour day-of-month month day-of-week.")
    return Crontab(**dict(zip(CRONTAB_FIELDS, fields, strict=True)))


def _schedule_errors(task: ScheduledTask) -> dict[str, list[str]]:
    if bool(task.interval_seconds) == bool(task.crontab.strip()):
        message = "Give either an interval in seconds or a crontab, not both."
        return {"interval_seconds": [message], "crontab": [message]}
    if task.interval_seconds:
        if task.interval_seconds < MIN_INTERVAL_SECONDS:
            return {"interval_seconds": [f"At least {MIN_INTERVAL_SECONDS} seconds."]}
        return {}
    try:
        _crontab_slot(task.crontab, timezone.now())
    except (ValueError, ParseException) as error:
        return {"crontab": [f"Not a valid crontab: {error}"]}
    for name, value in zip(CRONTAB_FIELDS, task.crontab.split(), strict=True):
        longest = CrontabSchedule._meta.get_field(name).max_length
        if len(value) > longest:
            return {"crontab": [f"Not a valid crontab: its {name} is longer than {longest}."]}
    return {}


def scheduled_task_errors(task: ScheduledTask) -> dict[str, list[str]]:
    """What is wrong with a task, field by field; empty when nothing is. The admin form shows
    these next to the fields; `scheduled_task_save` refuses a task that has any."""
    errors = _schedule_errors(task)
    if not task._state.adding:
        saved = ScheduledTask.objects.filter(pk=task.pk).values_list("tenant_id", flat=True)
        if saved.first() not in (None, task.tenant_id):
            errors["tenant"] = [
                "A task stays in the tenant it was created in: its occurrences and their runs "
                "are that tenant's record. Create the task in the other tenant instead."
            ]
    if task.tenant_id and task.owner_id:
        owner = task.owner
        if not user_can(user=owner, action=Action.RUN_CREATE, tenant=task.tenant):
            errors["owner"] = [
                f"{owner.get_username()} is not a member of {task.tenant} who may start runs; "
                "the task's runs act as its owner."
            ]
        elif not owner.email:
            errors["owner"] = [
                f"{owner.get_username()} has no email address; the task's questions go there."
            ]
    if task.tenant_id and task.agent_config_id:
        agent = task.agent_config
        if agent.tenant_id != task.tenant_id:
            errors["agent_config"] = [f"{agent.name} is an agent of another tenant."]
        elif not agent.is_active:
            errors["agent_config"] = [f"{agent.name} is not active."]
        elif not agent.model_config.is_active:
            errors["agent_config"] = [
                f"{agent.name} uses {agent.model_config.name}, a model that is not active."
            ]
    if task.deadline_seconds is not None and task.deadline_seconds < MIN_DEADLINE_SECONDS:
        errors["deadline_seconds"] = [f"At least {MIN_DEADLINE_SECONDS} seconds."]
    if task.max_attempts is not None and not 1 <= task.max_attempts <= MAX_ATTEMPTS:
        errors["max_attempts"] = [f"Between 1 and {MAX_ATTEMPTS}."]
    goal_tokens, goal_limit = estimate_tokens(task.goal), message_max_tokens()
    if not text_shows_something(task.goal):
        errors["goal"] = ["The goal is the message every run starts from; it cannot be empty."]
    elif goal_tokens > goal_limit:
        # As a message posted to the API is refused: the context never cuts the task, so
        # every run would send the model more than its budget.
        errors["goal"] = [
            f"The goal is too long for the model's context: about {goal_tokens} tokens, at "
            f"most {goal_limit}."
        ]
    elif secrets_removed(task.goal) != task.goal:
        errors["goal"] = [
            "The goal holds what looks like a credential (a key, a token, a password). Its runs "
            "never get it, and the task, its history and its occurrences would show it to "
            "whoever reads them: remove it, and give the credential to the tool that needs it."
        ]
    return errors


def scheduled_task_version(task: ScheduledTask) -> dict[str, str]:
    """How each field a change page edits stood in `task`, a digest a field. A page carries
    the version it was opened at, and a save from it is refused once any of those fields has
    changed since (`scheduled_task_save`), naming it: saved, it would undo that change unseen.
    The model keeps no version of its own, and a digest adds no migration."""
    version = {}
    for name in VERSIONED_FIELDS:
        value = getattr(task, ScheduledTask._meta.get_field(name).attname)
        version[name] = hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:16]
    return version


def _may_manage(*, actor: AbstractBaseUser, task: ScheduledTask) -> None:
    if not user_can(user=actor, action=Action.TENANT_ADMIN, tenant=task.tenant):
        raise PermissionDenied("Only a tenant admin manages the tenant's scheduled tasks.")


def _interval(current: IntervalSchedule | None, seconds: int) -> IntervalSchedule:
    wanted = {"every": seconds, "period": IntervalSchedule.SECONDS}
    if current is not None and {name: getattr(current, name) for name in wanted} == wanted:
        return current
    return IntervalSchedule.objects.create(**wanted)


def _crontab(current: CrontabSchedule | None, expression: str) -> CrontabSchedule:
    wanted = {**dict(zip(CRONTAB_FIELDS, expression.split(), strict=True)), "timezone": "UTC"}
    if current is not None and {name: str(getattr(current, name)) for name in wanted} == wanted:
        return current
    return CrontabSchedule.objects.create(**wanted)


def _periodic_task_sync(task: ScheduledTask) -> PeriodicTask:
    """The beat's row for the task: its schedule, its switch, the task id it fires with.

    The crontab or interval row it runs on is the task's own, made for it: the beat's admin
    shows the rows a task fires by read-only, and taking a row another periodic task runs on
    would lock that one too. A row the task no longer runs on, and nothing else does, is
    deleted.

    Only the fields the task decides are written: the beat records each firing on the row
    (`last_run_at`, `total_run_count`), maybe since it was loaded, and a firing written back
    as it was would make the beat fire again at once. A pause clears the last firing, as the
    beat's own save does, so a resume counts from then."""
    periodic = task.periodic_task or PeriodicTask(name=f"scheduled-task:{task.pk}")
    is_new = periodic._state.adding
    before = (periodic.interval, periodic.crontab)
    periodic.task = FIRE_TASK
    periodic.kwargs = json.dumps({"task_id": str(task.pk)})
    periodic.description = f"{task.tenant.slug}: {task.name}"
    periodic.enabled = task.is_enabled
    if task.interval_seconds:
        periodic.interval, periodic.crontab = _interval(before[0], task.interval_seconds), None
    else:
        periodic.interval, periodic.crontab = None, _crontab(before[1], task.crontab)
    if is_new:
        periodic.save()
    else:
        fields = ["task", "kwargs", "description", "enabled", "interval", "crontab", "date_changed"]
        periodic.save(update_fields=fields if task.is_enabled else [*fields, "last_run_at"])
    for schedule in before:
        if schedule is not None and not schedule.periodictask_set.exists():
            schedule.delete()
    return periodic


def _refuse_changed_since(version_when_read: dict[str, str], saved: ScheduledTask) -> None:
    changed = [
        name
        for name, digest in scheduled_task_version(saved).items()
        if version_when_read.get(name) != digest
    ]
    if changed:
        names = ", ".join(str(ScheduledTask._meta.get_field(name).verbose_name) for name in changed)
        raise ValidationFailed(
            f"The scheduled task was changed since this page was opened: {names}. Reload the "
            "page to see it as it is now, then make your change again.",
            details={name: ["Changed since this page was opened."] for name in changed},
        )


def scheduled_task_save(
    *,
    actor: AbstractBaseUser,
    task: ScheduledTask,
    reason: str = "saved",
    is_enabled_when_read: bool | None = None,
    version_when_read: dict[str, str] | None = None,
) -> ScheduledTask:
    """Create or change a task and its beat schedule in one transaction. The actor is a
    tenant admin; the owner a member who may start runs, with an email; the agent one of
    the tenant's active agents; the schedule an interval or a valid crontab; the goal holds
    no credential. A change made from the task as it was read, `is_enabled_when_read`, is
    refused once the task has been paused or resumed since: saved, it would undo that (a
    pause of the scheduler, whose start of the task was refused) unseen. So is one made from
    the task at `version_when_read` (`scheduled_task_version`) once another save has changed
    any of its fields since, naming them; nothing is written."""
    _may_manage(actor=actor, task=task)
    task.crontab = task.crontab.strip()
    errors = scheduled_task_errors(task)
    if errors:
        raise ValidationFailed("The scheduled task is not valid.", details=errors)
    full_clean_or_raise(task, exclude=["periodic_task"])
    with transaction.atomic():
        # The task's row before its beat row, as a pause or a resume takes them: taken the
        # other way round, a save and a pause at once would deadlock.
        if not task._state.adding:
            saved = ScheduledTask.objects.select_for_update().filter(pk=task.pk).first()
            is_enabled = saved.is_enabled if saved is not None else None
            if is_enabled_when_read is not None and is_enabled != is_enabled_when_read:
                switched = "resumed" if is_enabled_when_read is False else "paused"
                raise ValidationFailed(
                    f"The scheduled task was {switched} meanwhile.",
                    details={
                        "is_enabled": [
                            f"The task was {switched} since this page was opened: reload the "
                            "page to see it as it is now (its history says why), then save "
                            "again."
                        ]
                    },
                )
            if version_when_read is not None and saved is not None:
                _refuse_changed_since(version_when_read, saved)
        task.periodic_task = _periodic_task_sync(task)
        audited_unique_save(task, actor=actor, reason=reason, exclude=["periodic_task"])
    return task


def _switch(
    *, actor: AbstractBaseUser | None, task: ScheduledTask, enabled: bool, reason: str
) -> ScheduledTask:
    with transaction.atomic():
        task = ScheduledTask.objects.select_for_update().get(pk=task.pk)
        if task.is_enabled == enabled:
            return task
        errors = scheduled_task_errors(task) if enabled else {}
        if errors:
            raise ValidationFailed("The scheduled task is not valid.", details=errors)
        task.is_enabled = enabled
        task.periodic_task = _periodic_task_sync(task)
        audited_save(
            task,
            actor=actor,
            reason=reason,
            update_fields=["is_enabled", "periodic_task", "updated_at"],
        )
    return task


def scheduled_task_pause(*, actor: AbstractBaseUser, task: ScheduledTask) -> ScheduledTask:
    """Stop firing: the beat's row is disabled. An occurrence already started runs on to its
    end or its deadline."""
    _may_manage(actor=actor, task=task)
    return _switch(actor=actor, task=task, enabled=False, reason="paused")


def scheduled_task_resume(*, actor: AbstractBaseUser, task: ScheduledTask) -> ScheduledTask:
    """Fire again, once the task is what a save would take: one paused because its start was
    refused would otherwise fail its next occurrence and be paused again."""
    _may_manage(actor=actor, task=task)
    return _switch(actor=actor, task=task, enabled=True, reason="resumed")


def scheduled_task_refused_pause(*, task: ScheduledTask, refusal: str) -> ScheduledTask:
    """Pause a task whose start the ingress refused (its owner may no longer start runs, its
    agent was switched off): every later firing would be refused alike, each one more failed
    occurrence that nobody is told of. The platform pauses it, with the refusal as the reason
    its history shows; a tenant admin resumes it once the task is put right."""
    return _switch(actor=None, task=task, enabled=False, reason=f"paused: {refusal}")


def _crontab_day_matches(schedule: Crontab, day: date) -> bool:
    # As Celery reads a crontab: both day fields must match; Sunday is day 0 of the week.
    return (
        day.month in schedule.month_of_year
        and day.day in schedule.day_of_month
        and day.isoweekday() % 7 in schedule.day_of_week
    )


def _crontab_slot(expression: str, moment: datetime) -> datetime:
    schedule = _crontab_parse(expression)
    moment = moment.astimezone(UTC).replace(second=0, microsecond=0)
    day = moment.date()
    for _ in range(CRONTAB_LOOKBACK_DAYS):
        if _crontab_day_matches(schedule, day):
            is_today = day == moment.date()
            for hour in sorted(schedule.hour, reverse=True):
                if is_today and hour > moment.hour:
                    continue
                minutes = [
                    minute
                    for minute in schedule.minute
                    if not (is_today and hour == moment.hour and minute > moment.minute)
                ]
                if minutes:
                    return datetime(day.year, day.month, day.day, hour, max(minutes), tzinfo=UTC)
        day -= timedelta(days=1)
    raise ValueError(f"{expression!r} names no day that exists.")


def schedule_slot(task: ScheduledTask, moment: datetime) -> datetime:
    """The scheduled time a firing at `moment` is for (see the module's docstring)."""
    if task.interval_seconds:
        epoch_seconds = int(moment.timestamp())
        return datetime.fromtimestamp(epoch_seconds - epoch_seconds % task.interval_seconds, tz=UTC)
    return _crontab_slot(task.crontab, moment)


def schedule_next_run(task: ScheduledTask) -> datetime | None:
    """When the beat fires the task next, to the second, as its PeriodicTask says; None while
    paused. Before its first firing (and after a pause, which clears the last one) the beat
    counts from when the row was last saved."""
    periodic = task.periodic_task
    if not task.is_enabled or periodic is None or not periodic.enabled:
        return None
    now = timezone.now()
    last_run_at = periodic.last_run_at or periodic.date_changed
    moment = max(now, now + periodic.schedule.remaining_estimate(last_run_at))
    # Celery measures the remaining time from its own clock reading: round off the drift.
    return (moment + timedelta(milliseconds=500)).replace(microsecond=0)
