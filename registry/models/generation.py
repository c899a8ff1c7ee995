from django.db import models


class RegistryGeneration(models.Model):
    """One row: a number that changes whenever a change to what a capability snapshot is
    resolved from commits (PostgreSQL triggers, migration `registry.0010`). Each change takes a
    new value from a sequence, so a value is never seen twice. Absent until the first change,
    and on a database without the triggers."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    value = models.BigIntegerField()

    def __str__(self) -> str:
        return f"registry generation {self.value}"
