"""The running example's business data, behind the read tools project_search and
directory_lookup. A user sees a project only with the `view_project` object grant
(django-guardian); a project belongs to one tenant."""

from django.db import models


class Project(models.Model):
    tenant = models.ForeignKey("registry.Tenant", on_delete=models.CASCADE, related_name="+")
    key = models.SlugField(max_length=63)
    name = models.CharField(max_length=200)

    class Meta:
        ordering = ["tenant", "key"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key"], name="project_unique_key"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.key}"


class ProjectUpdate(models.Model):
    """One dated fact of a project's week: a task, a milestone or a risk."""

    class Kind(models.TextChoices):
        TASK = "task"
        MILESTONE = "milestone"
        RISK = "risk"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="updates")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    title = models.CharField(max_length=200)
    status = models.CharField(max_length=32)
    detail = models.TextField(blank=True)
    occurred_on = models.DateField()

    class Meta:
        ordering = ["project", "occurred_on", "id"]
        indexes = [models.Index(fields=["project", "occurred_on"])]

    def __str__(self) -> str:
        return f"{self.project} {self.kind}: {self.title}"


class DirectoryRecord(models.Model):
    """A person's role in a project, as the enterprise directory holds it, with a version
    that changes whenever the record does."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="directory")
    record_id = models.CharField(max_length=32)
    role = models.CharField(max_length=63)
    display_name = models.CharField(max_length=200)
    corporate_email = models.EmailField(blank=True)
    is_active = models.BooleanField(default=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["project", "record_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "record_id"], name="directoryrecord_unique_record"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.display_name} ({self.role} of {self.project})"


class MailDelivery(models.Model):
    """The mail tool's own record of one delivery, keyed by the host's idempotency key and
    written before the mail server is contacted: a second call with the key never sends
    again, and an interrupted delivery can be settled by the key. A delivery the server turned
    away for now, with nothing sent, is `deferred`: the next try under the key takes it over
    and sends."""

    class Status(models.TextChoices):
        SENDING = "sending"
        DEFERRED = "deferred"
        SENT = "sent"
        FAILED = "failed"
        UNKNOWN = "unknown"

    idempotency_key = models.CharField(max_length=200, unique=True)
    message_id = models.CharField(max_length=255, unique=True)
    recipients = models.JSONField()
    subject = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.SENDING)
    error = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "mail deliveries"

    def __str__(self) -> str:
        return f"{self.message_id} ({self.status})"
