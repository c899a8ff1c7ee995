from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import models

from config.history import history_records
from registry.choices import VersionStatus


class RolloutFlag(models.Model):
    """Serves a skill version to a share of actors and/or to listed tenants.

    Bucketing hashes the flag key with the actor id, so an actor stays in or out of the
    rollout on every run until the percentage changes.
    """

    key = models.SlugField(max_length=63, unique=True)
    skill = models.ForeignKey("registry.Skill", on_delete=models.CASCADE, related_name="rollouts")
    skill_version = models.ForeignKey(
        "registry.SkillVersion", on_delete=models.PROTECT, related_name="rollouts"
    )
    percentage = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)], help_text="Share of actors, 0-100."
    )
    tenants = models.ManyToManyField(
        "registry.Tenant",
        related_name="rollouts",
        blank=True,
        help_text="If any, only actors of these tenants are eligible.",
    )
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    history = history_records(m2m_fields=[tenants])

    class Meta:
        ordering = ["key"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(percentage__lte=100), name="rolloutflag_percentage_at_most_100"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key}: {self.skill_version} to {self.percentage}%"

    def clean(self) -> None:
        if not (self.skill_id and self.skill_version_id):
            return
        if self.skill_version.skill_id != self.skill_id:
            raise ValidationError({"skill_version": "This version belongs to another skill."})
        if self.skill_version.status != VersionStatus.PUBLISHED:
            raise ValidationError({"skill_version": "Only a published version can be rolled out."})
