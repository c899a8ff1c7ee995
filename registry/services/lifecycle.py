"""Publish, deprecate, revoke and roll back a tool or skill version.

Every transition locks the parent row first, so two publishers of the same tool serialise, and
moves `current_version` in the same transaction as the status. The current version is the
highest stable one published, a pre-release only while none is: a pre-release is published to
be tried, pinned by naming it whole, as semver ranges leave it out (`selectors`).
"""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from registry.choices import VERSION_TRANSITIONS, VersionStatus
from registry.errors import (
    InvalidStatusTransition,
    PermissionDenied,
    ValidationFailed,
    VersionImmutable,
    VersionNotGreater,
)
from registry.models.definitions import Definition
from registry.models.versions import DefinitionVersion
from registry.selectors import user_may_publish
from registry.services.common import audited_save, audited_unique_save, full_clean_or_raise

V = TypeVar("V", bound=DefinitionVersion)
D = TypeVar("D", bound=Definition)


def require_publisher(*, actor: AbstractBaseUser, definition: Definition) -> None:
    if not user_may_publish(user=actor, definition=definition):
        raise PermissionDenied(f"You may not manage versions of {definition}.")


def definition_get_or_create(
    model: type[D], *, actor: AbstractBaseUser, tenant: Any, name: str, namespace: str
) -> D:
    """The tool or skill of this name, created (by a publisher) on first use of the name.
    When a concurrent request created it first, this one uses theirs."""
    found = model.objects.filter(tenant=tenant, namespace=namespace, name=name)
    definition = found.first()
    if definition is None:
        definition = model(tenant=tenant, namespace=namespace, name=name, created_by=actor)
        require_publisher(actor=actor, definition=definition)
        full_clean_or_raise(definition, exclude=["current_version"])
        try:
            audited_unique_save(
                definition, actor=actor, reason="created", exclude=["current_version"]
            )
        except ValidationFailed:
            definition = found.first()
            if definition is None:
                raise
    return definition


def lock_version(version: V) -> tuple[Definition, V]:
    """Lock the parent, then the version (always in that order), and return fresh rows."""
    parent_model = type(version.parent)
    parent = parent_model.objects.select_for_update().get(pk=version.parent.pk)
    locked = type(version).objects.select_for_update().get(pk=version.pk)
    return parent, locked


def draft_locked(version: DefinitionVersion) -> None:
    """Lock the version for an edit of its draft, refusing it if it is frozen as it is now,
    not as the caller read it: a publish may have frozen it since. Published versions are
    frozen: a change is a new version."""
    _, locked = lock_version(version)
    if locked.is_frozen:
        raise VersionImmutable(f"{locked.qualified_name} is {locked.status}; create a new version.")


def _check_transition(version: DefinitionVersion, target: str) -> None:
    if target not in VERSION_TRANSITIONS[version.status]:
        raise InvalidStatusTransition(
            f"{version.qualified_name} is {version.status}; it cannot become {target}.",
            details={"from": version.status, "to": target},
        )


def _latest_published(
    parent: Definition,
    *,
    excluding: DefinitionVersion,
    refused: Callable[[DefinitionVersion], str] | None = None,
) -> tuple[DefinitionVersion | None, list[str]]:
    """The highest published version but `excluding` that `refused` lets become current
    (it answers why one may not, or ""), and why each higher one may not. Pre-releases are
    candidates only when no stable version is published."""
    candidates = sorted(
        parent.versions.filter(status=VersionStatus.PUBLISHED).exclude(pk=excluding.pk),
        key=lambda version: version.semver,
        reverse=True,
    )
    stable = [version for version in candidates if version.semver.prerelease is None]
    candidates = stable or candidates
    passed_over = []
    for version in candidates:
        why = refused(version) if refused is not None else ""
        if not why:
            return version, passed_over
        passed_over.append(f"{version.version} not made current: {why}")
    return None, passed_over


def _is_pre_release_beside_stable(
    version: DefinitionVersion, others: Iterable[DefinitionVersion]
) -> bool:
    """Whether `version` is a pre-release while a stable version is published: the current
    version stays as it is, the highest stable one or one rolled back to."""
    return version.semver.prerelease is not None and any(
        other.status == VersionStatus.PUBLISHED and other.semver.prerelease is None
        for other in others
    )


def _set_current(
    parent: Definition, version: DefinitionVersion | None, *, actor: AbstractBaseUser, reason: str
) -> None:
    parent.current_version = version
    audited_save(parent, actor=actor, reason=reason, update_fields=["current_version"])


def version_publish(
    *,
    version: V,
    actor: AbstractBaseUser,
    validate: Callable[[V], None],
    reason: str = "published",
) -> V:
    require_publisher(actor=actor, definition=version.parent)
    with transaction.atomic():
        parent, version = lock_version(version)
        if version.status == VersionStatus.PUBLISHED:
            return version
        _check_transition(version, VersionStatus.PUBLISHED)
        validate(version)
        released = parent.versions.exclude(pk=version.pk).exclude(status=VersionStatus.DRAFT)
        not_lower = sorted(other.version for other in released if other.semver >= version.semver)
        if not_lower:
            raise VersionNotGreater(
                f"{version.version} must be greater than every released version "
                f"of {parent.name}; {', '.join(not_lower)} already "
                f"{'exists' if len(not_lower) == 1 else 'exist'}.",
                details={"version": version.version, "existing": not_lower},
            )
        version.status = VersionStatus.PUBLISHED
        version.published_at = timezone.now()
        version.published_by = actor
        audited_save(version, actor=actor, reason=reason)
        if not _is_pre_release_beside_stable(version, released):
            _set_current(parent, version, actor=actor, reason=f"published {version.version}")
    return version


def _version_retire(
    *,
    version: V,
    actor: AbstractBaseUser,
    target: str,
    reason: str,
    refused: Callable[[V], str] | None = None,
) -> V:
    """Retire `version`; when it was current, the highest other published version that
    `refused` lets be current (it answers why one may not, or "") becomes current, or none,
    and the parent's history says which were passed over and why."""
    require_publisher(actor=actor, definition=version.parent)
    with transaction.atomic():
        parent, version = lock_version(version)
        if version.status == target:
            return version
        _check_transition(version, target)
        version.status = target
        version.status_reason = reason
        now = timezone.now()
        if target == VersionStatus.DEPRECATED:
            version.deprecated_at = now
        else:
            version.revoked_at = now
        audited_save(version, actor=actor, reason=f"{target}: {reason}" if reason else target)
        if parent.current_version_id == version.pk:
            current, passed_over = _latest_published(parent, excluding=version, refused=refused)
            _set_current(
                parent,
                current,
                actor=actor,
                reason="; ".join([f"{version.version} {target}", *passed_over]),
            )
    return version


def version_deprecate(
    *,
    version: V,
    actor: AbstractBaseUser,
    reason: str = "",
    refused: Callable[[V], str] | None = None,
) -> V:
    """Deprecated versions keep serving existing pins; nothing new may pin them. `refused`:
    why an earlier version may not become current in its place (`_version_retire`)."""
    return _version_retire(
        version=version,
        actor=actor,
        target=VersionStatus.DEPRECATED,
        reason=reason,
        refused=refused,
    )


def version_revoke(
    *,
    version: V,
    actor: AbstractBaseUser,
    reason: str = "",
    refused: Callable[[V], str] | None = None,
) -> V:
    """Revoked versions are never used again, pinned or not. `refused`: why an earlier
    version may not become current in its place (`_version_retire`)."""
    return _version_retire(
        version=version, actor=actor, target=VersionStatus.REVOKED, reason=reason, refused=refused
    )


def version_rollback(
    *,
    version: V,
    actor: AbstractBaseUser,
    validate: Callable[[V], None] | None = None,
    reason: str = "",
) -> V:
    """Make an earlier published version current again, once `validate` lets it. `reason`:
    what the parent's history says, when more than that it was rolled back."""
    require_publisher(actor=actor, definition=version.parent)
    with transaction.atomic():
        parent, version = lock_version(version)
        if version.status != VersionStatus.PUBLISHED:
            raise InvalidStatusTransition(
                f"Only a published version can be made current; {version.qualified_name} "
                f"is {version.status}.",
                details={"status": version.status},
            )
        if parent.current_version_id != version.pk:
            if validate is not None:
                validate(version)
            _set_current(
                parent, version, actor=actor, reason=reason or f"rolled back to {version.version}"
            )
    return version
