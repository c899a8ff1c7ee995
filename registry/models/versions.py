"""What tool and skill versions share: semver, lifecycle status and immutability once published."""

import json
import uuid
from typing import Any, ClassVar

import semver
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from registry.choices import FROZEN_STATUSES, VERSION_TRANSITIONS, VersionStatus
from registry.errors import InvalidStatusTransition, VersionImmutable

# Fields a frozen version may still change: its lifecycle, never its content.
LIFECYCLE_FIELDS = frozenset(
    {"status", "status_reason", "published_at", "published_by", "deprecated_at", "revoked_at"}
)


# semver.org's pattern of a version (ASCII digits), the same rule as semver.Version.parse.
SEMVER_PATTERN = (
    r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-((?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(?:\.(?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def validate_semver(value: str) -> None:
    try:
        semver.Version.parse(value)
    except (ValueError, TypeError) as error:
        raise ValidationError(f"'{value}' is not a semantic version such as 1.4.0.") from error


def _holds_stored(stored: Any, value: Any) -> bool:
    """Whether a field still holds what is stored. A document is compared as the JSON it is
    stored as: 1, 1.0 and true differ there, though Python finds them equal."""
    if isinstance(stored, dict | list) or isinstance(value, dict | list):
        return json.dumps(stored, sort_keys=True) == json.dumps(value, sort_keys=True)
    return stored == value


class VersionQuerySet(models.QuerySet):
    """Refuses bulk writes that would change or remove a frozen version's content."""

    def any_frozen(self) -> bool:
        """Whether one of these versions left draft (published, deprecated or revoked)."""
        return self.filter(status__in=FROZEN_STATUSES).exists()

    def update(self, **kwargs: Any) -> int:
        content = (
            set(kwargs)
            - LIFECYCLE_FIELDS
            - {f + "_id" for f in LIFECYCLE_FIELDS}
            - self.model.derived_fields
        )
        if content and self.any_frozen():
            raise VersionImmutable(
                "Published versions cannot be changed; create a new version.",
                details={"fields": sorted(content)},
            )
        if "status" in kwargs:
            raise InvalidStatusTransition("Status changes go through the lifecycle services.")
        return super().update(**kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        if self.any_frozen():
            raise VersionImmutable("Published versions cannot be deleted; revoke them instead.")
        return super().delete()


class DefinitionVersion(models.Model):
    """One version of a tool or a skill. Drafts are editable; once published, only the
    lifecycle fields move, along `VERSION_TRANSITIONS`."""

    parent_field: ClassVar[str]
    # Computed from the content (search terms): not content, so re-deriving them never counts
    # as changing a frozen version.
    derived_fields: ClassVar[frozenset[str]] = frozenset()

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    version = models.CharField(
        max_length=64, validators=[validate_semver], help_text="Semantic version, e.g. 2.0.0."
    )
    description = models.TextField(help_text="What it does, for whom, and what it returns.")
    status = models.CharField(
        max_length=16, choices=VersionStatus.choices, default=VersionStatus.DRAFT
    )
    status_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )
    published_at = models.DateTimeField(null=True, blank=True)
    published_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    deprecated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = VersionQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            self._check_change_allowed()
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        if self.is_frozen:
            raise VersionImmutable("Published versions cannot be deleted; revoke them instead.")
        return super().delete(*args, **kwargs)

    @property
    def parent(self) -> models.Model:
        return getattr(self, self.parent_field)

    @property
    def semver(self) -> semver.Version:
        return semver.Version.parse(self.version)

    @property
    def is_frozen(self) -> bool:
        return self.status in FROZEN_STATUSES

    @property
    def is_current(self) -> bool:
        return self.parent.current_version_id == self.pk

    @property
    def qualified_name(self) -> str:
        return f"{self.parent.name}@{self.version}"

    @classmethod
    def content_field_names(cls) -> list[str]:
        return [
            field.attname
            for field in cls._meta.concrete_fields
            if field.name not in LIFECYCLE_FIELDS | cls.derived_fields and not field.primary_key
        ]

    def _check_change_allowed(self) -> None:
        names = self.content_field_names()
        stored = type(self)._base_manager.filter(pk=self.pk).values("status", *names).first()
        if stored is None:
            return
        if stored["status"] in FROZEN_STATUSES:
            changed = sorted(
                name for name in names if not _holds_stored(stored[name], getattr(self, name))
            )
            if changed:
                raise VersionImmutable(
                    f"{self.qualified_name} is {stored['status']}; its content cannot change. "
                    "Create a new version instead.",
                    details={"fields": changed},
                )
        if self.status != stored["status"] and self.status not in VERSION_TRANSITIONS.get(
            stored["status"], frozenset()
        ):
            raise InvalidStatusTransition(
                f"{self.qualified_name} cannot go from {stored['status']} to {self.status}.",
                details={"from": stored["status"], "to": self.status},
            )
