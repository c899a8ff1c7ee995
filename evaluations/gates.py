"""Release gates: a skill version is published, or an agent moved to another model, only on
the evidence of finished eval runs of exactly that version, with the model of each agent it
is given to (or the model the agent moves to), meeting every threshold of the skill. A
blocked publish names the failing metric and value; a tenant or platform admin may publish
anyway with a written reason, kept as a ReleaseOverride and in the version's history."""

import json
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from evaluations.choices import EVAL_RUN_ACTIVE, EvalRunStatus
from evaluations.errors import PermissionDenied, ReleaseGateFailed, ValidationFailed
from evaluations.models import EvalRun, EvalSuite, EvalThreshold, ReleaseOverride
from registry.canonical import canonical_hash
from registry.choices import Action
from registry.models import AgentConfig, ModelConfig, RolloutFlag, Skill, SkillVersion, Tenant
from registry.models.configs import MODEL_IDENTITY_FIELDS, MODEL_OPERATIONAL_PARAMETERS
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.selectors import (
    agent_skills_reachable,
    agents_given,
    skill_versions_served,
    user_can,
)


def skill_content_hash(skill_version: SkillVersion) -> str:
    """What an eval run measured: the version's content and the tool versions it pins."""
    return canonical_hash(
        {
            **{field: getattr(skill_version, field) for field in SKILL_CONTENT_FIELDS},
            "tool_versions": sorted(
                str(pk)
                for pk in skill_version.tool_dependencies.values_list("tool_version", flat=True)
            ),
        }
    )


# What a case is, for the evidence of an eval run: its title is only a label.
SUITE_CASE_FIELDS = (
    "key",
    "messages",
    "metadata",
    "session_state",
    "fixture",
    "expected",
    "vector",
    "payload",
    "forbidden",
)


def suite_content_hash(suite: EvalSuite) -> str:
    """What an eval run was measured against: the suite's kind and every case's content. A
    case added, changed or removed since makes another suite of the same key."""
    return canonical_hash(
        {
            "kind": suite.kind,
            "cases": [
                {field: getattr(case, field) for field in SUITE_CASE_FIELDS}
                for case in suite.cases.order_by("key")
            ],
        }
    )


def suite_changed(*, suites: list[EvalSuite]) -> None:
    """What `suites` measure is changing (a case added, changed or moved, the kind): each
    eval run of them queued or running is marked `suite_changed`, as its cases from here on
    are measured against another suite than the one it started on. Holds the suites' rows
    until the caller's transaction ends, so a start (`eval_run_start`) either hashes the suite
    as changed or is marked."""
    list(EvalSuite.objects.select_for_update().filter(pk__in=[s.pk for s in suites]).values("pk"))
    EvalRun.objects.filter(suite__in=suites, status__in=EVAL_RUN_ACTIVE).update(suite_changed=True)


def skill_version_changed(*, skill_version: SkillVersion) -> None:
    """The draft `skill_version` was edited: each eval run of it queued or running on other
    content than it has now is marked `skill_version_changed`, as a sandbox reads a draft as
    it is at each step, so its cases from here on measure another content than the one it
    started on. The caller holds the version's row, as `eval_run_start` does before it
    hashes the content: a start either hashes the edited content or is marked."""
    EvalRun.objects.filter(skill_version=skill_version, status__in=EVAL_RUN_ACTIVE).exclude(
        skill_content_hash=skill_content_hash(skill_version)
    ).update(skill_version_changed=True)


def release_gate_failures(
    *, skill_version: SkillVersion, model_config: ModelConfig | None = None
) -> list[dict[str, Any]]:
    """Each threshold of the skill that the latest finished eval run of its suite, as the
    suite is now and unchanged while it ran, on this version as it is now and unchanged while
    it ran (with this model, if given) does not meet, or that no such run measured."""
    skill = skill_version.skill
    content_hash = skill_content_hash(skill_version)
    thresholds = EvalThreshold.objects.filter(
        tenant_id=skill.tenant_id, skill_name=skill.name
    ).select_related("suite")
    failures = []
    suite_hashes: dict[Any, str] = {}
    for threshold in thresholds:
        if threshold.suite_id not in suite_hashes:
            suite_hashes[threshold.suite_id] = suite_content_hash(threshold.suite)
        runs = EvalRun.objects.filter(
            suite=threshold.suite,
            suite_content_hash=suite_hashes[threshold.suite_id],
            suite_changed=False,
            skill_version=skill_version,
            skill_content_hash=content_hash,
            skill_version_changed=False,
            status=EvalRunStatus.COMPLETED,
        )
        if model_config is not None:
            runs = runs.filter(model_config=model_config)
        latest = runs.order_by("-finished_at").first()
        measured = latest.metrics.get(threshold.metric) if latest else None
        if latest is not None and threshold.is_met(measured):
            continue
        failures.append(
            {
                "suite": threshold.suite.key,
                "metric": threshold.metric,
                "comparator": threshold.comparator,
                "threshold": threshold.value,
                "value": measured,
                "eval_run": str(latest.pk) if latest else None,
            }
        )
    return failures


def _described(failure: dict[str, Any]) -> str:
    if failure["eval_run"] is None:
        described = f"no finished eval run of {failure['suite']} as it is, on this version as it is"
    elif failure["value"] is None:
        described = (
            f"{failure['metric']} was not measured on {failure['suite']} (no case of it "
            f"applies), must be {failure['comparator']} {failure['threshold']}"
        )
    else:
        described = (
            f"{failure['metric']} is {failure['value']} on {failure['suite']}, "
            f"must be {failure['comparator']} {failure['threshold']}"
        )
    if "agents" in failure:
        described += (
            f", with {failure['model_config']} (the model of {', '.join(failure['agents'])})"
        )
    return described


def may_override_gates_of(*, actor: AbstractBaseUser, tenant: Tenant | None) -> bool:
    """Who may let a skill of `tenant` (a platform skill: None) through its release gate, or
    weaken that gate: its tenant's admins, and the platform's."""
    if actor.is_superuser:
        return True
    return tenant is not None and user_can(user=actor, action=Action.TENANT_ADMIN, tenant=tenant)


def may_override(*, actor: AbstractBaseUser, skill_version: SkillVersion) -> bool:
    return may_override_gates_of(actor=actor, tenant=skill_version.skill.tenant)


# What names the gate a threshold is: the skill it holds back, what it measures and how.
THRESHOLD_GATE_FIELDS = ("tenant", "skill_name", "suite", "metric", "comparator")


def threshold_change_check(*, threshold: EvalThreshold, actor: AbstractBaseUser) -> list[str]:
    """The fields of `threshold`, about to be saved, whose change weakens the gate its saved
    row is: any of THRESHOLD_GATE_FIELDS (another skill, suite, metric or comparator is
    another gate, and the saved one is gone) or a less strict value (a lower minimum, a
    higher maximum). A new threshold only adds a gate, a stricter value only holds back more.
    Raises when there are such fields and the actor may not override that gate. The saved
    row stays locked until the caller's transaction ends."""
    if threshold._state.adding:
        return []
    saved = EvalThreshold.objects.select_for_update().get(pk=threshold.pk)
    weakened = [
        field
        for field in THRESHOLD_GATE_FIELDS
        if getattr(saved, EvalThreshold._meta.get_field(field).attname)
        != getattr(threshold, EvalThreshold._meta.get_field(field).attname)
    ]
    if threshold.value != saved.value and (weakened or not saved.is_met(threshold.value)):
        weakened.append("value")
    if weakened and not may_override_gates_of(actor=actor, tenant=saved.tenant):
        raise PermissionDenied(
            "Only a tenant admin or a platform admin may weaken a release gate: "
            f"changing the {', '.join(weakened)} of {saved} weakens it.",
            details={field: ["Changing it weakens a release gate."] for field in weakened},
        )
    return weakened


def suite_change_check(*, suites: list[EvalSuite], actor: AbstractBaseUser) -> None:
    """A change to what `suites` measure (a suite's kind, a case added, changed or moved)
    changes every release gate measured on them, and may weaken it: a case that always
    passes raises a pass rate, an expectation dropped lets any behaviour through. Raises when
    one of those gates is one the actor may not override."""
    refused = sorted(
        {
            f"{threshold.skill_name} ({threshold.tenant.slug if threshold.tenant else 'platform'})"
            for threshold in EvalThreshold.objects.filter(suite__in=suites).select_related("tenant")
            if not may_override_gates_of(actor=actor, tenant=threshold.tenant)
        }
    )
    if refused:
        raise PermissionDenied(
            "Only a tenant admin or a platform admin may change what a release gate measures: "
            f"{', '.join(sorted(suite.key for suite in suites))} measures the release gate of "
            f"{', '.join(refused)}.",
            details={"release_gates": refused},
        )


def release_gate_failures_given(
    *, skill_version: SkillVersion, agents: list[AgentConfig] | None = None
) -> list[dict[str, Any]]:
    """`release_gate_failures` with the model of each agent the version would be given to
    (`agents`, or every one `agents_given` finds), each failure naming the model and its
    agents; with any model when no agent would be given it."""
    agents_of: dict[ModelConfig, list[str]] = {}
    for agent in agents_given(skill=skill_version.skill) if agents is None else agents:
        agents_of.setdefault(agent.model_config, []).append(str(agent))
    if not agents_of:
        return release_gate_failures(skill_version=skill_version)
    return [
        {**failure, "model_config": model_config.name, "agents": names}
        for model_config, names in sorted(agents_of.items(), key=lambda item: item[0].name)
        for failure in release_gate_failures(skill_version=skill_version, model_config=model_config)
    ]


def release_gate_check(
    *,
    skill_version: SkillVersion,
    actor: AbstractBaseUser,
    override_reason: str = "",
    agents: list[AgentConfig] | None = None,
) -> list[dict[str, Any]]:
    """The failures a publish (or a rollback) overrides (empty when the gate is met); raises
    when it may not go ahead: the gate fails and there is no override, or the actor may not
    override. The gate is met with the model of each agent the version would be given to
    (`agents_given`), as `model_change_check` holds it when an agent moves: an eval run with
    another model is no evidence for them. A skill no agent uses is met with any model.
    `agents`: those it would be given to, when not every one `agents_given` finds (a rollout
    gives it to the agents of the tenants it serves)."""
    failures = release_gate_failures_given(skill_version=skill_version, agents=agents)
    if not failures:
        return []
    if not override_reason.strip():
        raise ReleaseGateFailed(
            f"{skill_version.qualified_name} does not meet its release gate: "
            + "; ".join(_described(failure) for failure in failures)
            + ".",
            details={"failures": failures},
        )
    if not may_override(actor=actor, skill_version=skill_version):
        raise PermissionDenied(
            "Only a tenant admin or a platform admin may override a release gate."
        )
    return failures


def release_override_record(
    *,
    skill_version: SkillVersion,
    actor: AbstractBaseUser,
    reason: str,
    failures: list[dict[str, Any]],
) -> ReleaseOverride:
    return ReleaseOverride.objects.create(
        skill_version=skill_version, actor=actor, reason=reason.strip(), failures=failures
    )


def rollout_change_check(
    *, flag: RolloutFlag, actor: AbstractBaseUser, tenants: QuerySet[Tenant] | None = None
) -> None:
    """A rollout flag that serves its version (active, to a share above none) gives it to the
    agents `agents_given` finds in the tenants it lists (in every one, when it lists none): the
    version meets its release gate with the model of each one it was not served to before (a
    new flag, another version, one resumed or raised from none, more tenants), as a publish
    holds it (`release_gate_check`). It was met with the models of its agents when it was
    published, but an agent may have moved to another model since, a move that checked only
    the versions served then. Pausing a flag, lowering its share or listing fewer tenants gives
    the version to no one new, and is never refused. A flag has no reason to give: there is no
    override. `tenants`: those the change lists, when it changes them too."""
    if not (flag.is_active and flag.percentage > 0):
        return
    adding = flag._state.adding
    if tenants is None:
        tenants = Tenant.objects.none() if adding else flag.tenants.all()
    listed = {tenant.pk for tenant in tenants}
    given = [
        agent for agent in agents_given(skill=flag.skill) if not listed or agent.tenant_id in listed
    ]
    stored = None if adding else RolloutFlag.objects.filter(pk=flag.pk).first()
    if (
        stored is not None
        and stored.is_active
        and stored.percentage > 0
        and stored.skill_version_id == flag.skill_version_id
    ):
        served = {tenant.pk for tenant in stored.tenants.all()}
        given = [agent for agent in given if served and agent.tenant_id not in served]
    if given:
        release_gate_check(skill_version=flag.skill_version, actor=actor, agents=given)


def grant_release_gate_check(
    *, skill: Skill, tenant: Tenant, actor: AbstractBaseUser, override_reason: str = ""
) -> list[tuple[SkillVersion, list[dict[str, Any]]]]:
    """A platform skill granted to `tenant` is given to the agents `agents_given` finds there:
    each version served to them (`skill_versions_served`: its current version, and those a
    rollout serves the tenant) meets its release gate with their models, as a publish holds it
    (`release_gate_check`). It was met, when published, with the models of the agents of the
    tenants it was granted to then, not of these. Ask it with the grant made, in the caller's
    transaction. Returns the failures each version is granted over."""
    given = [agent for agent in agents_given(skill=skill) if agent.tenant_id == tenant.pk]
    if not given:
        return []
    overridden = []
    for version in skill_versions_served(skills=[skill], tenant=tenant):
        failures = release_gate_check(
            skill_version=version, actor=actor, override_reason=override_reason, agents=given
        )
        if failures:
            overridden.append((version, failures))
    return overridden


def model_change_check(
    *, agent_config: AgentConfig, bound_skills: QuerySet[Skill] | None = None
) -> None:
    """Moving an agent to another model needs, for each version its runs may be given of each
    skill they may use (`agent_skills_reachable`: its bound skills, or for an agent that
    recalls its skills every one a request may recall, and the skills their workflows' nodes
    load; `skill_versions_served`: the current version, and those an active rollout serves in
    its tenant), the release gate met by eval runs with that model. A new agent needs the same
    with its model, and an agent given skills it could not reach before (bound to them, or
    made to recall) needs it for those: else an agent created, or bound in a second save,
    would run a skill on a model it was never evaluated with. An agent resumed (made active
    again) needs it for every version it may be given, as a new one does: while it was paused,
    a publish, a rollback or a rollout gave it nothing (`agents_given`) and asked nothing of
    its model. `bound_skills`: the skills the change binds it to, when it changes them too;
    the gate holds for the agent as it is saved."""
    adding = agent_config._state.adding
    if adding and bound_skills is None:
        bound_skills = Skill.objects.none()
    reachable = agent_skills_reachable(agent_config=agent_config, bound_skills=bound_skills)
    stored = None if adding else AgentConfig.objects.filter(pk=agent_config.pk).first()
    is_move = stored is None or stored.model_config_id != agent_config.model_config_id
    resumed = stored is not None and agent_config.is_active and not stored.is_active
    if not (is_move or resumed):
        before = {skill.pk for skill in agent_skills_reachable(agent_config=stored)}
        reachable = [skill for skill in reachable if skill.pk not in before]
    failures = []
    for version in skill_versions_served(skills=reachable, tenant=agent_config.tenant):
        failures += [
            {"skill": version.qualified_name, **failure}
            for failure in release_gate_failures(
                skill_version=version, model_config=agent_config.model_config
            )
        ]
    if not failures:
        return
    if stored is not None and is_move:
        refused = f"{agent_config} cannot move to {agent_config.model_config.name}"
    else:
        skills = sorted({failure["skill"].split("@")[0] for failure in failures})
        refused = (
            f"{agent_config} cannot be given {', '.join(skills)} with "
            f"{agent_config.model_config.name}"
        )
    raise ReleaseGateFailed(
        f"{refused}: " + "; ".join(f"{f['skill']}: {_described(f)}" for f in failures) + ".",
        details={"failures": failures},
    )


def tenant_resume_check(
    *, tenant: Tenant, reachable: dict[AgentConfig, list[Skill]] | None = None
) -> None:
    """A tenant made active again needs, for each of its active agents, the release gate of
    each version its runs may be given (`model_change_check`'s, as for a new agent) met with
    the agent's model: while it was inactive, a publish, a rollback or a rollout gave its
    agents nothing (`agents_given`) and asked nothing of their models. `reachable`: the skills
    each of its active agents may use, when the caller has found them (to lock them)."""
    if tenant._state.adding or not tenant.is_active:
        return
    if Tenant.objects.filter(pk=tenant.pk, is_active=False).values("pk").first() is None:
        return
    if reachable is None:
        reachable = tenant_agents_reachable(tenant=tenant)
    known: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    failures = []
    refusals = []
    for agent, skills in reachable.items():
        model_config = agent.model_config
        given = []
        for version in skill_versions_served(skills=skills, tenant=tenant):
            key = (version.pk, model_config.pk)
            if key not in known:
                known[key] = release_gate_failures(skill_version=version, model_config=model_config)
            given += [
                {"agent": str(agent), "skill": version.qualified_name, **failure}
                for failure in known[key]
            ]
        if given:
            names = sorted({failure["skill"].split("@")[0] for failure in given})
            refusals.append(
                f"{agent} cannot be given {', '.join(names)} with {model_config.name}: "
                + "; ".join(f"{f['skill']}: {_described(f)}" for f in given)
            )
            failures += given
    if failures:
        raise ReleaseGateFailed(
            f"{tenant} cannot be made active again: " + "; ".join(refusals) + ".",
            details={"failures": failures},
        )


def tenant_agents_reachable(*, tenant: Tenant) -> dict[AgentConfig, list[Skill]]:
    """The active agents of `tenant`, each with the skills its runs may use."""
    agents = (
        AgentConfig.objects.filter(tenant=tenant, is_active=True)
        .select_related("tenant", "model_config")
        .order_by("name")
    )
    return {agent: agent_skills_reachable(agent_config=agent) for agent in agents}


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _listed(words: list[str]) -> str:
    return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


def _answer_parameters_changed(saved: ModelConfig, model_config: ModelConfig) -> list[str]:
    """The parameters, other than MODEL_OPERATIONAL_PARAMETERS, that `model_config` adds,
    removes or sets to another JSON value than `saved` (1 and 1.0, or true and 1, differ)."""
    before, after = saved.parameters, model_config.parameters
    return sorted(
        key
        for key in (before.keys() | after.keys()) - MODEL_OPERATIONAL_PARAMETERS
        if key not in before
        or key not in after
        or json.dumps(before[key], sort_keys=True) != json.dumps(after[key], sort_keys=True)
    )


def model_config_change_check(*, model_config: ModelConfig) -> None:
    """A model config that agents use, or that eval runs measured with (the evidence of the
    model-move gate), keeps calling the model it names the way it was measured: another
    provider, model name or base URL (MODEL_IDENTITY_FIELDS), or another value of a parameter
    sent with each call (all but MODEL_OPERATIONAL_PARAMETERS, such as `timeout_s`), would
    move every agent on it to another model or other answers with no gate, and make those runs
    evidence for what they never measured. It keeps its tenant too: moved, the agents of its
    tenant (or of every tenant, for a platform-wide one) would call a config someone else
    owns, under another credential grant. Another model is a new config, which agents move to
    through `model_change_check`. Raises when such a field changes on a config in use. The
    saved row stays locked until the caller's transaction ends: no agent or eval run takes it
    up meanwhile."""
    saved = ModelConfig.objects.select_for_update().filter(pk=model_config.pk).first()
    if saved is None:
        return
    refusals = {
        field: "A model config in use keeps the model it calls: create a new model config "
        "with this value and move the agents to it."
        for field in MODEL_IDENTITY_FIELDS
        if getattr(saved, field) != getattr(model_config, field)
    }
    if saved.tenant_id != model_config.tenant_id:
        refusals["tenant"] = (
            "A model config in use keeps its tenant: its agents would call a model config "
            "someone else owns, under another credential grant. Create a new model config "
            "for the other tenant instead."
        )
    parameters = _answer_parameters_changed(saved, model_config)
    if parameters:
        refusals["parameters"] = (
            "A model config in use keeps the parameters its model answers with: "
            f"{', '.join(parameters)} cannot change, only "
            f"{', '.join(sorted(MODEL_OPERATIONAL_PARAMETERS))} can. Create a new model "
            "config with these parameters and move the agents to it."
        )
    if not refusals:
        return
    uses = [
        _counted(count, noun)
        for count, noun in (
            # An eval run's sandbox agent is counted as its eval run.
            (saved.agent_configs.filter(tenant__sandbox_of__isnull=True).count(), "agent"),
            (saved.eval_runs.count(), "eval run"),
        )
        if count
    ]
    if not uses:
        return
    fields = [str(ModelConfig._meta.get_field(field).verbose_name) for field in refusals]
    raise ValidationFailed(
        f"{saved.name} is used by {' and '.join(uses)}, so its {_listed(fields)} cannot "
        "change: create a new model config with the new values and move the agents to it, "
        "which their release gates check.",
        details={field: [refusal] for field, refusal in refusals.items()},
    )
