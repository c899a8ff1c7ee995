"""What tools and skills share: a name in a namespace, an owner and a current version."""

import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

NAMESPACE_VALIDATOR = RegexValidator(
    r"^[a-z][a-z0-9_.-]{0,62}$", "Lower-case letters, digits, '_', '.', '-'; starts with a letter."
)


class Definition(models.Model):
    """A named, versioned capability. `tenant` is its owner; empty means platform-wide, usable
    by a tenant only after a grant to the tenant's group."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        "registry.Tenant",
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        help_text="Owner tenant; empty for a platform-wide definition granted to tenants.",
    )
    namespace = models.CharField(max_length=63, default="core", validators=[NAMESPACE_VALIDATOR])
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )

    class Meta:
        abstract = True

    def __str__(self) -> str:
        owner = self.tenant.slug if self.tenant_id else "platform"
        return f"{owner}/{self.namespace}/{self.name}"

    @property
    def is_platform_wide(self) -> bool:
        return self.tenant_id is None

    # What names the definition in every qualified name, capability snapshot and pin.
    IDENTITY_FIELDS = ("tenant_id", "namespace", "name")

    def clean(self) -> None:
        """Once a version left draft, the definition's name, namespace and owner are what its
        published versions are known by: they no longer change."""
        super().clean()
        if self._state.adding:
            return
        stored = (
            type(self)._default_manager.filter(pk=self.pk).values(*self.IDENTITY_FIELDS).first()
        )
        if stored is None or all(stored[name] == getattr(self, name) for name in stored):
            return
        if self.versions.any_frozen():
            raise ValidationError(
                "A definition with a published, deprecated or revoked version keeps its "
                "name, namespace and owner."
            )


def unique_name_constraints(prefix: str) -> list[models.UniqueConstraint]:
    """One name per namespace per owner, platform-wide names included (NULL tenant)."""
    return [
        models.UniqueConstraint(
            fields=["tenant", "namespace", "name"],
            condition=models.Q(tenant__isnull=False),
            name=f"{prefix}_unique_tenant_namespace_name",
        ),
        models.UniqueConstraint(
            fields=["namespace", "name"],
            condition=models.Q(tenant__isnull=True),
            name=f"{prefix}_unique_platform_namespace_name",
        ),
    ]
