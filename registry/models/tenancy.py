import hashlib
import secrets
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.validators import MinValueValidator
from django.db import models
from django.utils.crypto import constant_time_compare, salted_hmac

from config.history import history_records
from registry.choices import Role


class Tenant(models.Model):
    """An organisation; every run, private tool and policy belongs to exactly one.

    Each tenant owns an auth group that receives object grants (django-guardian) for the
    platform-wide tools and skills it may use.
    """

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    grant_group = models.OneToOneField(
        Group, on_delete=models.PROTECT, related_name="tenant", editable=False
    )
    is_active = models.BooleanField(default=True)
    daily_cost_quota = models.DecimalField(
        max_digits=12,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal(0))],
        help_text="Model cost the tenant's runs may spend per day; a run that finds it spent "
        "ends BUDGET_EXHAUSTED. Empty: no quota; 0: no model turn at all.",
    )
    max_concurrent_runs = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="How many of the tenant's runs workers advance at once; the others wait "
        "their turn in the queue. Empty: no cap.",
    )
    sandbox_of = models.ForeignKey(
        "self",
        on_delete=models.PROTECT,
        related_name="sandboxes",
        null=True,
        blank=True,
        editable=False,
        help_text="An evaluation sandbox: it uses this tenant's registry, keeps business data "
        "and runs of its own, and never executes a side effect.",
    )
    sandbox_skill_version = models.ForeignKey(
        "registry.SkillVersion",
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        editable=False,
        help_text="The version a sandbox serves of its skill, published or not.",
    )
    sandbox_settings = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="How an evaluation sandbox differs: faults {tool: error category} its tools "
        "fail with, tool_descriptions {tool: text} the model sees instead.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    history = history_records()

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(daily_cost_quota__gte=0),
                name="tenant_daily_cost_quota_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return self.slug

    @property
    def registry_owner(self) -> "Tenant":
        """Whose tools and skills this tenant uses: its own, or a sandbox's parent's."""
        return self.sandbox_of if self.sandbox_of_id else self


class Membership(models.Model):
    """A user's role in a tenant; a user may hold several roles in several tenants."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    history = history_records()

    class Meta:
        ordering = ["tenant__slug", "user__username", "role"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant", "role"], name="membership_unique_user_tenant_role"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


def hash_token(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def password_fingerprints(password: str) -> list[str]:
    """What a token keeps of its user's password hash, under SECRET_KEY and under each of
    SECRET_KEY_FALLBACKS (the first is the one to keep): a token whose fingerprint is none of
    them was issued before the password changed."""
    return [
        salted_hmac(
            "registry.ApiToken.password_fingerprint", password, secret=secret, algorithm="sha256"
        ).hexdigest()
        for secret in [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]
    ]


def new_token_key() -> str:
    return "agt_" + secrets.token_urlsafe(32)


class ApiToken(models.Model):
    """A bearer token bound to one user acting in one tenant.

    Only the sha256 of the key is stored; the key itself is shown once, when issued.
    """

    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_tokens")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    password_fingerprint = models.CharField(
        max_length=64,
        editable=False,
        help_text="Of the user's password when the token was issued: changing the password "
        "ends the token, as it ends the user's sessions.",
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user} in {self.tenant})"

    @property
    def is_password_unchanged(self) -> bool:
        """Whether the user's password is still the one the token was exchanged for."""
        return any(
            constant_time_compare(self.password_fingerprint, fingerprint)
            for fingerprint in password_fingerprints(self.user.password)
        )
