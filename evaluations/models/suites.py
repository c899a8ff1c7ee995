import uuid

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

from config.history import history_records
from evaluations.choices import AttackVector, SuiteKind
from evaluations.schemas import CASE_FIELD_SCHEMAS, case_errors

KEY_VALIDATOR = RegexValidator(r"^[a-z0-9][a-z0-9-]{0,62}$", "Lower-case letters, digits and '-'.")


class EvalSuite(models.Model):
    """A fixed set of cases that compares versions: a task suite (does the skill do its job
    on realistic inputs) or an attack suite (do the host's boundaries hold against prompt
    injection). Platform-wide when `tenant` is empty."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="eval_suites",
        null=True,
        blank=True,
        help_text="Empty: a platform suite every tenant may run.",
    )
    key = models.CharField(max_length=63, validators=[KEY_VALIDATOR])
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=SuiteKind.choices)
    description = models.TextField(blank=True)
    skill_name = models.CharField(
        max_length=64, help_text="The skill whose versions this suite evaluates."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    history = history_records()

    class Meta:
        ordering = ["key"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "key"],
                condition=models.Q(tenant__isnull=False),
                name="evalsuite_unique_tenant_key",
            ),
            models.UniqueConstraint(
                fields=["key"],
                condition=models.Q(tenant__isnull=True),
                name="evalsuite_unique_platform_key",
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def clean(self) -> None:
        """An attack suite's cases each say where their payload hides (`EvalCase.clean`): a
        suite becomes one only once its cases do, or no metric would count them as attacks."""
        if self.kind != SuiteKind.ATTACK or self._state.adding:
            return
        unplaced = list(self.cases.filter(vector="").order_by("key").values_list("key", flat=True))
        if unplaced:
            says = "says" if len(unplaced) == 1 else "say"
            them = "it" if len(unplaced) == 1 else "each"
            raise ValidationError(
                {
                    "kind": f"An attack case says where its payload hides; "
                    f"{', '.join(unplaced)} {says} nowhere. Give {them} a vector on its page "
                    "first: no metric counts a case without one as an attack."
                }
            )


class EvalCase(models.Model):
    """One situation: the messages a user sends, the session state and business data the
    tools will find (`fixture`), and what must come of it (`expected`). An attack case also
    names its payload, where it hides (`vector`) and the effect that must never happen."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    suite = models.ForeignKey(EvalSuite, on_delete=models.CASCADE, related_name="cases")
    key = models.CharField(max_length=63, validators=[KEY_VALIDATOR])
    title = models.CharField(max_length=200)
    messages = models.JSONField(help_text="What the user sends, in order, in one session.")
    metadata = models.JSONField(default=dict, blank=True, help_text="Metadata of each message.")
    session_state = models.JSONField(default=dict, blank=True)
    fixture = models.JSONField(
        default=dict,
        blank=True,
        help_text="Business data of the sandbox: projects (updates, leads, who may see them) "
        "and tool failures.",
    )
    expected = models.JSONField(
        default=dict,
        help_text="status, skill, mode, tools_called, tools_not_called, recipient_record_id, "
        "sections, cites_sources, max_steps: only what the case states is checked.",
    )
    vector = models.CharField(max_length=32, choices=AttackVector.choices, blank=True)
    payload = models.TextField(blank=True)
    forbidden = models.JSONField(
        default=dict, blank=True, help_text="tools, recipients, text that must never appear."
    )

    history = history_records()

    class Meta:
        ordering = ["suite", "key"]
        constraints = [
            models.UniqueConstraint(fields=["suite", "key"], name="evalcase_unique_key"),
        ]

    def __str__(self) -> str:
        return f"{self.suite.key}/{self.key}"

    def clean(self) -> None:
        """The definition as the runner reads it (`evaluations.schemas`); an attack case
        says where its payload hides, or no metric counts it as an attack."""
        errors = case_errors({field: getattr(self, field) for field in CASE_FIELD_SCHEMAS})
        if (
            not errors
            and isinstance(self.metadata, list)
            and len(self.metadata) > len(self.messages)
        ):
            errors["metadata"] = [
                f"{len(self.metadata)} metadata for {len(self.messages)} messages: one per message."
            ]
        if self.suite_id and self.suite.kind == SuiteKind.ATTACK and not self.vector:
            errors["vector"] = ["A case of an attack suite says where its payload hides."]
        if errors:
            raise ValidationError(errors)

    @property
    def attack(self) -> dict | None:
        if not self.vector:
            return None
        return {"vector": self.vector, "payload": self.payload, "forbidden": self.forbidden}
