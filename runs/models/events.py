from collections.abc import Iterable, Sequence
from typing import Any

from django.db import models
from django.utils import timezone

from config.ids import time_ordered_id
from runs.choices import EventType
from runs.errors import EventLogIsAppendOnly


class RunEventQuerySet(models.QuerySet):
    """Refuses every write but an insert; the model's default and base manager, so that no
    path of the ORM (a related manager, saving, deleting) reaches the rows without it."""

    def bulk_create(
        self,
        objs: Iterable["RunEvent"],
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Sequence[str] | None = None,
        unique_fields: Sequence[str] | None = None,
    ) -> list["RunEvent"]:
        # ON CONFLICT DO UPDATE would rewrite the stored event an insert collides with.
        if update_conflicts:
            raise EventLogIsAppendOnly("Run events are never updated.")
        return super().bulk_create(
            objs,
            batch_size=batch_size,
            ignore_conflicts=ignore_conflicts,
            update_fields=update_fields,
            unique_fields=unique_fields,
        )

    def update(self, **kwargs: Any) -> int:
        raise EventLogIsAppendOnly("Run events are never updated.")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise EventLogIsAppendOnly("Run events are never deleted.")


class RunEvent(models.Model):
    """One entry of a run's append-only log, ordered by `seq`; replaying them explains the run.

    Written only through `runs.events`, which numbers them under the run's row lock.
    """

    id = models.UUIDField(primary_key=True, default=time_ordered_id, editable=False)
    # Indexed by (run, seq), which leads with it.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, related_name="events", db_index=False
    )
    seq = models.PositiveIntegerField()
    type = models.CharField(max_length=32, choices=EventType.choices)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(
        default=timezone.now, help_text="When it happened, not when its step was written."
    )

    objects = RunEventQuerySet.as_manager()

    class Meta:
        base_manager_name = "objects"
        ordering = ["run_id", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="runevent_unique_seq"),
            models.CheckConstraint(condition=models.Q(seq__gte=1), name="runevent_seq_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.type}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise EventLogIsAppendOnly("Run events are never updated.")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise EventLogIsAppendOnly("Run events are never deleted.")
