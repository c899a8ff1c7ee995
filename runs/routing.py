"""The routing decision of a run, recorded in `route.selected` with why it was taken: the task
category, the execution mode, the model, the risk, and whether clarification or approval
before any side effect will be needed. Authorisation comes first and is not decided here: the
capability snapshot only holds what the actor may use, and a project the actor may not see is
refused by the host before any project data is read."""

from typing import Any

from registry.choices import NoSkillMatched, Risk, SkillAssembly
from runs.workflows import AGENT, Workflow

PROJECT_SCOPE = "project_scope"
DATE_RANGE = "date_range"
SKILL = "skill"
HUMAN_QUEUE = "human_queue"


def _skill_risks(capability: dict[str, Any], skill: dict[str, Any] | None) -> set[str]:
    """The risks of the tools the skill pins (those in the snapshot)."""
    if skill is None:
        return set()
    return {tool["risk"] for tool in capability.get("tools", []) if tool["name"] in skill["tools"]}


def no_skill_clarifies(capability: dict[str, Any]) -> bool:
    """Whether a retrieval agent asks the user when no skill matched (else it answers)."""
    return capability.get("assembly", {}).get("when_no_skill_matches") == NoSkillMatched.CLARIFY


def _assembly_why(assembly: dict[str, Any], skill: dict[str, Any] | None) -> list[str]:
    if assembly.get("mode") != SkillAssembly.RETRIEVAL:
        return [f"{skill['name']} is bound to the agent"] if skill else []
    recalled, threshold = assembly["recalled"], assembly["min_score"]
    if skill is not None:
        return [
            f"recalled {skill['name']} with score {skill['score']} (threshold {threshold}) "
            f"among {len(recalled)} candidate(s)"
        ]
    if not recalled:
        return ["no published skill matches the request's terms"]
    best = recalled[0]
    return [f"no usable skill scored at least {threshold} (best: {best['skill']} {best['score']})"]


def route_decide(
    *,
    capability: dict[str, Any],
    skill: dict[str, Any] | None,
    required_inputs: list[str],
    workflow: Workflow,
    inputs: dict[str, Any],
) -> dict[str, Any]:
    why: list[str] = _assembly_why(capability.get("assembly", {}), skill)
    sends = "send" in workflow.nodes
    missing = []
    skill_risks = _skill_risks(capability, skill)
    for_people = sorted(
        skill_risks & set(capability.get("approval_policy", {}).get("human_queue_risks", []))
    )
    if skill is not None and for_people:
        category, mode = ("external_action" if sends else "writing"), HUMAN_QUEUE
        why.append(
            f"{skill['name']} uses tools of risk {', '.join(for_people)}, which the policy "
            "leaves to people: the request goes to the human queue"
        )
    elif skill is None and no_skill_clarifies(capability):
        category, mode = "question", "direct_answer"
        missing.append(SKILL)
        why.append("no skill serves this request: the run asks what the user needs")
    elif skill is None:
        category, mode = "question", "direct_answer"
        why.append("no skill serves this request and actor: the model answers without tools")
    elif sends:
        category, mode = "external_action", "explicit_workflow"
        why.append(f"{skill['name']} binds workflow {workflow.key}, which ends in a send")
    elif workflow is not AGENT:
        category, mode = "writing", "explicit_workflow"
        why.append(f"{skill['name']} binds workflow {workflow.key}")
    else:
        category, mode = "retrieval", "single_agent"
        why.append(f"{skill['name']} binds no workflow: one agent with its read tools")
    risk = max(skill_risks, key=Risk.values.index, default=Risk.READ)
    policy = capability.get("approval_policy", {})
    pre_approval = mode != HUMAN_QUEUE and bool(
        skill_risks & set(policy.get("approval_required_risks", []))
    )
    if pre_approval:
        why.append("a side effect waits for a human approval of its frozen payload")
    if PROJECT_SCOPE in required_inputs and not inputs.get("project_id"):
        missing.append(PROJECT_SCOPE)
        why.append("the project scope is missing: the run asks for it")
    if DATE_RANGE in required_inputs and not inputs.get("date_from"):
        missing.append(DATE_RANGE)
        why.append("the week is unclear: the run asks which one")
    model = capability.get("model", {})
    why.append(f"model {model.get('name', '?')} from the agent's configuration")
    return {
        "workflow": workflow.key,
        "skill": f"{skill['name']}@{skill['version']}" if skill else None,
        "risk": risk,
        "category": category,
        "mode": mode,
        "model": model.get("name"),
        "clarification": missing,
        "pre_approval": pre_approval,
        "for_people": for_people,
        "why": why,
    }
