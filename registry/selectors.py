"""Reads of the control plane with tenant scope and permissions applied in one place.

A definition is visible in a tenant when the tenant owns it, or when it is platform-wide and
the tenant's group holds the `use_*` grant on it. Anything else is "not found".
"""

import difflib
import functools
import hashlib
import json
import operator
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import semver
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.contrib.postgres.search import SearchQuery, SearchRank, SearchVector
from django.db import connection
from django.db.models import (
    Exists,
    F,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    prefetch_related_objects,
)
from django.db.models.expressions import RawSQL
from guardian.shortcuts import get_objects_for_group, get_objects_for_user

from config.queries import PreparedQuery
from registry.choices import (
    FROZEN_STATUSES,
    LISTED_STATUSES,
    ROLE_ACTIONS,
    Action,
    AdapterKind,
    SkillAssembly,
    VersionStatus,
)
from registry.errors import NotFound, ValidationFailed
from registry.generation import generation_sql, registry_cached
from registry.models import (
    AgentConfig,
    McpRemoteTool,
    McpServer,
    Membership,
    RolloutFlag,
    Skill,
    SkillVersion,
    Tenant,
    Tool,
    ToolVersion,
)
from registry.models.definitions import Definition
from registry.models.versions import DefinitionVersion
from registry.search import search_terms
from runs.workflows import WORKFLOWS, skill_reference_name

User = AbstractBaseUser | AnonymousUser
V = TypeVar("V", bound=DefinitionVersion)

ROLLOUT_BUCKETS = 10_000
FROZEN_VERSIONS_KEPT = 1024


_ROLES = PreparedQuery(
    lambda user_id, tenant_id: (
        Membership.objects.filter(user_id=user_id, tenant_id=tenant_id)
        .order_by()
        .annotate(generation=generation_sql())
        .values_list("role", "generation")
    ),
    user_id=int,
    tenant_id=int,
)


def user_roles_and_generation(*, user: User, tenant: Tenant) -> tuple[frozenset[str], int | None]:
    """The user's roles and the registry's generation (`registry.generation`), in one
    statement; the generation is None where there is none (another database than
    PostgreSQL, no registry change committed since the tables were emptied, a transaction
    that changed the registry itself) and for a user with no role in the tenant."""
    if not user.is_authenticated:
        return frozenset(), None
    rows = _ROLES(user_id=user.pk, tenant_id=tenant.pk)
    return frozenset(role for role, _ in rows), rows[0][1] if rows else None


def user_roles(*, user: User, tenant: Tenant) -> frozenset[str]:
    return user_roles_and_generation(user=user, tenant=tenant)[0]


def user_can(
    *,
    user: User,
    action: Action | str,
    tenant: Tenant,
    roles: frozenset[str] | None = None,
) -> bool:
    """May `user` do `action` in `tenant`? Platform admins (superusers) may do anything.
    `roles`, when the caller already read them with `user_roles`, saves the query."""
    if not user.is_authenticated or not user.is_active or not tenant.is_active:
        return False
    if user.is_superuser:
        return True
    if roles is None:
        roles = user_roles(user=user, tenant=tenant)
    return any(action in ROLE_ACTIONS[role] for role in roles)


def user_tenants(*, user: User) -> QuerySet[Tenant]:
    if not user.is_authenticated:
        return Tenant.objects.none()
    if user.is_superuser:
        return Tenant.objects.filter(is_active=True)
    return Tenant.objects.filter(is_active=True, memberships__user=user).distinct()


def tenants_where_user_can(*, user: User, action: Action | str) -> QuerySet[Tenant]:
    if not user.is_authenticated:
        return Tenant.objects.none()
    if user.is_superuser:
        return Tenant.objects.filter(is_active=True)
    roles = [role for role, actions in ROLE_ACTIONS.items() if action in actions]
    return Tenant.objects.filter(
        is_active=True, memberships__user=user, memberships__role__in=roles
    ).distinct()


def _use_permission(model: type[Definition]) -> str:
    return f"registry.use_{model._meta.model_name}"


def _publish_permission(model: type[Definition]) -> str:
    return f"registry.publish_{model._meta.model_name}"


def definitions_visible(*, model: type[Definition], tenant: Tenant) -> QuerySet:
    """Tools or skills a tenant may see and use: its own, and platform-wide ones granted to it."""
    owner = tenant.registry_owner
    granted = get_objects_for_group(
        owner.grant_group, _use_permission(model), klass=model, accept_global_perms=False
    )
    return model.objects.filter(
        Q(tenant=owner) | Q(tenant__isnull=True, pk__in=granted.values("pk"))
    )


def tenant_has_grant(*, tenant: Tenant, definition: Definition) -> bool:
    if definition.tenant_id is not None:
        return definition.tenant_id == tenant.registry_owner.pk
    return (
        definitions_visible(model=type(definition), tenant=tenant).filter(pk=definition.pk).exists()
    )


def _versions_visible(
    *, version_model: type[DefinitionVersion], user: User, tenant: Tenant
) -> QuerySet:
    if not user_can(user=user, action=Action.REGISTRY_VIEW, tenant=tenant):
        return version_model.objects.none()
    parent = version_model._meta.get_field(version_model.parent_field).related_model
    versions = version_model.objects.filter(
        **{f"{version_model.parent_field}__in": definitions_visible(model=parent, tenant=tenant)}
    ).select_related(version_model.parent_field, f"{version_model.parent_field}__tenant")
    if not user_can(user=user, action=Action.REGISTRY_VIEW_UNPUBLISHED, tenant=tenant):
        versions = versions.filter(status__in=LISTED_STATUSES)
    elif not user.is_superuser:
        # A platform-wide definition's drafts are the work of those who may publish it, never
        # released to the tenant as its other versions were.
        publishable = get_objects_for_user(
            user, _publish_permission(parent), klass=parent, accept_global_perms=False
        )
        versions = versions.exclude(
            Q(status=VersionStatus.DRAFT, **{f"{version_model.parent_field}__tenant__isnull": True})
            & ~Q(**{f"{version_model.parent_field}__in": publishable.values("pk")})
        )
    return versions.select_related("published_by")


def tool_versions_visible(*, user: User, tenant: Tenant) -> QuerySet[ToolVersion]:
    return _versions_visible(version_model=ToolVersion, user=user, tenant=tenant)


def skill_versions_visible(*, user: User, tenant: Tenant) -> QuerySet[SkillVersion]:
    return _versions_visible(version_model=SkillVersion, user=user, tenant=tenant).prefetch_related(
        "tool_dependencies__tool_version__tool"
    )


def user_may_publish(*, user: User, definition: Definition, tenant: Tenant | None = None) -> bool:
    """Publishers of the owner tenant may manage its definitions; a platform-wide definition
    needs a platform admin or an object grant (django-guardian) of `publish_*` on it."""
    if not user.is_authenticated or not user.is_active:
        return False
    if definition.is_platform_wide:
        return user.is_superuser or user.has_perm(_publish_permission(type(definition)), definition)
    if tenant is not None and tenant.pk != definition.tenant_id:
        return False
    return user_can(user=user, action=Action.REGISTRY_PUBLISH, tenant=definition.tenant)


def rollout_bucket(*, key: str, actor_id: str) -> int:
    """A stable bucket in [0, 10000) for an actor under a flag; no state, no randomness."""
    digest = hashlib.sha256(f"{key}:{actor_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % ROLLOUT_BUCKETS


def rollout_serves(*, flag: RolloutFlag, tenant: Tenant, actor_id: str) -> bool:
    if not flag.is_active:
        return False
    eligible_tenants = {t.pk for t in flag.tenants.all()}
    if eligible_tenants and tenant.registry_owner.pk not in eligible_tenants:
        return False
    return rollout_bucket(key=flag.key, actor_id=actor_id) < flag.percentage * (
        ROLLOUT_BUCKETS // 100
    )


_ROLLOUT_FLAGS = PreparedQuery(
    lambda skill_id: (
        RolloutFlag.objects.filter(
            skill_id=skill_id, is_active=True, skill_version__status=VersionStatus.PUBLISHED
        )
        .select_related("skill_version")
        .order_by("key")
    ),
    skill_id=uuid.UUID,
)


def skill_version_for_actor(*, skill: Skill, tenant: Tenant, actor_id: str) -> SkillVersion | None:
    """The version of `skill` this actor gets: a sandbox's, a rollout's if one serves them,
    else the current one."""
    if tenant.sandbox_skill_version_id:
        pinned = tenant.sandbox_skill_version
        if pinned.skill_id == skill.pk:
            return pinned
    flags = _ROLLOUT_FLAGS(skill_id=skill.pk)
    prefetch_related_objects(flags, "tenants")
    for flag in flags:
        if rollout_serves(flag=flag, tenant=tenant, actor_id=actor_id):
            return flag.skill_version
    current = skill.current_version
    # The lifecycle keeps the current version published; a stale write of the skill's row (an
    # admin form saved as a revoke committed) must not serve a version retired meanwhile.
    return current if current is not None and current.status == VersionStatus.PUBLISHED else None


_frozen_versions: OrderedDict[tuple[str, str], DefinitionVersion] = OrderedDict()
_frozen_versions_lock = threading.Lock()


def versions_frozen(*, model: type[V], ids: Iterable[str]) -> dict[str, V]:
    """Released (published, deprecated or revoked) versions by id, with their definition.

    Their content is frozen (the model layer refuses any change), so each process keeps the
    copies it has read and reads a version once. Only the lifecycle fields of a copy may be
    out of date: a gate that depends on them (revocation) reads them with
    `version_ids_withdrawn`. The copies are shared: callers must not change them."""
    label = model._meta.label
    found: dict[str, V] = {}
    with _frozen_versions_lock:
        for version_id in map(str, ids):
            version = _frozen_versions.get((label, version_id))
            if version is not None:
                found[version_id] = version
    missing = [version_id for version_id in map(str, ids) if version_id not in found]
    if not missing:
        return found
    loaded = model.objects.filter(pk__in=missing, status__in=FROZEN_STATUSES).select_related(
        model.parent_field
    )
    with _frozen_versions_lock:
        for version in loaded:
            found[str(version.pk)] = version
            _frozen_versions[(label, str(version.pk))] = version
        while len(_frozen_versions) > FROZEN_VERSIONS_KEPT:
            _frozen_versions.popitem(last=False)
    return found


@functools.cache
def _versions_revoked(model: type[DefinitionVersion]) -> PreparedQuery:
    """On PostgreSQL the ids travel as one array, so the SQL is the same for any number."""
    return PreparedQuery(
        lambda version_ids: (
            model.objects.filter(
                pk__in=RawSQL("SELECT unnest(%s::uuid[])", [version_ids])
                if connection.vendor == "postgresql"
                else version_ids,
                status=VersionStatus.REVOKED,
            )
            .order_by()
            .values_list("pk", flat=True)
        ),
        version_ids=list,
    )


def version_ids_withdrawn(
    *,
    model: type[DefinitionVersion],
    ids: Iterable[str],
    tenant: Tenant,
    generation: int | None = None,
) -> frozenset[str]:
    """Which of these versions `tenant` may no longer use: revoked, or of a platform-wide
    definition no longer granted to it. Under a registry `generation` the caller read in its
    own transaction, the answer is kept until the generation moves (a revocation or a grant
    moves it when it commits); without one, it is read now."""
    version_ids = sorted(map(str, ids))
    parent_field = model.parent_field
    parent = model._meta.get_field(parent_field).related_model

    def withdrawn() -> frozenset[str]:
        revoked = {str(pk) for pk in _versions_revoked(model)(version_ids=version_ids)}
        platform_wide = set(
            model.objects.filter(pk__in=version_ids, **{f"{parent_field}__tenant__isnull": True})
            .values_list(parent_field, "pk")
            .order_by()
        )
        if not platform_wide:
            return frozenset(revoked)
        granted = set(
            definitions_visible(model=parent, tenant=tenant)
            .filter(pk__in={definition for definition, _ in platform_wide})
            .values_list("pk", flat=True)
        )
        ungranted = {str(pk) for definition, pk in platform_wide if definition not in granted}
        return frozenset(revoked | ungranted)

    key = ("withdrawn", model._meta.label, tenant.pk, *version_ids)
    return registry_cached(generation, key, withdrawn)


def version_ids_by_precedence(versions: QuerySet[DefinitionVersion]) -> list[uuid.UUID]:
    """The ids of `versions` by the name of their tool or skill, then by semver precedence,
    highest first (1.10.0 before 1.9.0, a release before its pre-releases), then newest
    created, then by id, so that no version is on two pages. Precedence is no order of the
    stored text, so the few fields it needs are read and sorted here; a page of rows is then
    read by id."""
    rows = list(
        versions.order_by().values_list(
            "pk", f"{versions.model.parent_field}__name", "version", "created_at"
        )
    )
    # Stable sorts, the last key first.
    rows.sort(key=lambda row: row[0])
    rows.sort(key=lambda row: row[3], reverse=True)
    rows.sort(key=lambda row: semver.Version.parse(row[2]), reverse=True)
    rows.sort(key=lambda row: row[1])
    return [row[0] for row in rows]


@dataclass(frozen=True)
class FieldDiff:
    field: str
    old: str
    new: str
    lines: list[str]


def _render(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return "" if value is None else str(value)


def version_content(version: DefinitionVersion) -> dict[str, Any]:
    content = {
        field.name: getattr(version, field.name)
        for field in version._meta.concrete_fields
        if field.name not in {"id", "created_at", "created_by", version.parent_field}
    }
    if isinstance(version, SkillVersion):
        content["tool_dependencies"] = sorted(
            str(dependency.tool_version) for dependency in version.tool_dependencies.all()
        )
    return content


def version_diff(old: DefinitionVersion, new: DefinitionVersion) -> list[FieldDiff]:
    """The fields that differ between two versions of one tool or skill, as unified diffs."""
    old_content, new_content = version_content(old), version_content(new)
    diffs = []
    for field, old_value in old_content.items():
        old_text, new_text = _render(old_value), _render(new_content[field])
        if old_text == new_text:
            continue
        lines = list(
            difflib.unified_diff(
                old_text.splitlines(),
                new_text.splitlines(),
                fromfile=str(old),
                tofile=str(new),
                lineterm="",
            )
        )
        diffs.append(FieldDiff(field=field, old=old_text, new=new_text, lines=lines))
    return diffs


# Of two definitions of one name a tenant may use, its own before the platform's, then by
# namespace: the one a workflow node loads, an agent bound to both is routed to, or a tie in
# recall goes to.
OWN_BEFORE_PLATFORM = (F("tenant_id").asc(nulls_last=True), "namespace")


def _version_matches(version: semver.Version, wanted: str) -> bool:
    """Whether `version` is what `wanted` names: a whole version is the one of its precedence
    (its build metadata, when given, too), `2` or `2.1` any release of that major or minor.
    A pre-release is never in a range (semver's rule, as npm and pip apply it): published to
    be tried, it is pinned only by naming it whole."""
    if semver.Version.is_valid(wanted):
        named = semver.Version.parse(wanted)
        return version.compare(named) == 0 and named.build in (None, version.build)
    if version.prerelease is not None:
        return False
    prefix = [int(part) for part in wanted.split(".") if part]
    return list(version.to_tuple()[: len(prefix)]) == prefix


def tool_version_resolve(*, tenant: Tenant | None, reference: str) -> ToolVersion:
    """The highest published version matching `name@2`, `name@2.1` or `name@2.1.0` of the one
    tool of that name `tenant` may use (platform-wide only, when `tenant` is None): its own
    before the platform's. A tenant's tool with a published version shadows the platform's of
    the same name: a run knows its tools by name (two pins of one name conflict), so a skill
    never pins the one the tenant's hides. A tool with drafts only hides nothing: no run can
    have it. Of one owner's tools of that name in several namespaces, the pin names one
    (`beta/name@2`); one that does not is refused, naming them, rather than given either."""
    qualified, _, wanted = reference.partition("@")
    namespace, _, name = qualified.rpartition("/")
    tools = (
        definitions_visible(model=Tool, tenant=tenant)
        if tenant is not None
        else Tool.objects.filter(tenant__isnull=True)
    )
    if namespace:
        tools = tools.filter(namespace=namespace)
    published = ToolVersion.objects.filter(tool=OuterRef("pk"), status=VersionStatus.PUBLISHED)
    named = list(
        tools.filter(Exists(published), name=name)
        .select_related("tenant")
        .order_by(*OWN_BEFORE_PLATFORM)
    )
    if not named:
        raise NotFound(
            f"No published tool version matches '{reference}'.", details={"reference": reference}
        )
    tool = named[0]
    alike = [other for other in named if other.tenant_id == tool.tenant_id]
    if len(alike) > 1:
        raise ValidationFailed(
            f"'{reference}' names tools of several namespaces: "
            f"{', '.join(map(str, alike))}; pin one as namespace/name@version.",
            details={"reference": reference, "candidates": [str(other) for other in alike]},
        )
    candidates = [
        version
        for version in tool.versions.filter(status=VersionStatus.PUBLISHED).select_related("tool")
        if _version_matches(version.semver, wanted)
    ]
    if not candidates:
        raise NotFound(
            f"No published version of {tool} matches '{reference}'.",
            details={"reference": reference},
        )
    return max(candidates, key=lambda version: version.semver)


def mcp_server_of(tool_version: ToolVersion) -> McpServer | None:
    """The server an MCP tool version calls: the one of its name owned by the tool's owner."""
    if tool_version.adapter_kind != AdapterKind.MCP:
        return None
    return McpServer.objects.filter(
        tenant_id=tool_version.tool.tenant_id, name=tool_version.adapter_config.get("server")
    ).first()


def mcp_server_callers(server: McpServer) -> QuerySet[ToolVersion]:
    """The published and deprecated tool versions that call `server` (`mcp_server_of`)."""
    return McpServer.versions_calling(tenant_id=server.tenant_id, name=server.name)


def mcp_server_usable(*, server: McpServer | None, tenant: Tenant) -> bool:
    """Enabled, and owned by the tenant or platform-wide and granted to it. An evaluation
    sandbox uses its parent's registry (`Tenant.registry_owner`), so it may use the servers
    its parent may, and no other."""
    if server is None or not server.is_enabled:
        return False
    owner = tenant.registry_owner
    if server.tenant_id is not None:
        return server.tenant_id == owner.pk
    return server.granted_tenants.filter(pk=owner.pk).exists()


def mcp_drift(tool_versions: Iterable[ToolVersion]) -> dict[str, str]:
    """Why MCP tool versions no longer match what their servers serve, by version id:
    `DEFINITION_CHANGED`, `REMOVED`, or `LISTED_AMBIGUOUSLY` (the server lists the name more
    than once with different definitions). Versions that match, or are not MCP tools, are
    absent.
    One query whatever the number of versions."""
    versions = [v for v in tool_versions if v.adapter_kind == AdapterKind.MCP]
    if not versions:
        return {}
    remote = {
        (tool.server.tenant_id, tool.server.name, tool.remote_name): tool
        for tool in McpRemoteTool.objects.filter(
            server__name__in={v.adapter_config.get("server") for v in versions}
        ).select_related("server", "current")
    }
    drift = {}
    for version in versions:
        config = version.adapter_config
        found = remote.get(
            (version.tool.tenant_id, config.get("server"), config.get("remote_name"))
        )
        if found is not None and found.is_listed_ambiguously:
            drift[str(version.pk)] = "LISTED_AMBIGUOUSLY"
        elif found is None or found.removed_at is not None:
            drift[str(version.pk)] = "REMOVED"
        elif found.current.definition_hash != config.get("definition_hash"):
            drift[str(version.pk)] = "DEFINITION_CHANGED"
    return drift


# ts_rank of one matching term in a vector of weight A (6/π²); the fallback scores alike.
SINGLE_MATCH_RANK = 0.6079271
SEARCH_FIELD_WEIGHTS = (
    ("search_triggers", "A", 1.0),
    ("search_description", "B", 0.4),
    ("search_examples", "C", 0.2),
)


@dataclass(frozen=True)
class Recalled:
    skill: Skill
    score: float


def _recall_order(recalled: Recalled) -> tuple:
    """Best first; of one score and name, the tenant's own before the platform's (a tenant's
    copy of a granted skill), then by namespace, so that no tie is left to the database."""
    skill = recalled.skill
    return (-recalled.score, skill.name, skill.tenant_id is None, skill.namespace)


def skills_recallable(*, tenant: Tenant) -> QuerySet[Skill]:
    """The skills a request to an agent of `tenant` that recalls its skills may be routed to:
    those the tenant may use whose current version is published."""
    return definitions_visible(model=Skill, tenant=tenant).filter(
        current_version__status=VersionStatus.PUBLISHED
    )


def skill_under_test(*, tenant: Tenant) -> Skill | None:
    """In an evaluation sandbox, the skill whose version is under test. It stands there for
    every skill of its name, the tenant's own or the platform's, whether a request recalls
    one or a workflow node loads one by name: an eval run measures the version under test
    and counts for it alone."""
    version = tenant.sandbox_skill_version
    return version.skill if version is not None else None


def skill_candidates_loaded(*, tenant: Tenant, references: Iterable[str]) -> dict[str, list[Skill]]:
    """The skills each reference (`name` or `namespace/name`) of a workflow node may load in
    `tenant`: of skills of that name in several owners, the tenant's own before the
    platform's, as tool pins and recall prefer them; of one owner's in several namespaces,
    each, for a reference that names none is ambiguous and loads none of them. A skill with
    drafts only (no current version) hides nothing: no run can have it. In an evaluation
    sandbox, the skill under test for its name (`skill_under_test`), drafts only or not."""
    references = set(references)
    under_test = skill_under_test(tenant=tenant)
    named = list(
        definitions_visible(model=Skill, tenant=tenant)
        .filter(
            name__in={skill_reference_name(reference) for reference in references},
            current_version__isnull=False,
        )
        .select_related("tenant", "current_version")
        .order_by(*OWN_BEFORE_PLATFORM)
    )
    found: dict[str, list[Skill]] = {}
    for reference in references:
        namespace, _, name = reference.rpartition("/")
        if under_test is not None and under_test.name == name:
            found[reference] = [under_test]
            continue
        matching = [
            skill for skill in named if skill.name == name and namespace in ("", skill.namespace)
        ]
        if matching:
            found[reference] = [
                skill for skill in matching if skill.tenant_id == matching[0].tenant_id
            ]
    return found


def skills_loaded_by_name(*, tenant: Tenant, names: Iterable[str]) -> dict[str, Skill]:
    """The skill each reference of a workflow node loads in `tenant`, of those that name
    exactly one (`skill_candidates_loaded`)."""
    return {
        reference: candidates[0]
        for reference, candidates in skill_candidates_loaded(
            tenant=tenant, references=names
        ).items()
        if len(candidates) == 1
    }


def _references_loaded(skills: Iterable[Skill]) -> set[str]:
    """The references of the skills the nodes of these skills' current versions' workflows
    load."""
    return {
        reference
        for skill in skills
        if skill.current_version is not None
        and (workflow := WORKFLOWS.get(skill.current_version.workflow)) is not None
        for reference in workflow.skills_loaded
    }


def agent_skills_reachable(
    *, agent_config: AgentConfig, bound_skills: QuerySet[Skill] | None = None
) -> list[Skill]:
    """The skills the agent's runs may use: those they may be routed to (bound to it, static
    assembly; or every skill a request may recall, retrieval: its bound skills are not used),
    then those the nodes of their current versions' workflows load by name. `bound_skills`:
    the skills it is bound to by a change not saved yet, instead of those it has."""
    if agent_config.skill_assembly == SkillAssembly.RETRIEVAL:
        routed = skills_recallable(tenant=agent_config.tenant)
    elif bound_skills is not None:
        routed = bound_skills
    else:
        routed = agent_config.skills.all()
    reachable = list(routed.select_related("current_version"))
    names = {skill.name for skill in reachable}
    loaded = {
        reference
        for reference in _references_loaded(reachable)
        if skill_reference_name(reference) not in names
    }
    if loaded:
        found = skills_loaded_by_name(tenant=agent_config.tenant, names=loaded)
        reachable += list(dict.fromkeys(found[reference] for reference in sorted(found)))
    return reachable


def agents_given(*, skill: Skill) -> list[AgentConfig]:
    """The active agents whose runs may be given a version of `skill` once it is current: in
    each active tenant that may use it (an eval run's sandbox aside), every agent that recalls
    its skills, and each other one that reaches it (`agent_skills_reachable`). A publish asks
    this of every agent, so their bound skills are read at once, and whether a tenant may use
    the skill, and which skill of its name a workflow node loads there, once per tenant."""
    agents = (
        AgentConfig.objects.filter(
            is_active=True, tenant__is_active=True, tenant__sandbox_of__isnull=True
        )
        .select_related("tenant", "model_config")
        .prefetch_related(
            Prefetch("skills", queryset=Skill.objects.select_related("current_version"))
        )
    )
    if skill.tenant_id is not None:
        agents = agents.filter(tenant_id=skill.tenant_id)
    granted: dict[int, bool] = {}
    loaded_by_name: dict[tuple[int, frozenset[str]], bool] = {}

    def given(agent: AgentConfig) -> bool:
        tenant = agent.tenant
        if tenant.pk not in granted:
            granted[tenant.pk] = tenant_has_grant(tenant=tenant, definition=skill)
        if not granted[tenant.pk]:
            return False
        if agent.skill_assembly == SkillAssembly.RETRIEVAL:
            return True
        # As `agent_skills_reachable` finds them: its bound skills, then those of the names
        # their workflows load that none of them has.
        bound = list(agent.skills.all())
        if skill in bound:
            return True
        references = frozenset(
            reference
            for reference in _references_loaded(bound)
            if skill_reference_name(reference) == skill.name
        )
        if skill.name in {other.name for other in bound} or not references:
            return False
        key = (tenant.pk, references)
        if key not in loaded_by_name:
            found = skills_loaded_by_name(tenant=tenant, names=references)
            loaded_by_name[key] = skill in found.values()
        return loaded_by_name[key]

    return [agent for agent in agents.order_by("tenant__slug", "name") if given(agent)]


def skill_versions_served(*, skills: Iterable[Skill], tenant: Tenant) -> list[SkillVersion]:
    """The versions of `skills` a run in `tenant` may be given: each one's current version,
    then those an active rollout serves to a share of the tenant's actors (`rollout_serves`)."""
    skills = list(skills)
    served = {
        skill.current_version_id: skill.current_version
        for skill in skills
        if skill.current_version is not None
    }
    flags = (
        RolloutFlag.objects.filter(
            Q(tenants=None) | Q(tenants=tenant.registry_owner),
            skill__in=skills,
            is_active=True,
            percentage__gt=0,
            skill_version__status=VersionStatus.PUBLISHED,
        )
        .select_related("skill_version__skill")
        .order_by("key")
        .distinct()
    )
    for flag in flags:
        served.setdefault(flag.skill_version_id, flag.skill_version)
    return list(served.values())


def skills_recall(*, tenant: Tenant, text: str, limit: int = 5) -> list[Recalled]:
    """Published skills the tenant may use, ranked by how well their triggers (weight A),
    description (B) and examples (C) match the request: PostgreSQL full-text search, or a
    plain term match on other databases. The score is the mean over the request's terms of
    the weight of the best field matching it, scaled as PostgreSQL's `ts_rank` (one match in
    the triggers ≈ 0.61), so a request with many words no skill knows scores low."""
    terms = search_terms(text)
    if not terms:
        return []
    skills = skills_recallable(tenant=tenant)
    if connection.vendor == "postgresql":
        vector = functools.reduce(
            operator.add,
            (
                SearchVector(f"current_version__{field}", weight=weight, config="english")
                for field, weight, _ in SEARCH_FIELD_WEIGHTS
            ),
        )
        query = SearchQuery(
            " | ".join(f"'{term}'" for term in terms), search_type="raw", config="english"
        )
        ranked = (
            skills.annotate(score=SearchRank(vector, query))
            .filter(score__gt=0)
            .select_related("current_version")
            .order_by("-score", "name", *OWN_BEFORE_PLATFORM)[:limit]
        )
        return [Recalled(skill=skill, score=round(skill.score, 4)) for skill in ranked]
    scored = []
    for skill in skills.select_related("current_version"):
        fields = [
            (weight, set(getattr(skill.current_version, field).split()))
            for field, _, weight in SEARCH_FIELD_WEIGHTS
        ]
        matched = sum(
            max((weight for weight, words in fields if term in words), default=0.0)
            for term in terms
        )
        if matched:
            scored.append(
                Recalled(skill=skill, score=round(matched / len(terms) * SINGLE_MATCH_RANK, 4))
            )
    return sorted(scored, key=_recall_order)[:limit]
