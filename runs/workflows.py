"""Workflows: explicit state machines defined in code, registered under `name@version` and
bound to skill versions in the registry.

A node names the tools it allows (gate 1 intersects them with the run's snapshot), an optional
guard over a call's arguments (gate 4), whether the model drives it, whether it may call a
tool that is not a read (only a node after approval may; gate 4 refuses it anywhere else), and
the skill it loads, if it names one. The host, not the model, moves between nodes.
A workflow is checked when it is defined: it starts at one of its nodes, its transitions move
between its nodes only, and a node with side effects is driven by the host alone and entered
only from the approval node, after a human approved the frozen payload.

A run's capability snapshot pins the workflow by its key and by the hash of its definition
(`definition_hash`): a deploy that changes what a workflow does without a new version is seen
by the runs accepted before it.
"""

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from registry.canonical import canonical_hash

# The node where a run waits for a human's decision on its frozen payload.
APPROVAL_NODE = "approval"

# A guard returns why a call is refused in this node, or None.
Guard = Callable[[Mapping[str, Any], str, dict[str, Any]], str | None]


@dataclass(frozen=True)
class Rule:
    id: str
    scope: str
    priority: int
    text: str


@dataclass(frozen=True)
class Node:
    name: str
    tools: frozenset[str] = frozenset()
    model_driven: bool = False
    guard: Guard | None = None
    rules: tuple[Rule, ...] = ()
    terminates_when: str = ""
    side_effects: bool = False
    # The skill this node loads, by name or as `namespace/name` (explicit workflow assembly):
    # its procedure, rules, examples and pinned tools apply in this node, whichever skill the
    # run was routed to. A name two namespaces of one owner have loads neither.
    skill: str = ""

    @property
    def skill_name(self) -> str:
        return skill_reference_name(self.skill)


def skill_reference_name(reference: str) -> str:
    """The name of the skill a node's reference (`name` or `namespace/name`) loads: a run
    knows its skills by name."""
    return reference.rpartition("/")[2]


@dataclass(frozen=True)
class Workflow:
    name: str
    version: str
    start: str
    nodes: dict[str, Node]
    transitions: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if problems := self._problems():
            raise ValueError(f"Workflow {self.key}: {'; '.join(problems)}.")

    def _problems(self) -> list[str]:
        """What would let a run move to a node the workflow does not have, or reach a side
        effect without the host having waited for a human's approval first."""
        problems = []
        if self.start not in self.nodes:
            problems.append(f"it starts at {self.start}, which is no node")
        problems += [
            f"node {key} is named {node.name}"
            for key, node in self.nodes.items()
            if key != node.name
        ]
        for source, targets in self.transitions.items():
            if source not in self.nodes:
                problems.append(f"a transition leaves {source}, which is no node")
            problems += [
                f"{source} moves to {target}, which is no node"
                for target in targets
                if target not in self.nodes
            ]
        for name, node in self.nodes.items():
            if not node.side_effects:
                continue
            if node.model_driven:
                problems.append(f"{name} has side effects, so no model may drive it")
            if name == self.start:
                problems.append(
                    f"{name} has side effects but is where the workflow starts, before any approval"
                )
            problems += [
                f"{name} has side effects but is reached from {source}, not only from "
                f"{APPROVAL_NODE}"
                for source, targets in self.transitions.items()
                if name in targets and source != APPROVAL_NODE
            ]
        return problems

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @functools.cached_property
    def definition_hash(self) -> str:
        """sha256 of the canonical JSON of what the workflow does: where it starts, each node
        (its tool allowlist, its guard by name, whether a model drives it or it has side
        effects, its rules, when it ends, the skill it loads) and its transitions. Computed
        once per workflow, so once per process for a registered one."""
        return canonical_hash(
            {
                "key": self.key,
                "start": self.start,
                "nodes": {
                    name: {
                        "tools": sorted(node.tools),
                        "model_driven": node.model_driven,
                        "guard": (
                            None
                            if node.guard is None
                            else f"{node.guard.__module__}.{node.guard.__qualname__}"
                        ),
                        "rules": [
                            {
                                "id": rule.id,
                                "scope": rule.scope,
                                "priority": rule.priority,
                                "text": rule.text,
                            }
                            for rule in node.rules
                        ],
                        "terminates_when": node.terminates_when,
                        "side_effects": node.side_effects,
                        "skill": node.skill,
                    }
                    for name, node in self.nodes.items()
                },
                "transitions": {
                    source: list(targets) for source, targets in self.transitions.items()
                },
            }
        )

    @property
    def skills_loaded(self) -> dict[str, str]:
        """The skills its nodes load, by reference, each with the first node that loads it."""
        loading: dict[str, str] = {}
        for node in self.nodes.values():
            if node.skill:
                loading.setdefault(node.skill, node.name)
        return loading


def _same_project(state: Mapping[str, Any], tool: str, arguments: dict[str, Any]) -> str | None:
    """The draft reads only the project the run is scoped to."""
    scope = state.get("inputs", {}).get("project_id")
    if arguments.get("project_id") != scope:
        return f"{tool} may read only project {scope} in this run."
    return None


WEEKLY_SUMMARY_SEND = Workflow(
    name="weekly-summary-send",
    version="1",
    start="resolve_recipient",
    nodes={
        "resolve_recipient": Node(
            name="resolve_recipient",
            tools=frozenset({"directory_lookup"}),
            terminates_when="exactly one active directory record with a corporate email",
        ),
        "draft": Node(
            name="draft",
            tools=frozenset({"project_search"}),
            model_driven=True,
            skill="weekly-summary",
            guard=_same_project,
            rules=(
                Rule(
                    id="draft-read-only",
                    scope="permission",
                    priority=900,
                    text="Only read tools are available; nothing is sent before approval.",
                ),
            ),
            terminates_when="a draft with progress, risks and next steps, every risk sourced",
        ),
        "approval": Node(name="approval", terminates_when="a human decides the frozen draft"),
        "send": Node(name="send", tools=frozenset({"mail_send"}), side_effects=True),
    },
    transitions={
        "resolve_recipient": ("draft",),
        "draft": ("approval",),
        "approval": ("send",),
        "send": (),
    },
)

AGENT = Workflow(
    name="agent",
    version="1",
    start="answer",
    nodes={
        "answer": Node(
            name="answer",
            model_driven=True,
            terminates_when="a final answer grounded in tool results; or, when the tools need an "
            'input the request does not give, {"clarification": "<the question for the user>"}',
        )
    },
    transitions={"answer": ()},
)

WORKFLOWS: dict[str, Workflow] = {
    workflow.key: workflow for workflow in (WEEKLY_SUMMARY_SEND, AGENT)
}
