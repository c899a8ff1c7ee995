from collections.abc import Callable, Sequence
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from evaluations.gates import (
    release_gate_check,
    release_gate_failures_given,
    release_override_record,
    skill_version_changed,
)
from registry.choices import CALLABLE_STATUSES, VersionStatus
from registry.errors import DependencyUnavailable, ValidationFailed
from registry.models import (
    AgentConfig,
    Skill,
    SkillToolDependency,
    SkillVersion,
    Tenant,
    ToolVersion,
)
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.schemas import raise_if_errors, skill_version_errors
from registry.selectors import agents_given, tenant_has_grant
from registry.services import lifecycle
from registry.services.common import audited_save, audited_unique_save, full_clean_or_raise


def skill_pins_check(tool_versions: Sequence[ToolVersion]) -> None:
    """A skill version pins one version of each tool, and one tool of each name: a run knows
    its tools by name (the model calls `project_search`, whatever its namespace), and of two
    pins of one name, which one a run got would be left to the order of the rows."""
    tool_ids = [tool_version.tool_id for tool_version in tool_versions]
    if len(set(tool_ids)) != len(tool_ids):
        raise ValidationFailed(
            "A skill version pins one version of each tool.",
            details={"tool_dependencies": ["The same tool is pinned twice."]},
        )
    names = [tool_version.tool.name for tool_version in tool_versions]
    shared = sorted({name for name in names if names.count(name) > 1})
    if shared:
        raise ValidationFailed(
            "A skill version pins one tool of each name: a run knows its tools by name.",
            details={
                "tool_dependencies": [
                    f"Tools of two namespaces are named {', '.join(shared)}; pin one of them."
                ]
            },
        )


def _pin_tools(
    *, skill_version: SkillVersion, tool_versions: Sequence[ToolVersion], actor: AbstractBaseUser
) -> None:
    skill_pins_check(tool_versions)
    skill_version.tool_dependencies.all().delete()
    for tool_version in tool_versions:
        audited_save(
            SkillToolDependency(skill_version=skill_version, tool_version=tool_version),
            actor=actor,
            reason="pinned",
        )


def skill_version_create(
    *,
    actor: AbstractBaseUser,
    tenant: Tenant | None,
    name: str,
    version: str,
    namespace: str = "core",
    tool_versions: Sequence[ToolVersion] = (),
    **content: Any,
) -> SkillVersion:
    """A new draft version of a skill, pinning exact tool versions."""
    with transaction.atomic():
        skill = lifecycle.definition_get_or_create(
            Skill, actor=actor, tenant=tenant, name=name, namespace=namespace
        )
        lifecycle.require_publisher(actor=actor, definition=skill)
        skill_version = SkillVersion(skill=skill, version=version, created_by=actor, **content)
        full_clean_or_raise(skill_version)
        _validate_content(skill_version)
        audited_unique_save(skill_version, actor=actor, reason="draft created")
        _pin_tools(skill_version=skill_version, tool_versions=tool_versions, actor=actor)
    return skill_version


def skill_version_update(
    *,
    skill_version: SkillVersion,
    actor: AbstractBaseUser,
    tool_versions: Sequence[ToolVersion] | None = None,
    **content: Any,
) -> SkillVersion:
    """Edit a draft. Published versions are frozen: a change is a new version."""
    lifecycle.require_publisher(actor=actor, definition=skill_version.skill)
    with transaction.atomic():
        lifecycle.draft_locked(skill_version)
        for field, value in content.items():
            setattr(skill_version, field, value)
        full_clean_or_raise(skill_version)
        _validate_content(skill_version)
        audited_save(skill_version, actor=actor, reason="draft edited")
        if tool_versions is not None:
            _pin_tools(skill_version=skill_version, tool_versions=tool_versions, actor=actor)
        skill_version_changed(skill_version=skill_version)
    return skill_version


def _validate_content(skill_version: SkillVersion) -> None:
    values = {field: getattr(skill_version, field) for field in SKILL_CONTENT_FIELDS}
    values["version"] = skill_version.version
    raise_if_errors(
        skill_version_errors(values),
        f"{skill_version.qualified_name} breaks the skill contract: see details.",
    )


def skill_version_validate(skill_version: SkillVersion) -> None:
    """Content contract, one version of each tool pinned, then every pinned tool version
    published and usable by the owner."""
    _validate_content(skill_version)
    _pins_usable_check(skill_version, statuses=frozenset({VersionStatus.PUBLISHED}))


def _pins_usable_check(skill_version: SkillVersion, *, statuses: frozenset[str]) -> None:
    """One version of each tool pinned, each of `statuses` and usable by the skill's owner.
    The pinned versions stay locked until the caller's transaction ends: a revocation waits."""
    skill = skill_version.skill
    dependencies = list(
        skill_version.tool_dependencies.select_related("tool_version__tool").select_for_update(
            of=("tool_version",)
        )
    )
    skill_pins_check([dependency.tool_version for dependency in dependencies])
    unavailable = {}
    for dependency in dependencies:
        tool_version = dependency.tool_version
        if tool_version.status not in statuses:
            unavailable[str(tool_version)] = (
                f"is {tool_version.status}, not {' or '.join(sorted(statuses))}"
            )
        elif skill.tenant is None and tool_version.tool.tenant_id is not None:
            unavailable[str(tool_version)] = "belongs to a tenant; a platform skill cannot pin it"
        elif skill.tenant is not None and not tenant_has_grant(
            tenant=skill.tenant, definition=tool_version.tool
        ):
            unavailable[str(tool_version)] = f"is not available to {skill.tenant}"
    if unavailable:
        raise DependencyUnavailable(
            f"{skill_version.qualified_name} pins tool versions that cannot be used: "
            + "; ".join(f"{name} {why}" for name, why in unavailable.items())
            + ".",
            details={"tool_dependencies": unavailable},
        )


def skill_version_publish(
    *, skill_version: SkillVersion, actor: AbstractBaseUser, override_reason: str = ""
) -> SkillVersion:
    """Publish a draft once its release gate (evaluations.gates) is met, or over it with a
    tenant or platform admin's written reason, recorded as a ReleaseOverride and in history.
    A version that is no longer a draft is answered by its status alone: one published is left
    as it is (a publish sent again), its gate checked when it was published and nothing
    published over it now; a deprecated or revoked one cannot be published again."""
    lifecycle.require_publisher(actor=actor, definition=skill_version.skill)
    with transaction.atomic():
        # The draft is held as its evidence was checked until it is published: an edit sent
        # meanwhile waits, then finds it frozen.
        _, skill_version = lifecycle.lock_version(skill_version)
        if skill_version.status != VersionStatus.DRAFT:
            return lifecycle.version_publish(
                version=skill_version, actor=actor, validate=skill_version_validate
            )
        overridden = release_gate_check(
            skill_version=skill_version, actor=actor, override_reason=override_reason
        )
        reason = "published"
        if overridden:
            reason = f"published over its release gate: {override_reason.strip()}"
        version = lifecycle.version_publish(
            version=skill_version, actor=actor, validate=skill_version_validate, reason=reason
        )
        if overridden:
            release_override_record(
                skill_version=version, actor=actor, reason=override_reason, failures=overridden
            )
    return version


def _current_in_its_place(skill: Skill) -> Callable[[SkillVersion], str]:
    """Why an earlier version may not become current when the current one is retired: that
    would roll back to it, and a rollback needs the tool versions it pins usable and is held
    to its release gate with the model of each agent it would be given to (`skill_rollback`);
    a retirement has no reason to give for an override. The agents are found once, for every
    version asked about."""
    agents: list[AgentConfig] | None = None

    def refused(skill_version: SkillVersion) -> str:
        nonlocal agents
        try:
            _pins_usable_check(skill_version, statuses=CALLABLE_STATUSES)
        except DependencyUnavailable as error:
            unusable = "; ".join(
                f"{name} {why}" for name, why in error.details["tool_dependencies"].items()
            )
            return f"it pins tool versions that cannot be used ({unusable})"
        if agents is None:
            agents = agents_given(skill=skill)
        if release_gate_failures_given(skill_version=skill_version, agents=agents):
            return "it does not meet its release gate with the models of its agents"
        return ""

    return refused


def skill_version_deprecate(
    *, skill_version: SkillVersion, actor: AbstractBaseUser, reason: str = ""
) -> SkillVersion:
    """Deprecate a version; when it was current, the highest earlier published version that
    meets its release gate with its agents' models becomes current, or none."""
    return lifecycle.version_deprecate(
        version=skill_version,
        actor=actor,
        reason=reason,
        refused=_current_in_its_place(skill_version.skill),
    )


def skill_version_revoke(
    *, skill_version: SkillVersion, actor: AbstractBaseUser, reason: str = ""
) -> SkillVersion:
    """Revoke a version; when it was current, the highest earlier published version that
    meets its release gate with its agents' models becomes current, or none."""
    return lifecycle.version_revoke(
        version=skill_version,
        actor=actor,
        reason=reason,
        refused=_current_in_its_place(skill_version.skill),
    )


def skill_rollback(
    *, skill_version: SkillVersion, actor: AbstractBaseUser, override_reason: str = ""
) -> SkillVersion:
    """Make an earlier published version current again, while the tool versions it pins may
    still serve it (published or deprecated, and usable by the owner): made current on a
    revoked pin, it would be a skill its runs cannot have whole. Its release gate is held as
    a publish holds it, with the model of each agent it would be given to: an agent may have
    moved to another model since it was published, a move that checked only the versions
    served then. A tenant or platform admin may roll back over the gate with a written reason,
    recorded as a ReleaseOverride and in history. A version already current, or not published,
    is answered as the lifecycle answers it, with no gate."""
    lifecycle.require_publisher(actor=actor, definition=skill_version.skill)
    with transaction.atomic():
        # The skill is held as the gate was checked until the version is current: an agent's
        # move, checked against the version current then, waits and finds this one.
        skill, skill_version = lifecycle.lock_version(skill_version)
        overridden = []
        if (
            skill_version.status == VersionStatus.PUBLISHED
            and skill.current_version_id != skill_version.pk
        ):
            overridden = release_gate_check(
                skill_version=skill_version, actor=actor, override_reason=override_reason
            )
        reason = ""
        if overridden:
            reason = (
                f"rolled back to {skill_version.version} over its release gate: "
                f"{override_reason.strip()}"
            )
        version = lifecycle.version_rollback(
            version=skill_version,
            actor=actor,
            validate=lambda version: _pins_usable_check(version, statuses=CALLABLE_STATUSES),
            reason=reason,
        )
        if overridden:
            release_override_record(
                skill_version=version, actor=actor, reason=override_reason, failures=overridden
            )
    return version
