from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from config.history import history_records
from evaluations.choices import RATE_METRICS, Comparator, Metric
from registry.models import Skill


class EvalThreshold(models.Model):
    """A release gate of a skill: a version may be published only after a finished eval run
    of `suite` on exactly that version whose `metric` meets `comparator value`."""

    tenant = models.ForeignKey(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="eval_thresholds",
        null=True,
        blank=True,
        help_text="The skill's owner; empty for a platform skill.",
    )
    skill_name = models.CharField(max_length=64)
    suite = models.ForeignKey(
        "evaluations.EvalSuite", on_delete=models.PROTECT, related_name="thresholds"
    )
    metric = models.CharField(max_length=48, choices=Metric.choices)
    comparator = models.CharField(max_length=2, choices=Comparator.choices)
    value = models.FloatField()

    history = history_records()

    class Meta:
        ordering = ["skill_name", "suite", "metric"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "skill_name", "suite", "metric"],
                name="evalthreshold_unique_metric",
                nulls_distinct=False,
            ),
        ]

    def __str__(self) -> str:
        return f"{self.skill_name}: {self.metric} {self.comparator} {self.value} ({self.suite})"

    def clean(self) -> None:
        """A rate is a fraction: `<= 5` meant as 5% would always pass and `>= 90` never.
        A cost or a time is never negative, so a threshold below 0 could never be met. The
        suite evaluates this skill and is the platform's or the skill's tenant's: no eval run
        of the skill could be started on another (`eval_run_start`), so the gate would hold
        back every version, or, with the skill's name mistyped, none. A tenant's threshold
        gates that tenant's skill of the name: a platform skill's versions are published by
        the platform on the platform's thresholds, so a tenant without a skill of its own of
        that name would add a gate no publish checks."""
        if self.tenant_id is not None and self.skill_name and self._gates_a_platform_skill():
            raise ValidationError(
                {
                    "skill_name": f"{self.skill_name} is a platform skill: a tenant cannot gate "
                    f"it, its release gate is the platform's thresholds. "
                    f"{self.tenant} has no skill of its own named {self.skill_name}."
                }
            )
        if self.suite_id is not None:
            if self.suite.tenant_id not in (None, self.tenant_id):
                raise ValidationError({"suite": f"{self.suite} belongs to another tenant."})
            if self.skill_name and self.suite.skill_name != self.skill_name:
                raise ValidationError(
                    {
                        "skill_name": f"{self.suite} evaluates {self.suite.skill_name}, "
                        f"not {self.skill_name}."
                    }
                )
        if self.metric not in Metric.values or self.value is None:
            return  # the field's own check names what is wrong with it
        if self.metric in RATE_METRICS and not 0 <= self.value <= 1:
            raise ValidationError(
                {
                    "value": f"{self.metric} is a rate, a fraction from 0 to 1 "
                    f"(0.05 for 5%), not {self.value}."
                }
            )
        if self.value < 0:
            raise ValidationError({"value": f"{self.metric} is never negative, not {self.value}."})

    def _gates_a_platform_skill(self) -> bool:
        skills = Skill.objects.filter(name=self.skill_name)
        return (
            skills.filter(tenant__isnull=True).exists()
            and not skills.filter(tenant_id=self.tenant_id).exists()
        )

    def is_met(self, measured: float | None) -> bool:
        if measured is None:
            return False
        if self.comparator == Comparator.AT_LEAST:
            return measured >= self.value
        return measured <= self.value


class ReleaseOverride(models.Model):
    """A publish, or a rollback, an admin let through although its release gate failed, with
    the reason and the failures it overrode: part of the audit trail."""

    skill_version = models.ForeignKey(
        "registry.SkillVersion", on_delete=models.PROTECT, related_name="release_overrides"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="release_overrides"
    )
    reason = models.TextField()
    failures = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(reason=""), name="releaseoverride_has_reason"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.skill_version_id} by {self.actor_id}"
