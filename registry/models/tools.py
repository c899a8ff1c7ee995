from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from config.history import history_records
from registry.choices import (
    AdapterKind,
    ApprovalRule,
    DataClassification,
    Risk,
    VersionStatus,
)
from registry.models.definitions import Definition, unique_name_constraints
from registry.models.versions import DefinitionVersion

# Provider tool names allow this much and no more (OpenAI and Anthropic alike).
TOOL_NAME_VALIDATOR = RegexValidator(
    r"^[a-z][a-z0-9_]{0,63}$", "Lower-case letters, digits and '_'; starts with a letter."
)


class Tool(Definition):
    """A fact-finding or acting capability the model may request and the host executes."""

    name = models.CharField(max_length=64, validators=[TOOL_NAME_VALIDATOR])
    current_version = models.OneToOneField(
        "registry.ToolVersion",
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        editable=False,
    )

    history = history_records()

    class Meta:
        ordering = ["namespace", "name"]
        constraints = unique_name_constraints("tool")
        permissions = [
            ("use_tool", "Can use this platform-wide tool in runs"),
            ("publish_tool", "Can publish versions of this platform-wide tool"),
        ]


class ToolVersion(DefinitionVersion):
    """The full contract of one tool version: what the model sees (description, input schema)
    and what only the host uses (risk, limits, adapter, approval rule)."""

    parent_field = "tool"

    tool = models.ForeignKey(Tool, on_delete=models.PROTECT, related_name="versions")
    when_not_to_use = models.TextField(blank=True)
    returns = models.TextField(blank=True, help_text="What a result contains.")
    input_schema = models.JSONField(
        default=dict,
        help_text="JSON Schema (Draft 2020-12) of the arguments: type object, "
        "additionalProperties false.",
    )
    result_contract = models.JSONField(default=dict, blank=True)
    risk = models.CharField(max_length=32, choices=Risk.choices, default=Risk.READ)
    timeout_s = models.PositiveIntegerField(
        default=10, validators=[MinValueValidator(1), MaxValueValidator(600)]
    )
    retry_policy = models.JSONField(default=dict, blank=True)
    rate_limit = models.JSONField(default=dict, blank=True)
    concurrency_cap = models.PositiveIntegerField(
        default=4, validators=[MinValueValidator(1), MaxValueValidator(256)]
    )
    circuit_breaker = models.JSONField(default=dict, blank=True)
    is_idempotent = models.BooleanField(default=False)
    supports_dry_run = models.BooleanField(default=False)
    approval_rule = models.CharField(
        max_length=32, choices=ApprovalRule.choices, default=ApprovalRule.NONE
    )
    data_classification = models.CharField(
        max_length=16, choices=DataClassification.choices, default=DataClassification.INTERNAL
    )
    adapter_kind = models.CharField(
        max_length=16, choices=AdapterKind.choices, default=AdapterKind.PYTHON
    )
    adapter_config = models.JSONField(
        default=dict,
        blank=True,
        help_text="python: {handler}; http: {url, credential_ref}; "
        "mcp: {server, remote_name, definition_hash}. Secrets by reference only.",
    )

    history = history_records()

    class Meta:
        ordering = ["tool__name", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["tool", "version"], name="toolversion_unique_version"),
            models.CheckConstraint(
                condition=models.Q(timeout_s__gte=1, timeout_s__lte=600),
                name="toolversion_timeout_in_range",
            ),
            models.CheckConstraint(
                condition=models.Q(concurrency_cap__gte=1),
                name="toolversion_concurrency_cap_positive",
            ),
            models.CheckConstraint(
                condition=~models.Q(status=VersionStatus.PUBLISHED)
                | models.Q(published_at__isnull=False),
                name="toolversion_published_has_date",
            ),
        ]

    def __str__(self) -> str:
        return self.qualified_name
