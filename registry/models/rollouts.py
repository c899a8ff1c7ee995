from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import models

from config.history import history_records
from registry.choices import VersionStatus


class RolloutFlag(models.Model):
    """Serves a skill version to a share of actors and/or to listed tenants.

    Bucketing hashes the flag key with the actor id, so an actor stays in or out of the
    rollout on every run until the percentage changes. A key is unique among the flags of one
    owner: a tenant's key says nothing of another tenant's flags.
    """

    key = models.SlugField(max_length=63)
    skill = models.ForeignKey("registry.Skill", on_delete=models.CASCADE, related_name="rollouts")
    tenant = models.ForeignKey(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        editable=False,
        help_text="The owner of the flag's skill; empty for a platform-wide skill.",
    )
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
            models.UniqueConstraint(
                fields=["tenant", "key"],
                condition=models.Q(tenant__isnull=False),
                name="rolloutflag_unique_tenant_key",
            ),
            models.UniqueConstraint(
                fields=["key"],
                condition=models.Q(tenant__isnull=True),
                name="rolloutflag_unique_platform_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key}: {self.skill_version} to {self.percentage}%"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.tenant_id = self.skill.tenant_id
        super().save(*args, **kwargs)

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.skill_id:
            self.tenant_id = self.skill.tenant_id
            taken = RolloutFlag.objects.filter(tenant_id=self.tenant_id, key=self.key)
            if taken.exclude(pk=self.pk).exists():
                owner = "This tenant" if self.tenant_id else "The platform"
                errors["key"] = f"{owner} already has a rollout flag with this key."
        if self.skill_id and self.skill_version_id:
            if self.skill_version.skill_id != self.skill_id:
                errors["skill_version"] = "This version belongs to another skill."
            elif self.skill_version.status != VersionStatus.PUBLISHED:
                errors["skill_version"] = "Only a published version can be rolled out."
        if errors:
            raise ValidationError(errors)
