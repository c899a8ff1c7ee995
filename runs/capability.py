"""The capability snapshot: what one run may use at most, resolved once when the run starts.

It is computed from the actor's roles, the tenant's grants, the agent's skills (bound to it
statically, or recalled from the registry for the request and kept when they score above the
agent's threshold and all their tools are usable; in either case the version a rollout serves
this actor, else the current one), the skills the nodes of the routed skill's workflow load,
their pinned tool versions and the policy. In an evaluation sandbox, the skill under test, at
the version under test, takes the place of every other skill of its name. A skill's entry
names its workflow by key and by the hash of its definition (`Workflow.definition_hash`). What is
unpublished, revoked, not granted to the tenant or above the policy's data classification
never enters it, whatever the message says; nor does an MCP tool whose server is not
available to the tenant or no longer serves the reviewed definition. The snapshot is
canonical JSON (RFC 8785) and its sha256 is the run's `capability_hash`.
"""

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from config.queries import PreparedQuery
from registry.canonical import canonical_hash
from registry.choices import (
    CALLABLE_STATUSES,
    DATA_CLASSIFICATION_LEVELS,
    AdapterKind,
    ModelProvider,
    SkillAssembly,
)
from registry.generation import registry_cached
from registry.models import (
    AgentConfig,
    Skill,
    SkillToolDependency,
    SkillVersion,
    Tenant,
    ToolVersion,
)
from registry.selectors import (
    OWN_BEFORE_PLATFORM,
    mcp_drift,
    mcp_server_of,
    mcp_server_usable,
    skill_candidates_loaded,
    skill_under_test,
    skill_version_for_actor,
    skills_recall,
    tenant_has_grant,
    user_roles,
)
from runs.tools.limits import circuit_state
from runs.workflows import WORKFLOWS, skill_reference_name

SNAPSHOT_SCHEMA = 1


@functools.lru_cache(maxsize=4096)
def _input_schema_hash(tool_version: ToolVersion) -> str:
    """Per version id (a model instance hashes by its pk): a version that may enter a
    snapshot is published or deprecated, so its input schema is frozen."""
    return canonical_hash(tool_version.input_schema)


_PINNED = PreparedQuery(
    lambda skill_version_id: SkillToolDependency.objects.filter(
        skill_version_id=skill_version_id
    ).select_related("tool_version__tool"),
    skill_version_id=uuid.UUID,
)
_BOUND_SKILLS = PreparedQuery(
    lambda agent_config_id: (
        Skill.objects.filter(agent_configs=agent_config_id)
        .select_related("current_version")
        .order_by("name", *OWN_BEFORE_PLATFORM)
    ),
    agent_config_id=int,
)


def _tool_entry(tool_version: ToolVersion) -> dict[str, Any]:
    return {
        "id": str(tool_version.pk),
        "name": tool_version.tool.name,
        "version": tool_version.version,
        "risk": tool_version.risk,
        "approval_rule": tool_version.approval_rule,
        "data_classification": tool_version.data_classification,
        "timeout_s": tool_version.timeout_s,
        "input_schema_sha256": _input_schema_hash(tool_version),
    }


def _tool_exclusion(
    tool_version: ToolVersion, *, tenant: Tenant, max_level: int, chosen: dict[str, dict]
) -> str | None:
    """Why a pinned tool version stays out of this run, or None if it may enter."""
    if tool_version.status not in CALLABLE_STATUSES:
        return f"VERSION_{tool_version.status.upper()}"
    if not tenant_has_grant(tenant=tenant, definition=tool_version.tool):
        return "NOT_GRANTED"
    if DATA_CLASSIFICATION_LEVELS.index(tool_version.data_classification) > max_level:
        return "ABOVE_DATA_CLASSIFICATION"
    if tool_version.adapter_kind == AdapterKind.MCP:
        if not mcp_server_usable(server=mcp_server_of(tool_version), tenant=tenant):
            return "MCP_SERVER_NOT_AVAILABLE"
        if mcp_drift([tool_version]):
            return "TOOL_DEFINITION_CHANGED"
    already = chosen.get(tool_version.tool.name)
    if already is not None and already["id"] != str(tool_version.pk):
        return "CONFLICTING_PIN"
    return None


@dataclass
class _Resolution:
    """One snapshot being resolved: for whom, under which data classification ceiling, and
    what has entered it (tools, by name) or been kept out (with the reason)."""

    tenant: Tenant
    actor: AbstractBaseUser
    max_level: int
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: list[dict[str, str]] = field(default_factory=list)


def _skill_entry(
    skill: Skill, version: SkillVersion, resolution: _Resolution, *, healthy_only: bool
) -> dict[str, Any] | None:
    """A skill's snapshot entry, adding the pinned tools that may enter to `tools`. With
    `healthy_only` (retrieval), a skill one of whose tools cannot be used stays out whole."""
    pinned: dict[str, dict[str, Any]] = {}
    for dependency in _PINNED(skill_version_id=version.pk):
        tool_version = dependency.tool_version
        reason = _tool_exclusion(
            tool_version,
            tenant=resolution.tenant,
            max_level=resolution.max_level,
            chosen=resolution.tools,
        )
        if reason is None and healthy_only and circuit_state(tool_version) == "open":
            reason = "CIRCUIT_OPEN"
        if reason:
            excluded = resolution.excluded
            excluded.append({"tool": tool_version.qualified_name, "reason": reason})
            if healthy_only:
                excluded.append({"skill": skill.name, "reason": "DEPENDENCY_UNAVAILABLE"})
                return None
            continue
        pinned[tool_version.tool.name] = _tool_entry(tool_version)
    resolution.tools.update(pinned)
    workflow = WORKFLOWS.get(version.workflow)
    return {
        "id": str(version.pk),
        "name": skill.name,
        "version": version.version,
        "required_inputs": version.required_inputs,
        "workflow": version.workflow,
        "workflow_sha256": workflow.definition_hash if workflow else None,
        "tools": sorted(pinned),
    }


def _skill_resolved(
    skill: Skill, resolution: _Resolution, *, healthy_only: bool
) -> dict[str, Any] | None:
    """The snapshot entry of the version of `skill` the actor gets (`_skill_entry`), or None
    when it may not enter, its reason added to `excluded`."""
    tenant = resolution.tenant
    version = skill_version_for_actor(skill=skill, tenant=tenant, actor_id=str(resolution.actor.pk))
    if not tenant_has_grant(tenant=tenant, definition=skill) or version is None:
        resolution.excluded.append({"skill": skill.name, "reason": "NOT_AVAILABLE"})
        return None
    return _skill_entry(skill, version, resolution, healthy_only=healthy_only)


def _node_skills(skills: list[dict[str, Any]], resolution: _Resolution) -> list[dict[str, Any]]:
    """The skills the nodes of the routed skill's workflow load by name (explicit workflow
    assembly), each once, held to what any skill is held to; those of them the run has
    already carry no entry of their own. An entry says which node loads it. Of two skills of
    one name, the tenant's own is loaded (`skill_candidates_loaded`); one that two namespaces
    of the tenant have is loaded from neither, its candidates named; in an evaluation
    sandbox, the skill under test."""
    workflow = WORKFLOWS.get(skills[0]["workflow"]) if skills else None
    have = {skill["name"] for skill in skills}
    loading = {
        reference: node
        for reference, node in (workflow.skills_loaded.items() if workflow else ())
        if skill_reference_name(reference) not in have
    }
    if not loading:
        return []
    found = skill_candidates_loaded(tenant=resolution.tenant, references=loading)
    entries = []
    for reference, node in loading.items():
        candidates = found.get(reference, [])
        if not candidates:
            resolution.excluded.append({"skill": reference, "reason": "NOT_AVAILABLE"})
            continue
        if len(candidates) > 1:
            resolution.excluded.append(
                {
                    "skill": reference,
                    "reason": "AMBIGUOUS",
                    "candidates": [str(candidate) for candidate in candidates],
                }
            )
            continue
        entry = _skill_resolved(candidates[0], resolution, healthy_only=False)
        if entry is not None:
            entries.append({**entry, "node": node})
    return entries


def _under_test_in_place(
    candidates: list[tuple[Skill, float | None]], tenant: Tenant
) -> list[tuple[Skill, float | None]]:
    """In an evaluation sandbox, the skill under test in place of the first candidate of its
    name (`skill_under_test`), and no other of that name: the tenant's own skill or the
    platform's of the same name never enters a run that measures the version under test."""
    under_test = skill_under_test(tenant=tenant)
    if under_test is None:
        return candidates
    placed, taken = [], False
    for skill, score in candidates:
        if skill.name != under_test.name:
            placed.append((skill, score))
        elif not taken:
            placed.append((under_test, score))
            taken = True
    return placed


def _candidates(
    agent_config: AgentConfig, *, tenant: Tenant, request_text: str
) -> tuple[list[tuple[Skill, float | None]], dict[str, Any]]:
    """The skills to consider, best first, and how they were assembled: the agent's bound
    skills, or those recalled for the request that score at least the agent's threshold."""
    if agent_config.skill_assembly == SkillAssembly.STATIC:
        bound = _BOUND_SKILLS(agent_config_id=agent_config.pk)
        candidates = [(skill, None) for skill in bound]
        return _under_test_in_place(candidates, tenant), {"mode": SkillAssembly.STATIC}
    recalled = skills_recall(tenant=tenant, text=request_text)
    threshold = float(agent_config.skill_min_score)
    assembly = {
        "mode": SkillAssembly.RETRIEVAL,
        "min_score": f"{agent_config.skill_min_score:.3f}",
        "when_no_skill_matches": agent_config.when_no_skill_matches,
        "recalled": [{"skill": item.skill.name, "score": item.score} for item in recalled],
    }
    candidates = [(item.skill, item.score) for item in recalled if item.score >= threshold]
    return _under_test_in_place(candidates, tenant), assembly


def capability_resolve(
    *,
    tenant: Tenant,
    actor: AbstractBaseUser,
    agent_config: AgentConfig,
    roles: frozenset[str] | None = None,
    request_text: str = "",
) -> dict[str, Any]:
    """`roles`: the actor's roles in the tenant, when the caller has read them already.
    `request_text`: what the user asked, for an agent that recalls its skills."""
    if roles is None:
        roles = user_roles(user=actor, tenant=tenant)
    policy = agent_config.policy
    resolution = _Resolution(
        tenant=tenant,
        actor=actor,
        max_level=DATA_CLASSIFICATION_LEVELS.index(policy.max_data_classification),
    )
    skills: list[dict[str, Any]] = []
    candidates, assembly = _candidates(agent_config, tenant=tenant, request_text=request_text)
    for skill, score in candidates:
        entry = _skill_resolved(skill, resolution, healthy_only=score is not None)
        if entry is not None:
            skills.append(entry if score is None else {**entry, "score": score})
    skills += _node_skills(skills, resolution)
    model = agent_config.model_config
    return {
        "schema": SNAPSHOT_SCHEMA,
        "tenant": tenant.slug,
        "actor": {"id": str(actor.pk), "username": actor.get_username()},
        "roles": sorted(roles),
        "environment": settings.ENVIRONMENT,
        "agent": {"id": agent_config.pk, "name": agent_config.name},
        "model": {
            "id": model.pk,
            "name": model.name,
            "provider": model.provider,
            "model": model.model_name,
            "price_per_1k_input": f"{model.price_per_1k_input:.6f}",
            "price_per_1k_cached_input": (
                None
                if model.price_per_1k_cached_input is None
                else f"{model.price_per_1k_cached_input:.6f}"
            ),
            "price_per_1k_cache_write": (
                None
                if model.price_per_1k_cache_write is None
                else f"{model.price_per_1k_cache_write:.6f}"
            ),
            "price_per_1k_output": f"{model.price_per_1k_output:.6f}",
        },
        "budgets": {
            "max_steps": agent_config.max_steps,
            "max_tool_calls": agent_config.max_tool_calls,
            "max_seconds": agent_config.max_seconds,
            "max_tokens": agent_config.max_tokens,
            "max_cost": f"{agent_config.max_cost:.4f}",
        },
        "assembly": assembly,
        "skills": skills,
        "tools": [resolution.tools[name] for name in sorted(resolution.tools)],
        "excluded": resolution.excluded,
        "approval_policy": {
            "name": policy.name,
            "approval_required_risks": sorted(policy.approval_required_risks),
            "human_queue_risks": sorted(policy.human_queue_risks),
            "approver_roles": sorted(policy.approver_roles),
            "allow_self_approval": policy.allow_self_approval,
            "approval_ttl_seconds": policy.approval_ttl_seconds,
        },
        "data_scope": {
            "tenant": tenant.slug,
            "max_data_classification": policy.max_data_classification,
        },
    }


def pinned_model_label(capability: dict[str, Any]) -> str:
    """The model a run's snapshot pinned, as a model config names itself (`name (provider:
    model)`), so that the offline planner reads as such wherever a run's work is shown;
    empty for a run that pinned none (refused before its snapshot)."""
    model = capability.get("model")
    if not model:
        return ""
    provider = dict(ModelProvider.choices).get(model["provider"], model["provider"])
    return f"{model['name']} ({provider}: {model['model']})"


def workflow_changed(capability: dict[str, Any]) -> dict[str, str] | None:
    """What changed, if the workflow a run was routed to is now defined otherwise than its
    snapshot pinned (a deploy changed its nodes, their tools or its transitions under the same
    name and version): the run would do what its snapshot does not say. A snapshot resolved
    before workflows were pinned by their definition has no hash, and is not checked; a
    workflow no longer defined is refused when the run starts (`WORKFLOW_NOT_AVAILABLE`).
    No query: the registered definition's hash is computed once per process."""
    skills = capability.get("skills", [])
    pinned = skills[0].get("workflow_sha256") if skills else None
    workflow = WORKFLOWS.get(skills[0]["workflow"]) if pinned else None
    if workflow is None or workflow.definition_hash == pinned:
        return None
    return {"workflow": workflow.key, "pinned": pinned, "now": workflow.definition_hash}


def capability_snapshot(
    *,
    tenant: Tenant,
    actor: AbstractBaseUser,
    agent_config: AgentConfig,
    roles: frozenset[str],
    request_text: str,
    generation: int | None,
) -> tuple[dict[str, Any], str]:
    """The snapshot a run starts with and its hash. An agent with static skills gets it from
    the process's cache when it was resolved for the same agent, actor and roles under the
    registry's current `generation` (`registry.generation`); an agent that recalls its
    skills resolves it each time (it depends on the request and on the tools' circuits)."""

    def resolve() -> tuple[dict[str, Any], str]:
        capability = capability_resolve(
            tenant=tenant,
            actor=actor,
            agent_config=agent_config,
            roles=roles,
            request_text=request_text,
        )
        return capability, canonical_hash(capability)

    if agent_config.skill_assembly != SkillAssembly.STATIC:
        return resolve()
    key = ("capability", tenant.pk, agent_config.pk, actor.pk, actor.get_username(), roles)
    capability, digest = registry_cached(generation, key, resolve)
    # A copy of its own for the run (orjson: a few microseconds); the cached one stays as it was.
    return orjson.loads(orjson.dumps(capability)), digest
