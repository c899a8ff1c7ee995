from datetime import timedelta

from django.conf import settings
from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone
from guardian.shortcuts import assign_perm, get_group_perms, remove_perm

from evaluations.gates import grant_release_gate_check, release_override_record
from registry.choices import Action, Role
from registry.errors import PermissionDenied, ValidationFailed
from registry.models import ApiToken, Membership, RolloutFlag, Skill, Tenant
from registry.models.definitions import Definition
from registry.models.tenancy import hash_token, new_token_key, password_fingerprints
from registry.selectors import user_can, user_tenants
from registry.services.common import (
    api_tokens_revoke_unless_member,
    audited_delete,
    audited_save,
    audited_unique_save,
    full_clean_or_raise,
    grant_group_name,
    grant_group_taken,
    tenant_admin_kept_check,
    tenant_admins_kept_check,
)


def tenant_create(*, actor: AbstractBaseUser | None, slug: str, name: str) -> Tenant:
    """A tenant with its own grant group for platform-wide tools and skills.

    The group is a new one: a group left with the name (by a tenant deleted, or renamed since)
    keeps the grants it was given, and a new tenant is given none of them."""
    tenant = Tenant(slug=slug, name=name)
    full_clean_or_raise(tenant, exclude=["grant_group"])
    group_name = grant_group_name(slug)
    with transaction.atomic():
        try:
            with transaction.atomic():
                tenant.grant_group = Group.objects.create(name=group_name)
        except IntegrityError:
            full_clean_or_raise(tenant, exclude=["grant_group"])
            raise grant_group_taken(slug) from None
        audited_unique_save(tenant, actor=actor, reason="created")
    return tenant


def tenants_delete(*, actor: AbstractBaseUser, tenants: QuerySet[Tenant]) -> int:
    """Delete tenants with their grant groups. A group serves only its tenant: left behind,
    it would keep the grants the tenant was given and hold the name a new tenant of the slug
    needs. An active rollout flag left listing no tenant is paused: a flag that lists none
    serves every tenant, so the deletion would roll its version out to all of them, with no
    release gate asked, when it served none of them. Returns how many tenants were deleted."""
    if not actor.is_superuser:
        raise PermissionDenied("Only platform admins delete tenants.")
    deleted = 0
    with transaction.atomic():
        listed: dict[object, list[str]] = {}
        for flag_id, slug in (
            RolloutFlag.tenants.through.objects.filter(
                tenant__in=tenants, rolloutflag__is_active=True
            )
            .order_by("tenant__slug")
            .values_list("rolloutflag_id", "tenant__slug")
        ):
            listed.setdefault(flag_id, []).append(slug)
        # The flags, then the tenants: the order a flag's save takes them in (its row, then
        # the tenants it lists).
        list(
            RolloutFlag.objects.select_for_update()
            .filter(pk__in=list(listed))
            .order_by("pk")
            .values_list("pk")
        )
        locked = list(tenants.order_by("pk").select_for_update())
        for tenant in locked:
            tenant._history_user = actor
            tenant._change_reason = "deleted"
            tenant.delete()
            Group.objects.filter(pk=tenant.grant_group_id).delete()
            deleted += 1
        left_listing_none = RolloutFlag.objects.filter(
            pk__in=list(listed), tenants=None, is_active=True
        ).select_related("skill")
        for flag in left_listing_none:
            gone = listed[flag.pk]
            flag.is_active = False
            audited_save(
                flag,
                actor=actor,
                reason=f"paused: {', '.join(gone)}, the only tenant it listed, was deleted"
                if len(gone) == 1
                else f"paused: {', '.join(gone)}, the only tenants it listed, were deleted",
                update_fields=["is_active"],
            )
    return deleted


def membership_add(
    *, actor: AbstractBaseUser | None, user: AbstractBaseUser, tenant: Tenant, role: Role | str
) -> Membership:
    membership = Membership.objects.filter(user=user, tenant=tenant, role=role).first()
    if membership is None:
        membership = Membership(user=user, tenant=tenant, role=role)
        audited_save(membership, actor=actor, reason="role granted")
    return membership


def membership_remove(
    *, actor: AbstractBaseUser, membership: Membership, reason: str = "role removed"
) -> None:
    """Remove a person's role in a tenant, on behalf of an admin of that tenant (platform
    admins, of any). The tenant keeps an active admin: removing its last one is refused.

    Roles are read again on every request and at every step of a run, so what the role
    allowed stops with it, and a person left with no role in the tenant loses their API
    tokens for it (`api_tokens_revoke_unless_member`). Removals in one tenant take turns (its
    row is locked), so two admins removing each other cannot both succeed. A membership
    removed already is left as it is."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=membership.tenant_id)
        if not (
            actor.is_superuser or user_can(user=actor, action=Action.TENANT_ADMIN, tenant=tenant)
        ):
            raise PermissionDenied("Only the tenant's admins remove its members.")
        current = (
            Membership.objects.select_related("user", "tenant").filter(pk=membership.pk).first()
        )
        if current is None:
            return
        tenant_admin_kept_check(leaving=current)
        audited_delete(current, actor=actor, reason=reason)
        api_tokens_revoke_unless_member(user_id=current.user_id, tenant_id=tenant.pk)


def user_save(*, user: AbstractBaseUser) -> None:
    """Save a person changed on the user admin. One deactivated (who logs in nowhere, and
    whose API tokens authenticate nothing) is no longer an admin of their tenants, so a
    tenant whose only active admin they are keeps them (`tenant_admins_kept_check`)."""
    with transaction.atomic():
        if not user.is_active:
            tenant_admins_kept_check(users=get_user_model()._default_manager.filter(pk=user.pk))
        user.save()


def users_delete(*, users: QuerySet[AbstractBaseUser]) -> None:
    """Delete people with their memberships and API tokens, all of them or, a tenant being
    left with no active admin, none (`tenant_admins_kept_check`)."""
    with transaction.atomic():
        tenant_admins_kept_check(users=users)
        users.delete()


def definition_grant(
    *,
    actor: AbstractBaseUser,
    definition: Definition,
    tenant: Tenant,
    granted: bool = True,
    override_reason: str = "",
) -> None:
    """Grant (or withdraw) a tenant the use of a platform-wide tool or skill. A skill granted
    anew is given to the tenant's agents that reach it, so it is held to its release gate with
    their models (`grant_release_gate_check`), or granted over it with a written reason, kept
    as a ReleaseOverride and in the skill's history. A withdrawal gives it to no one. Each
    grant and withdrawal that changes who may use it is in the definition's history, as every
    other registry change is; one that changes nothing is not."""
    if not actor.is_superuser:
        raise PermissionDenied("Only platform admins grant platform-wide definitions.")
    if definition.tenant_id is not None:
        raise ValidationFailed(
            "Only platform-wide definitions are granted; this one belongs to a tenant.",
            details={"definition": [str(definition)]},
        )
    codename = f"use_{definition._meta.model_name}"
    with transaction.atomic():
        # Held as a publish or a rollback holds it, until it is granted or withdrawn: the
        # version a skill's gate checks is the one its agents are given, and the history
        # record is of the row as it is, not as the caller read it.
        locked = type(definition).objects.select_for_update().get(pk=definition.pk)
        if (codename in get_group_perms(tenant.grant_group, locked)) == granted:
            return
        if not granted:
            remove_perm(f"registry.{codename}", tenant.grant_group, locked)
            audited_save(locked, actor=actor, reason=f"withdrawn from {tenant.slug}")
            return
        assign_perm(f"registry.{codename}", tenant.grant_group, locked)
        reason = f"granted to {tenant.slug}"
        if isinstance(locked, Skill):
            overridden = grant_release_gate_check(
                skill=locked, tenant=tenant, actor=actor, override_reason=override_reason
            )
            for version, failures in overridden:
                release_override_record(
                    skill_version=version, actor=actor, reason=override_reason, failures=failures
                )
            if overridden:
                reason += f" over its release gate: {override_reason.strip()}"
        audited_save(locked, actor=actor, reason=reason)


def api_token_issue(
    *, username: str, password: str, tenant_slug: str | None = None
) -> tuple[ApiToken, str]:
    """Check credentials and issue a token bound to one tenant; returns (token, key).

    A user in several tenants names the tenant; a user in one may leave it out.
    """
    user = authenticate(username=username, password=password)
    if user is None or not user.is_active:
        raise ValidationFailed(
            "Unable to log in with the provided credentials.",
            details={"non_field_errors": ["Invalid username or password."]},
        )
    tenants = user_tenants(user=user)
    if tenant_slug:
        tenant = tenants.filter(slug=tenant_slug).first()
        if tenant is None:
            raise ValidationFailed(
                "You are not a member of that tenant.", details={"tenant": ["Unknown tenant."]}
            )
    else:
        candidates = list(tenants[:2])
        if len(candidates) != 1:
            raise ValidationFailed(
                "Name the tenant this token acts in.",
                details={"tenant": ["Required: you belong to several tenants or none."]},
            )
        tenant = candidates[0]
    key = new_token_key()
    token = ApiToken.objects.create(
        key_hash=hash_token(key),
        prefix=key[:8],
        user=user,
        tenant=tenant,
        expires_at=timezone.now() + timedelta(hours=settings.API_TOKEN_TTL_HOURS),
        password_fingerprint=password_fingerprints(user.password)[0],
    )
    return token, key
