from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from config.credentials import credential_refusal, url_secret_refusal
from config.history import history_records
from registry.choices import ModelProvider, NoSkillMatched, SkillAssembly
from runs.redaction import names_secret

CREDENTIAL_REF_VALIDATOR = RegexValidator(
    r"^[A-Z][A-Z0-9_]{0,127}$",
    "A credential reference is the NAME of an environment variable (e.g. OPENAI_API_KEY), "
    "never the secret itself.",
)


# What names the model a config calls: another value of any of them is another model.
MODEL_IDENTITY_FIELDS = ("provider", "model_name", "base_url")
# The parameters that only bound how a call is made, never what the model answers: the model
# client reads them itself and sends none to the provider. Every other parameter goes with each
# call (temperature, top_p, a router's `models` or `route`) and shapes the answer.
TIMEOUT_PARAMETER = "timeout_s"
MODEL_OPERATIONAL_PARAMETERS = frozenset({TIMEOUT_PARAMETER})


def timeout_problem(value: object) -> str | None:
    """Why `value` is no `timeout_s` a call could be made with, if it is not: a positive
    number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return f"{TIMEOUT_PARAMETER} must be a positive number of seconds, not {value!r}."
    return None


class ModelConfig(models.Model):
    """A model endpoint and its price. The credential is a reference resolved at call time."""

    tenant = models.ForeignKey(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="model_configs",
        null=True,
        blank=True,
        help_text="Empty: available to every tenant.",
    )
    name = models.SlugField(max_length=63)
    provider = models.CharField(max_length=32, choices=ModelProvider.choices)
    model_name = models.CharField(max_length=200)
    base_url = models.URLField(blank=True)
    credential_ref = models.CharField(
        max_length=128, blank=True, validators=[CREDENTIAL_REF_VALIDATOR]
    )
    parameters = models.JSONField(default=dict, blank=True)
    price_per_1k_input = models.DecimalField(
        max_digits=12, decimal_places=6, default=Decimal("0"), validators=[MinValueValidator(0)]
    )
    price_per_1k_cached_input = models.DecimalField(
        max_digits=12,
        decimal_places=6,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Input tokens read from the provider's prompt cache. Empty: the input price.",
    )
    price_per_1k_cache_write = models.DecimalField(
        max_digits=12,
        decimal_places=6,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Input tokens written to the provider's prompt cache (Anthropic's cache "
        "writes, priced above input by how long they are kept). Empty: the input price.",
    )
    price_per_1k_output = models.DecimalField(
        max_digits=12, decimal_places=6, default=Decimal("0"), validators=[MinValueValidator(0)]
    )
    is_active = models.BooleanField(default=True)

    history = history_records()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                condition=models.Q(tenant__isnull=False),
                name="modelconfig_unique_tenant_name",
            ),
            models.UniqueConstraint(
                fields=["name"],
                condition=models.Q(tenant__isnull=True),
                name="modelconfig_unique_platform_name",
            ),
            models.CheckConstraint(
                condition=models.Q(price_per_1k_input__gte=0, price_per_1k_output__gte=0),
                name="modelconfig_prices_not_negative",
            ),
            models.CheckConstraint(
                condition=models.Q(price_per_1k_cached_input__gte=0),
                name="modelconfig_cached_price_not_negative",
            ),
            models.CheckConstraint(
                condition=models.Q(price_per_1k_cache_write__gte=0),
                name="modelconfig_cache_write_price_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.get_provider_display()}: {self.model_name})"

    def clean(self) -> None:
        if not isinstance(self.parameters, dict):
            raise ValidationError({"parameters": "Parameters are a JSON object."})
        # Saved, a timeout no call can be made with would fail every run of the config.
        if TIMEOUT_PARAMETER in self.parameters and (
            problem := timeout_problem(self.parameters[TIMEOUT_PARAMETER])
        ):
            raise ValidationError({"parameters": problem})
        refusal = credential_refusal(self.credential_ref, owner=self.tenant)
        if refusal:
            raise ValidationError({"credential_ref": refusal})
        refusal = url_secret_refusal(self.base_url)
        if refusal:
            raise ValidationError({"base_url": refusal})
        secret_like = sorted(_secret_paths(self.parameters))
        if secret_like:
            raise ValidationError(
                {
                    "parameters": f"{', '.join(secret_like)} look like credentials; name the "
                    "environment variable that holds the secret in credential_ref instead."
                }
            )


def _secret_paths(value: object, prefix: str = "") -> list[str]:
    """Where in `value` a key names a credential, at any depth (`extra_headers.Authorization`),
    written in letters of another script that look like Latin ones too (`names_secret`)."""
    if isinstance(value, list):
        return [path for item in value for path in _secret_paths(item, prefix)]
    if not isinstance(value, dict):
        return []
    paths = []
    for name, item in value.items():
        path = f"{prefix}{name}"
        paths += [path] if names_secret(str(name)) else _secret_paths(item, f"{path}.")
    return paths


class AgentConfig(models.Model):
    """An agent: its model, its skills (bound statically, or recalled from the registry for
    each request), its policy and its budgets."""

    tenant = models.ForeignKey(
        "registry.Tenant", on_delete=models.PROTECT, related_name="agent_configs"
    )
    name = models.SlugField(max_length=63)
    description = models.TextField(blank=True)
    model_config = models.ForeignKey(
        ModelConfig, on_delete=models.PROTECT, related_name="agent_configs"
    )
    skills = models.ManyToManyField(
        "registry.Skill",
        related_name="agent_configs",
        blank=True,
        help_text="Static assembly: the skills this agent uses. Retrieval: ignored.",
    )
    skill_assembly = models.CharField(
        max_length=16, choices=SkillAssembly.choices, default=SkillAssembly.STATIC
    )
    skill_min_score = models.DecimalField(
        max_digits=4,
        decimal_places=3,
        default=Decimal("0.080"),
        validators=[MinValueValidator(0), MaxValueValidator(1)],
        help_text="Retrieval: a skill scoring below this is not used (0 to 1; the mean over the "
        "request's terms of how strongly a skill's triggers, description or examples match).",
    )
    when_no_skill_matches = models.CharField(
        max_length=16, choices=NoSkillMatched.choices, default=NoSkillMatched.ANSWER
    )
    policy = models.ForeignKey(
        "registry.Policy", on_delete=models.PROTECT, related_name="agent_configs"
    )
    max_steps = models.PositiveIntegerField(default=8, validators=[MinValueValidator(1)])
    max_tool_calls = models.PositiveIntegerField(default=16, validators=[MinValueValidator(1)])
    max_seconds = models.PositiveIntegerField(default=300, validators=[MinValueValidator(1)])
    max_tokens = models.PositiveIntegerField(default=60_000, validators=[MinValueValidator(1)])
    max_cost = models.DecimalField(
        max_digits=12, decimal_places=4, default=Decimal("1.00"), validators=[MinValueValidator(0)]
    )
    is_active = models.BooleanField(default=True)

    history = history_records(m2m_fields=[skills])

    class Meta:
        ordering = ["tenant__slug", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="agentconfig_unique_name"),
            models.CheckConstraint(
                condition=models.Q(
                    max_steps__gte=1,
                    max_tool_calls__gte=1,
                    max_seconds__gte=1,
                    max_tokens__gte=1,
                    max_cost__gte=0,
                ),
                name="agentconfig_budgets_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    def clean(self) -> None:
        errors = {}
        if self.model_config_id and self.model_config.tenant_id not in (None, self.tenant_id):
            errors["model_config"] = "This model configuration belongs to another tenant."
        if self.policy_id and self.policy.tenant_id != self.tenant_id:
            errors["policy"] = "This policy belongs to another tenant."
        if errors:
            raise ValidationError(errors)
