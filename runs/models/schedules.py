import uuid

from django.conf import settings
from django.db import models

from config.history import history_records
from runs.choices import OccurrenceStatus


class ScheduledTask(models.Model):
    """A run the server starts on a schedule, acting as `owner`: the owner's roles and grants
    bound its capability, as they would bound a message the owner sent.

    The goal, project, recipient record and deadline are fixed here, on the server; a run of
    the task takes them from its occurrence and never from a model's arguments or a later
    message. `periodic_task` is the django-celery-beat row that fires it, kept in step by
    `runs.services.schedules.scheduled_task_save`, and not deleted while the task is (nor its
    crontab or interval row): a task is paused, never left enabled with nothing to fire it.
    Exactly one of `interval_seconds` and `crontab` is set.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="scheduled_tasks"
    )
    name = models.CharField(max_length=120)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        related_name="scheduled_tasks",
        help_text="The runs act as this member of the tenant; a question goes to their email.",
    )
    agent_config = models.ForeignKey(
        "registry.AgentConfig", on_delete=models.PROTECT, related_name="scheduled_tasks"
    )
    goal = models.TextField(help_text="The message every run of the task starts from.")
    project_id = models.SlugField(
        max_length=63, blank=True, help_text="The project every run is scoped to."
    )
    # A key as the API takes metadata.recipient_record_id: a look-alike letter (a Cyrillic i,
    # U+0456, in dir-1001) reads as the directory's record but names none.
    recipient_record_id = models.SlugField(
        max_length=32,
        blank=True,
        db_index=False,
        help_text="The directory record that receives deliveries. Each run checks it is "
        "still that project's active record with an email; empty: the directory's one lead.",
    )
    interval_seconds = models.PositiveIntegerField(
        null=True, blank=True, help_text="Fire every this many seconds (at least 60)."
    )
    crontab = models.CharField(
        max_length=100,
        blank=True,
        help_text="Or fire on this crontab, in UTC: minute hour day-of-month month "
        "day-of-week, e.g. '0 9 * * 1' for Mondays at 09:00.",
    )
    deadline_seconds = models.PositiveIntegerField(
        default=3600,
        help_text="An occurrence still unfinished this long after it fired ends "
        "deadline_passed; nothing is sent after that.",
    )
    max_attempts = models.PositiveSmallIntegerField(
        default=3, help_text="Starts of one occurrence before it is given up as failed."
    )
    is_enabled = models.BooleanField(default=True, help_text="Off: paused, nothing fires.")
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        editable=False,
        related_name="scheduled_task",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    history = history_records()

    class Meta:
        ordering = ["tenant", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="scheduledtask_unique_name"),
            models.CheckConstraint(
                condition=(
                    models.Q(interval_seconds__isnull=False, crontab="")
                    | (models.Q(interval_seconds__isnull=True) & ~models.Q(crontab=""))
                ),
                name="scheduledtask_one_schedule",
                violation_error_message="Give either an interval in seconds or a crontab, "
                "not both.",
            ),
            models.CheckConstraint(
                condition=models.Q(deadline_seconds__gt=0, max_attempts__gt=0),
                name="scheduledtask_positive_limits",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.tenant})"

    @property
    def schedule_text(self) -> str:
        if self.interval_seconds:
            return f"every {self.interval_seconds} s"
        return f"cron {self.crontab} (UTC)"


class TaskOccurrence(models.Model):
    """One firing of a scheduled task for one slot: the scheduled time the beat fired for,
    which every beat and worker computes alike, so (task, slot) is unique and two beats make
    one occurrence.

    `message` is what the occurrence asks, frozen when it is created (a later edit of the task
    does not change it); `attempts` counts starts and `lease_expires_at` bounds each one, so a
    start whose worker died is taken over by the sweep, and the run it creates is the same run
    on every attempt (the ingress Idempotency-Key `idempotency_key`).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.ForeignKey(ScheduledTask, on_delete=models.PROTECT, related_name="occurrences")
    slot = models.DateTimeField()
    status = models.CharField(
        max_length=24, choices=OccurrenceStatus.choices, default=OccurrenceStatus.PENDING
    )
    detail = models.TextField(blank=True, help_text="Why it ended as it did: a reason code.")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    message = models.JSONField(
        help_text="The parts and metadata the run is started with, and its agent's id."
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField()
    run = models.OneToOneField(
        "runs.Run",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="occurrence",
    )
    owner_notified_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-slot"]
        constraints = [
            models.UniqueConstraint(fields=["task", "slot"], name="taskoccurrence_unique_slot"),
        ]
        indexes = [
            models.Index(fields=["status", "lease_expires_at"]),
            models.Index(fields=["status", "deadline_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.task.name} at {self.slot:%Y-%m-%d %H:%M} ({self.status})"

    @property
    def idempotency_key(self) -> str:
        """Spaced: an API client's key may not hold a space, so none can claim this one."""
        return f"task {self.task_id} {self.slot.isoformat()}"
