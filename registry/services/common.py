"""Helpers every registry service uses: validation into domain errors, audited saves."""

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from evaluations.gates import (
    model_change_check,
    model_config_change_check,
    rollout_change_check,
    tenant_agents_reachable,
    tenant_resume_check,
)
from registry.choices import ROLE_ACTIONS, Action
from registry.errors import PermissionDenied, ValidationFailed
from registry.models import (
    AgentConfig,
    ApiToken,
    Membership,
    ModelConfig,
    Policy,
    RolloutFlag,
    Skill,
    Tenant,
)
from registry.models.definitions import Definition
from registry.selectors import agent_skills_reachable, tenant_has_grant


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


def audited_delete(instance: models.Model, *, actor: AbstractBaseUser | None, reason: str) -> None:
    """Delete and have django-simple-history record who did it and why."""
    instance._history_user = actor
    instance._change_reason = reason
    instance.delete()


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
    tenants: QuerySet[Tenant] | None = None,
) -> models.Model:
    """Validate and save a registry configuration row (model, agent, policy, rollout). An agent
    moves to another model only when the release gates of the skills it has after the save
    hold with that model: `skills`, the skills an agent is bound to with the row, or those it
    has when they are not given. A rollout flag serves its version to agents it did not serve
    before only when its release gate holds with their models (`rollout_change_check`):
    `tenants`, the tenants a flag lists with the row, or those it lists when they are not
    given. A tenant made active again holds its agents to the gates of what they may be given
    (`tenant_resume_check`). A model config that agents or eval runs use keeps the model it
    calls, the parameters sent with each call and its tenant (`model_config_change_check`).
    A membership keeps its tenant's last active admin an admin of it (`tenant_admin_kept_check`);
    one given to another person or tenant ends the API access of the person it leaves with no
    role in its former tenant (`api_tokens_revoke_unless_member`). A tool or skill keeps the
    current version the lifecycle gave it (`_definition_lock`). A policy agents run under
    keeps its tenant (`_policy_tenant_kept_check`), and an agent is saved only with a policy
    of its tenant (`_agent_policy_lock`)."""
    full_clean_or_raise(instance)
    if isinstance(instance, AgentConfig) and skills is not None:
        agent_skills_check(agent_config=instance, skills=skills)
    if isinstance(instance, Tenant):
        _tenant_change_check(tenant=instance, actor=actor)
    with transaction.atomic():
        if isinstance(instance, Definition) and not instance._state.adding:
            _definition_lock(instance)
        if isinstance(instance, AgentConfig):
            bound = Skill.objects.none() if skills is None and instance._state.adding else skills
            _skills_lock(agent_skills_reachable(agent_config=instance, bound_skills=bound))
            _agent_policy_lock(agent_config=instance)
            model_change_check(agent_config=instance, bound_skills=skills)
        if isinstance(instance, ModelConfig):
            model_config_change_check(model_config=instance)
        if isinstance(instance, Policy):
            _policy_tenant_kept_check(policy=instance)
        if isinstance(instance, RolloutFlag):
            _skills_lock([instance.skill])
            rollout_change_check(flag=instance, actor=actor, tenants=tenants)
        if isinstance(instance, Tenant) and _tenant_resumed(instance):
            reachable = tenant_agents_reachable(tenant=instance)
            _skills_lock([skill for skills in reachable.values() for skill in skills])
            tenant_resume_check(tenant=instance, reachable=reachable)
        left = None
        if isinstance(instance, Membership):
            left = _membership_change_check(membership=instance)
        audited_unique_save(instance, actor=actor, reason=reason)
        if skills is not None:
            instance.skills.set(skills)
        if tenants is not None:
            instance.tenants.set(tenants)
        if isinstance(instance, Tenant):
            _grant_group_rename(instance)
        if left is not None:
            api_tokens_revoke_unless_member(user_id=left.user_id, tenant_id=left.tenant_id)
    return instance


def _definition_lock(definition: Definition) -> None:
    """A tool's or skill's row is saved whole, but what a save changes is its owner, namespace
    and name: its current version is the lifecycle's (publish, rollback, deprecation,
    revocation), which may have moved it since the row was read. Written back as read, a
    version published meanwhile would be rolled back with no word of it but "saved". The row
    is locked, as those services lock it, and keeps the current version they left; its checks
    are asked again under the lock, so that a version published meanwhile keeps the name,
    namespace and owner it was published under (`Definition.clean`)."""
    current = list(
        type(definition)
        ._default_manager.select_for_update()
        .filter(pk=definition.pk)
        .values_list("current_version_id", flat=True)
    )
    if current:
        definition.current_version_id = current[0]
    full_clean_or_raise(definition)


POLICY_TENANT_KEPT = (
    "A policy agents run under keeps its tenant: moved, they would run under a policy "
    "another tenant's admins change. Create a policy for the other tenant instead."
)


def _policy_tenant_kept_check(*, policy: Policy) -> None:
    """A policy agents run under stays in their tenant, as an agent may only be bound to a
    policy of its own (`AgentConfig.clean`). Moved to another tenant, the agents would keep
    running under it while that tenant's admins, and no longer their own, decide who approves
    their side effects, whether one may approve one's own and what data they read. The saved
    row stays locked until the caller's transaction ends."""
    if policy._state.adding:
        return
    saved = Policy.objects.select_for_update().filter(pk=policy.pk).values("tenant_id").first()
    if saved is None or saved["tenant_id"] == policy.tenant_id:
        return
    agents = AgentConfig.objects.filter(policy_id=policy.pk).count()
    if agents:
        raise ValidationFailed(
            f"{policy.name} is the policy of {agents} agent{'s' if agents > 1 else ''}, so "
            "its tenant cannot change.",
            details={"tenant": [POLICY_TENANT_KEPT]},
        )


def _agent_policy_lock(*, agent_config: AgentConfig) -> None:
    """The agent's policy, locked until the caller's transaction ends, is still of the agent's
    tenant: `AgentConfig.clean` read it before, and a move of a policy no agent ran under yet
    (`_policy_tenant_kept_check`, which locks it too) may have come since, which would leave
    the agent running under a policy another tenant's admins change."""
    if agent_config.policy_id is None:
        return
    tenant_id = (
        Policy.objects.select_for_update(no_key=True)
        .filter(pk=agent_config.policy_id)
        .values_list("tenant_id", flat=True)
        .first()
    )
    if tenant_id != agent_config.tenant_id:
        raise ValidationFailed(
            "The agent's policy belongs to another tenant.",
            details={"policy": ["This policy belongs to another tenant."]},
        )


def _tenant_resumed(tenant: Tenant) -> bool:
    """Whether the save makes an inactive tenant active again."""
    if tenant._state.adding or not tenant.is_active:
        return False
    return Tenant.objects.filter(pk=tenant.pk, is_active=False).exists()


def _skills_lock(skills: list[Skill]) -> None:
    """Hold the rows of `skills` until the caller's transaction ends, in the order of their
    keys: a publish of one of them (which holds its skill's row while it checks the gate with
    the models of the agents given it) and an agent's move or binding checked against its
    current version go one after the other, each finding what the other saved."""
    list(
        Skill.objects.select_for_update(no_key=True)
        .filter(pk__in=[skill.pk for skill in skills])
        .order_by("pk")
        .values_list("pk")
    )


# The roles that administer their tenant.
ADMIN_ROLES = frozenset(
    role for role, actions in ROLE_ACTIONS.items() if Action.TENANT_ADMIN in actions
)


def tenant_admin_kept_check(*, leaving: Membership) -> None:
    """Refuses to let `leaving`, a saved membership, go when its tenant would be left with no
    active admin. The caller holds the lock of the tenant's row, so that two admins leaving
    at once cannot both find the other."""
    if leaving.role not in ADMIN_ROLES or not leaving.user.is_active:
        return
    others = (
        Membership.objects.filter(
            tenant_id=leaving.tenant_id, role__in=ADMIN_ROLES, user__is_active=True
        )
        .exclude(pk=leaving.pk)
        .exists()
    )
    if not others:
        raise _last_admins_refusal(f"{leaving.user} is the last admin of {leaving.tenant}")


def _last_admins_refusal(lasts: str) -> ValidationFailed:
    return ValidationFailed(
        f"{lasts}: a tenant keeps at least one. Make another member its admin first."
    )


def tenant_admins_kept_check(*, users: QuerySet[AbstractBaseUser]) -> None:
    """Refuses to let `users` go, deactivated or deleted with their memberships, when a tenant
    would be left with no active admin: when its active admins are all among them. Their rows,
    then the rows of the tenants they are active admins of, are locked, in key order, as for
    `tenant_admin_kept_check`: two admins let go at once, or one let go while the other's
    membership is removed, cannot both find the other still there, and one given a tenant's
    last admin role meanwhile is found its admin (`_membership_change_check`)."""
    list(
        get_user_model()
        ._default_manager.select_for_update(no_key=True)
        .filter(pk__in=users.values("pk"))
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    administering = Membership.objects.filter(
        user__in=users, user__is_active=True, role__in=ADMIN_ROLES
    )
    tenant_ids = list(
        Tenant.objects.select_for_update()
        .filter(pk__in=administering.values("tenant_id"))
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    kept = Membership.objects.filter(
        tenant_id=OuterRef("tenant_id"), role__in=ADMIN_ROLES, user__is_active=True
    ).exclude(user__in=users)
    last = (
        administering.filter(tenant_id__in=tenant_ids)
        .exclude(Exists(kept))
        .select_related("user", "tenant")
        .order_by("tenant__slug", "user__username")
    )
    admins_of: dict[str, list[str]] = {}
    for membership in last:
        admins_of.setdefault(str(membership.tenant), []).append(str(membership.user))
    tenants_of: dict[tuple[str, ...], list[str]] = {}
    for tenant, admins in admins_of.items():
        tenants_of.setdefault(tuple(admins), []).append(tenant)
    if tenants_of:
        raise _last_admins_refusal(
            "; ".join(
                f"{admins[0]} is the last admin of {', '.join(tenants)}"
                if len(admins) == 1
                else f"{' and '.join(admins)} are the last admins of {', '.join(tenants)}"
                for admins, tenants in tenants_of.items()
            )
        )


def _membership_change_check(*, membership: Membership) -> Membership | None:
    """A membership changed to another role, person or tenant leaves its tenant's admins as
    `tenant_admin_kept_check` allows: the tenant stays administered through the change when the
    membership stays an admin one of it, held by an active person (the same or another one).
    Returns the membership as it was saved when the change gives it to another person or
    tenant, whose former holder may have no role left there.

    The row of the person it is given to is locked before the tenant's, in the order
    `tenant_admins_kept_check` takes them: that person deactivated or deleted at the same time
    is either seen inactive here, or seen there as the tenant's admin they have become."""
    if membership._state.adding:
        return None
    holder_is_active = (
        get_user_model()
        ._default_manager.select_for_update(no_key=True)
        .filter(pk=membership.user_id, is_active=True)
        .exists()
    )
    saved = Membership.objects.select_related("user", "tenant").filter(pk=membership.pk).first()
    if saved is None:
        return None
    Tenant.objects.select_for_update().get(pk=saved.tenant_id)
    still_administers = (
        holder_is_active
        and membership.role in ADMIN_ROLES
        and membership.tenant_id == saved.tenant_id
    )
    if not still_administers:
        tenant_admin_kept_check(leaving=saved)
    moved = (membership.user_id, membership.tenant_id) != (saved.user_id, saved.tenant_id)
    return saved if moved else None


def api_tokens_revoke(*, tokens: QuerySet[ApiToken]) -> int:
    """Revoke tokens at once; a revoked token authenticates nothing. Returns how many."""
    return tokens.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())


def api_tokens_revoke_unless_member(*, user_id: int, tenant_id: int) -> int:
    """A person left with no role in a tenant (a membership removed, or given to another
    person or tenant) loses their API tokens for it, which would otherwise still authenticate
    them there; one who keeps another role keeps them. Run in the transaction that took the
    role away. Returns how many were revoked."""
    if Membership.objects.filter(user_id=user_id, tenant_id=tenant_id).exists():
        return 0
    return api_tokens_revoke(tokens=ApiToken.objects.filter(user_id=user_id, tenant_id=tenant_id))


def _grant_group_rename(tenant: Tenant) -> None:
    """A renamed tenant's grant group takes the new slug's name, the one platform admins grant
    to, and leaves the old one to a new tenant."""
    name = grant_group_name(tenant.slug)
    try:
        with transaction.atomic():
            Group.objects.filter(pk=tenant.grant_group_id).exclude(name=name).update(name=name)
    except IntegrityError:
        raise grant_group_taken(tenant.slug) from None


def grant_group_name(slug: str) -> str:
    return f"tenant:{slug}"


def grant_group_taken(slug: str) -> ValidationFailed:
    group_name = grant_group_name(slug)
    holder = Tenant.objects.filter(grant_group__name=group_name).first()
    if holder is not None:
        reason = (
            f"The group {group_name} is the grant group of the tenant {holder.slug}, "
            f"once named {slug}."
        )
    else:
        reason = (
            f"The group {group_name} exists already, left by a deleted tenant or made by hand, "
            "with its grants. Delete it first, or choose another slug."
        )
    return ValidationFailed("The submitted values are not valid.", details={"slug": [reason]})


def agent_skills_check(*, agent_config: AgentConfig, skills: QuerySet[Skill]) -> None:
    """An agent is bound to skills of its tenant, and to platform-wide ones granted to it: a
    run leaves out any other as not available."""
    refused = []
    for skill in skills.select_related("tenant").order_by("tenant__slug", "namespace", "name"):
        if tenant_has_grant(tenant=agent_config.tenant, definition=skill):
            continue
        if skill.tenant_id is None:
            refused.append(f"{skill} is not granted to {agent_config.tenant.slug}.")
        else:
            refused.append(f"{skill} belongs to another tenant.")
    if refused:
        raise ValidationFailed("The submitted values are not valid.", details={"skills": refused})


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
