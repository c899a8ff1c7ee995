from django.conf import settings
from django.db import models

from config.ids import time_ordered_id
from runs.choices import Channel


class Session(models.Model):
    """A conversation of one actor in one tenant; `state` is the one authoritative copy of its
    structured state (project_id, a confirmed recipient snapshot with its expiry, draft ids)."""

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    tenant = models.ForeignKey("registry.Tenant", on_delete=models.PROTECT, related_name="sessions")
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="sessions"
    )
    channel = models.CharField(max_length=16, choices=Channel.choices)
    state = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at"]
        indexes = [models.Index(fields=["tenant", "actor", "-updated_at"])]

    def __str__(self) -> str:
        return f"session {self.id} ({self.actor} in {self.tenant})"
