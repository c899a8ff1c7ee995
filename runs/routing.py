"""The routing decision of a run, recorded in `route.selected` with why it was taken: the task
category, the execution mode, the model, the risk, and whether clarification or approval
before any side effect will be needed. Authorisation comes first and is not decided here: the
capability snapshot only holds what the actor may use, and a project the actor may not see is
refused by the host before any project data is read."""

from typing import Any

from registry.choices import READ_RISKS
from runs.workflows import AGENT, Workflow

PROJECT_SCOPE = "project_scope"


def route_decide(
    *,
    capability: dict[str, Any],
    skill: dict[str, Any] | None,
    required_inputs: list[str],
    workflow: Workflow,
    inputs: dict[str, Any],
) -> dict[str, Any]:
    why: list[str] = []
    sends = "send" in workflow.nodes
    if skill is None:
        category, mode = "question", "direct_answer"
        why.append("no skill of the agent serves this actor: the model answers directly")
    elif sends:
        category, mode = "external_action", "explicit_workflow"
        why.append(f"{skill['name']} binds workflow {workflow.key}, which ends in a send")
    elif workflow is not AGENT:
        category, mode = "writing", "explicit_workflow"
        why.append(f"{skill['name']} binds workflow {workflow.key}")
    else:
        category, mode = "retrieval", "single_agent"
        why.append(f"{skill['name']} binds no workflow: one agent with its read tools")
    risks = {tool["risk"] for tool in capability.get("tools", [])}
    risk = "external_side_effect" if sends else "read"
    pre_approval = sends or bool(risks - READ_RISKS and mode != "single_agent")
    if pre_approval:
        why.append("a side effect waits for a human approval of its frozen payload")
    missing = [
        name for name in required_inputs if name == PROJECT_SCOPE and not inputs.get("project_id")
    ]
    if missing:
        why.append("the project scope is missing: the run asks for it")
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
        "why": why,
    }
