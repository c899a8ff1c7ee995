"""Workflows are explicit state machines: one that could move to a node it does not have, or
reach a side effect other than through a human's approval, is refused when it is defined."""

import pytest

from runs.workflows import WORKFLOWS, Node, Workflow

DRAFT = Node(name="draft", tools=frozenset({"project_search"}), model_driven=True)
APPROVAL = Node(name="approval")
SEND = Node(name="send", tools=frozenset({"mail_send"}), side_effects=True)
MODEL_SEND = Node(name="send", tools=frozenset({"mail_send"}), model_driven=True, side_effects=True)


def workflow(nodes: dict[str, Node], transitions: dict[str, tuple[str, ...]], start: str):
    return Workflow(
        name="test-flow", version="1", start=start, nodes=nodes, transitions=transitions
    )


def test_a_workflow_that_drafts_then_waits_for_approval_then_sends_is_defined():
    defined = workflow(
        {"draft": DRAFT, "approval": APPROVAL, "send": SEND},
        {"draft": ("approval",), "approval": ("send",), "send": ()},
        start="draft",
    )

    assert defined.key == "test-flow@1"
    assert all(registered.key == key for key, registered in WORKFLOWS.items())


@pytest.mark.parametrize(
    ("nodes", "transitions", "start", "problem"),
    [
        (
            {"draft": DRAFT, "approval": APPROVAL, "send": SEND},
            {"draft": ("approval",), "approval": ("sned",), "send": ()},
            "draft",
            "approval moves to sned, which is no node",
        ),
        (
            {"draft": DRAFT, "approval": APPROVAL},
            {"draft": ("approval",), "approval": (), "review": ("draft",)},
            "draft",
            "a transition leaves review, which is no node",
        ),
        (
            {"draft": DRAFT, "approval": APPROVAL},
            {"draft": ("approval",), "approval": ()},
            "resolve_recipient",
            "it starts at resolve_recipient, which is no node",
        ),
        (
            {"draft": DRAFT, "review": Node(name="check"), "approval": APPROVAL},
            {"draft": ("review",), "review": ("approval",), "approval": ()},
            "draft",
            "node review is named check",
        ),
        (
            {"draft": DRAFT, "approval": APPROVAL, "send": SEND},
            {"draft": ("send",), "approval": (), "send": ()},
            "draft",
            "send has side effects but is reached from draft, not only from approval",
        ),
        (
            {"send": SEND, "approval": APPROVAL},
            {"send": ("approval",), "approval": ()},
            "send",
            "send has side effects but is where the workflow starts, before any approval",
        ),
        (
            {"draft": DRAFT, "approval": APPROVAL, "send": MODEL_SEND},
            {"draft": ("approval",), "approval": ("send",), "send": ()},
            "draft",
            "send has side effects, so no model may drive it",
        ),
        (
            {"draft": DRAFT, "approval": Node(name="approval", side_effects=True)},
            {"draft": ("approval",), "approval": ()},
            "draft",
            "approval has side effects but is reached from draft, not only from approval",
        ),
    ],
)
def test_a_workflow_that_could_go_astray_is_refused_when_defined(
    nodes, transitions, start, problem
):
    with pytest.raises(ValueError) as refused:
        workflow(nodes, transitions, start=start)

    assert str(refused.value) == f"Workflow test-flow@1: {problem}."


def test_a_workflows_definition_hash_changes_with_what_its_nodes_allow_and_where_they_lead():
    nodes = {"draft": DRAFT, "approval": APPROVAL, "send": SEND}
    transitions = {"draft": ("approval",), "approval": ("send",), "send": ()}
    defined = workflow(nodes, transitions, start="draft")
    wider = Node(name="draft", tools=frozenset({"project_search", "mail_send"}), model_driven=True)
    loading = Node(
        name="draft", tools=frozenset({"project_search"}), model_driven=True, skill="board-pack"
    )

    same = workflow(dict(nodes), dict(transitions), "draft")
    assert defined.definition_hash == same.definition_hash
    assert (
        len(
            {
                defined.definition_hash,
                workflow({**nodes, "draft": wider}, transitions, "draft").definition_hash,
                workflow({**nodes, "draft": loading}, transitions, "draft").definition_hash,
                workflow(nodes, {**transitions, "approval": ()}, "draft").definition_hash,
            }
        )
        == 4
    )
