"""Helpers every registry service uses: validation into domain errors, audited saves."""

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.db.models import QuerySet

from evaluations.gates import model_change_check
from registry.errors import PermissionDenied, ValidationFailed
from registry.models import AgentConfig, Skill, Tenant


def full_clean_or_raise(instance: models.Model, *, exclude: list[str] | None = None) -> None:
    try:
        instance.full_clean(exclude=exclude)
    except ValidationError as error:
        details = (
            error.message_dict if hasattr(error, "error_dict") else {"__all__": error.messages}
        )
        raise ValidationFailed("The submitted values are not valid.", details=details) from error


def audited_save(
    instance: models.Model, *, actor: AbstractBaseUser | None, reason: str, **kwargs: Any
) -> None:
    """Save and have django-simple-history record who did it and why."""
    instance._history_user = actor
    instance._change_reason = reason
    instance.save(**kwargs)


def audited_unique_save(
    instance: models.Model,
    *,
    actor: AbstractBaseUser | None,
    reason: str,
    exclude: list[str] | None = None,
) -> None:
    """Save a row (a new one, or one renamed) that `full_clean_or_raise` found unique. A
    concurrent request may have saved the same one since: the unique constraint refuses this
    one, and the check, run again, says why, as it would have had this request come second."""
    try:
        with transaction.atomic():
            audited_save(instance, actor=actor, reason=reason)
    except IntegrityError:
        full_clean_or_raise(instance, exclude=exclude)
        raise


def registry_object_save(
    *,
    instance: models.Model,
    actor: AbstractBaseUser,
    reason: str = "saved",
    skills: QuerySet[Skill] | None = None,
) -> models.Model:
    """Validate and save a registry configuration row (model, agent, policy, rollout). An agent
    moves to another model only when the release gates of the skills it has after the save
    hold with that model: `skills`, the skills an agent is bound to with the row, or those it
    has when they are not given."""
    full_clean_or_raise(instance)
    if isinstance(instance, AgentConfig):
        model_change_check(agent_config=instance, bound_skills=skills)
    if isinstance(instance, Tenant):
        _tenant_change_check(tenant=instance, actor=actor)
    with transaction.atomic():
        audited_unique_save(instance, actor=actor, reason=reason)
        if skills is not None:
            instance.skills.set(skills)
    return instance


# What only the platform's admins change on a tenant: its slug (credentials are granted by
# it, `TENANT_CREDENTIALS`), whether it is active, its quota and cap, what it is a sandbox of.
TENANT_PLATFORM_FIELDS = (
    "slug",
    "is_active",
    "daily_cost_quota",
    "max_concurrent_runs",
    "sandbox_of",
)


def _tenant_change_check(*, tenant: Tenant, actor: AbstractBaseUser) -> None:
    if actor.is_superuser or tenant._state.adding:
        return
    saved = Tenant.objects.filter(pk=tenant.pk).values(*TENANT_PLATFORM_FIELDS).first() or {}
    changed = [
        field
        for field in TENANT_PLATFORM_FIELDS
        if saved.get(field) != getattr(tenant, Tenant._meta.get_field(field).attname)
    ]
    if changed:
        raise PermissionDenied(
            "Only a platform admin changes a tenant's " + ", ".join(changed) + ".",
            details={"fields": changed},
        )
