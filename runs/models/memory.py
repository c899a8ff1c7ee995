import uuid

from django.conf import settings
from django.db import models

from registry.choices import DataClassification


class MemoryItem(models.Model):
    """Something the platform keeps about one user in one tenant, under the write policy of
    `runs.services.memory`: an explicit preference, a fact the user confirmed, or reusable
    task state. Never a secret, an unconfirmed model guess or an attachment's text."""

    class Kind(models.TextChoices):
        PREFERENCE = "preference", "Explicit preference"
        FACT = "fact", "User-confirmed fact"
        TASK_STATE = "task_state", "Reusable task state"

    class Origin(models.TextChoices):
        USER_STATED = "user_stated", "Stated by the user"
        USER_CONFIRMED = "user_confirmed", "Confirmed by the user"
        TASK = "task", "Kept by a task"
        MODEL_INFERRED = "model_inferred", "Guessed by a model"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("registry.Tenant", on_delete=models.PROTECT, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memories"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    key = models.CharField(max_length=100)
    value = models.TextField()
    purpose = models.CharField(
        max_length=64, default="any", help_text="What it may be used for: a skill name, or any."
    )
    sensitivity = models.CharField(
        max_length=16, choices=DataClassification.choices, default=DataClassification.INTERNAL
    )
    consent_at = models.DateTimeField(null=True, blank=True)
    origin = models.CharField(max_length=16, choices=Origin.choices)
    source = models.JSONField(default=dict, help_text="Where it came from: run, page, API.")
    created_at = models.DateTimeField(auto_now_add=True)
    confirmed_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["tenant_id", "user_id", "kind", "key"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "user", "kind", "key"], name="memoryitem_unique_key"
            )
        ]
        indexes = [models.Index(fields=["tenant", "user", "expires_at"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"
