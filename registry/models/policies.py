from django.core.validators import MinValueValidator
from django.db import models

from config.history import history_records
from registry.choices import DataClassification, Risk, Role
from registry.schemas import validate_policy_lists


def default_approver_roles() -> list[str]:
    return [Role.APPROVER.value]


def default_approval_risks() -> list[str]:
    return [Risk.EXTERNAL_SIDE_EFFECT.value, Risk.DESTRUCTIVE.value, Risk.FINANCIAL.value]


class Policy(models.Model):
    """Approval rules and data classification limits a tenant's agents run under."""

    tenant = models.ForeignKey("registry.Tenant", on_delete=models.PROTECT, related_name="policies")
    name = models.SlugField(max_length=63)
    approval_required_risks = models.JSONField(
        default=default_approval_risks,
        blank=True,
        help_text="Tool risks whose side effects wait for a human approval.",
    )
    human_queue_risks = models.JSONField(
        default=list,
        blank=True,
        help_text="Tool risks the agent never handles: a request whose skill uses such a tool "
        "goes to a queue of people (the approver roles) instead.",
    )
    approver_roles = models.JSONField(
        default=default_approver_roles, help_text="Roles that may decide an approval."
    )
    allow_self_approval = models.BooleanField(default=False)
    approval_ttl_seconds = models.PositiveIntegerField(
        default=24 * 3600, validators=[MinValueValidator(60)]
    )
    max_data_classification = models.CharField(
        max_length=16,
        choices=DataClassification.choices,
        default=DataClassification.CONFIDENTIAL,
        help_text="The most sensitive data a run under this policy may read.",
    )

    history = history_records()

    class Meta:
        ordering = ["tenant__slug", "name"]
        verbose_name_plural = "policies"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="policy_unique_name"),
            models.CheckConstraint(
                condition=models.Q(approval_ttl_seconds__gte=60), name="policy_ttl_at_least_60s"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    def clean(self) -> None:
        validate_policy_lists(self)
