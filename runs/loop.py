"""The bounded model/tool loop. Each call to `run_advance_step` does one unit of work on a
locked run and checkpoints it: start, resolve the recipient, one model turn, or the tool
calls of one turn. The model's output, with every call id, is committed before any tool runs;
a redelivered step finds its work done and moves on, so no tool call is repeated.
"""

import json
import logging
import math
import operator
import re
import time
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from django.db.models.fields.json import KT
from django.utils import timezone

from approvals.services import action_freeze, handoff_open
from config import jsontext
from config.queries import PreparedQuery
from registry.choices import DATA_CLASSIFICATION_LEVELS, READ_RISKS
from registry.generation import generation_sql, registry_cached
from registry.models import ModelConfig, SkillVersion, ToolVersion
from registry.selectors import version_ids_withdrawn, versions_frozen
from runs import events, quotas, tracing, writes
from runs.capability import workflow_changed
from runs.choices import Channel, RunStatus
from runs.context import context_build, wrap_untrusted
from runs.model_clients.base import ModelError, ToolCall, ToolSpec, Usage, response_kept
from runs.model_clients.factory import IN_PROCESS_PROVIDERS, model_client_for
from runs.models import CancelRequest, Run, Session, Source
from runs.models import ToolCall as ToolCallRecord
from runs.models.tools import EVIDENCE_USE, source_reference
from runs.redaction import holds_secret, secrets_removed, secrets_removed_within
from runs.routing import DATE_RANGE, HUMAN_QUEUE, PROJECT_SCOPE, no_skill_clarifies, route_decide
from runs.rules import APPLICATION_RULES, PLATFORM_RULES, MergedRules, merge_rules
from runs.selectors import agent_active, requester_standing
from runs.services.attachment_reading import attachment_line, attachments_read
from runs.services.attachment_reading import is_read as attachment_is_read
from runs.services.attachments import ATTACHMENT_PART
from runs.services.excerpts import tokens_each
from runs.services.memory import memories_kept, memory_retrieve
from runs.services.resources import RESOURCE_PART, resource_key, resource_line, resources_attach
from runs.services.runs import (
    AGENT_CONFIG_INACTIVE,
    REQUESTER_NO_LONGER_AUTHORISED,
    WORKFLOW_CHANGED,
    cancel_request_take_in,
    run_finish,
    run_transition,
)
from runs.tokens import estimate_tokens
from runs.tools import executor
from runs.tools.adapters import ToolFailed, one_line
from runs.tools.envelope import ErrorCategory, business_done
from runs.transcript import (
    HOST_CALL_PREFIX,
    assistant_entry,
    calls_with_own_ids,
    pending_calls,
    result_entry,
    user_entry,
)
from runs.workflows import AGENT, APPROVAL_NODE, WORKFLOWS, Node, Rule, Workflow

logger = logging.getLogger(__name__)

RECIPIENT_ROLE = "研发负责人"
HISTORY_RUNS = 5
# Older runs of the session are kept as a rolling summary: this many, this much of each.
SUMMARY_RUNS = 45
SUMMARY_CHARS = 80
# A required input the host could not read from the message or the session: the task input it
# fills, why the run stops, what the user is asked, and how they answer in a chat and, for a
# scheduled task's run, in the task (`_answer_how`).
UNREAD_INPUT_QUESTIONS = (
    (
        PROJECT_SCOPE,
        "project_id",
        "MISSING_PROJECT_SCOPE",
        "Which project should the summary cover?",
        "Send the message again in this session with metadata.project_id set to the project's key.",
        "Change the task's project to the project's key.",
    ),
    (
        DATE_RANGE,
        "date_from",
        "DATE_RANGE_UNCLEAR",
        "Which week should the summary cover: this week, last week or the week before last?",
        "Send the message again naming one of them.",
        "Change the task's goal to name one of them.",
    ),
)
# An earlier run's reply (its question, or its answer) is kept in the history up to this long.
REPLY_CHARS = 2000
# An earlier message's attachments, and its resources, named in the history at most; the rest
# are counted.
HISTORY_REFERRED = 3
DRAFTS_KEPT = 5
# Sources a draft may cite: what the project tools returned, not the recipient lookup.
DRAFT_SECTIONS = ("progress", "risks", "next_steps")
# Nodes past the drafting loop: the approval services drive the run from there.
HOST_NODES = frozenset({APPROVAL_NODE, "send"})
# The largest totals a run's columns hold (`Run.tokens_used`: a PostgreSQL integer).
TOKENS_USED_MAX = 2**31 - 1
_COST = Run._meta.get_field("cost")
COST_MAX = Decimal(10) ** (_COST.max_digits - _COST.decimal_places) - Decimal(10) ** -(
    _COST.decimal_places
)
# A skill that lists this among its required inputs gets the user's memory in its context.
MEMORY_INPUT = "memory"


class ModelTemporarilyUnavailable(Exception):
    """A retryable provider failure in a step of the run `run_id`; the task retries the step
    with backoff."""

    def __init__(self, error: ModelError, *, run_id: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.run_id = run_id


def model_error_output(error: ModelError) -> dict[str, Any]:
    """What a run that a provider failure ended keeps of it: the provider's reason (its
    message has no credential, `provider_errors`) and the HTTP status, if there was one."""
    return {"model_error": str(error), "status_code": error.status_code}


def _finish(run: Run, **result: Any) -> None:
    """End the run; the step saves it with everything else (`_save`)."""
    run_finish(run=run, save=False, **result)


def _transition(run: Run, *, status: RunStatus) -> None:
    run_transition(run=run, status=status, save=False)


def _this_week(today: date) -> tuple[str, str]:
    monday = today - timedelta(days=today.weekday())
    return monday.isoformat(), (monday + timedelta(days=6)).isoformat()


# The weeks a message may name (seed 000 reads "本周" as the date range), by how many weeks
# before this one they are; None for a week further back, which the user is asked about. A
# message that names none means this week. 上 ends words of its own (附上 attach, 加上 add,
# 带上 bring, ...): "附上上周" is "attach last week", not the week before last. "Two weeks
# ago" is left alone: it dates other things as often ("the project we started two weeks ago").
_ENDS_IN_上 = "附加带补跟马早晚线以之"
_WEEK = r"一?个?(?:周|星期|礼拜)"
_WEEKS_NAMED = (
    (None, re.compile(rf"上上上+{_WEEK}")),
    (
        2,
        re.compile(
            rf"(?<![{_ENDS_IN_上}])上上{_WEEK}|\bthe week before (?:last|the previous week)\b",
            re.IGNORECASE,
        ),
    ),
    (
        1,
        re.compile(
            rf"(?:(?<!上)|(?<=[{_ENDS_IN_上}]上))上{_WEEK}"
            r"|\b(?<!before )(?<!before the )(?:last|previous) week(?:end)?\b",
            re.IGNORECASE,
        ),
    ),
    (0, re.compile(rf"本周|这{_WEEK}|\bthis week\b", re.IGNORECASE)),
)


def _date_range(run: Run) -> tuple[str | None, str | None]:
    """The first and last day of the week the message names; (None, None) when it names more
    than one, or one further back than the week before last, which the user is asked to
    settle. Full-width letters and the traditional 週 read as their plain forms."""
    text = unicodedata.normalize("NFKC", _message_text(run.message)).replace("週", "周")
    named = {weeks for weeks, pattern in _WEEKS_NAMED if pattern.search(text)}
    if len(named) > 1 or None in named:
        return None, None
    weeks_before = named.pop() if named else 0
    return _this_week(timezone.localdate() - timedelta(weeks=weeks_before))


def _workflow(run: Run) -> Workflow:
    return WORKFLOWS.get(run.state.get("workflow", ""), AGENT)


def _node(run: Run) -> Node:
    return _workflow(run).nodes[run.state["node"]]


def _skill(run: Run) -> dict[str, Any] | None:
    """The skill in force: the one the current node loads (explicit workflow assembly), else
    the one the run was routed to, the first of its snapshot."""
    skills = run.capability.get("skills", [])
    node = _workflow(run).nodes.get(run.state.get("node", ""))
    if node is not None and node.skill:
        return next((skill for skill in skills if skill["name"] == node.skill_name), None)
    return skills[0] if skills else None


def _skill_version(run: Run) -> SkillVersion | None:
    """The snapshot's skill version (frozen content, read once per process); in an evaluation
    sandbox, the version under test, which may be a draft (read from the database)."""
    skill = _skill(run)
    if skill is None:
        return None
    frozen = versions_frozen(model=SkillVersion, ids=[skill["id"]]).get(skill["id"])
    if frozen is None and str(run.tenant.sandbox_skill_version_id) == skill["id"]:
        return SkillVersion.objects.select_related("skill").get(pk=skill["id"])
    return frozen


def _shown(version: SkillVersion | ToolVersion, field: str) -> Any:
    """A version's field as a model is sent it: with its credentials replaced. Content saved
    before such content was refused (`registry.schemas.credential_errors`) may hold them. Kept
    on the version: a released one is a copy read once per process (`versions_frozen`), so
    each of its fields is read once."""
    shown = version.__dict__.setdefault("_shown", {})
    if field not in shown:
        shown[field] = secrets_removed_within(getattr(version, field))
    return shown[field]


def _text(run: Run, resources: dict[tuple[str, str], str], attachments: dict[str, str]) -> str:
    """The user's message; an attachment as its reference, then what `attachments_read` read
    of it, wrapped as untrusted data; an MCP resource as what `resources_attach` read, wrapped
    too."""
    lines = []
    for part in run.message.get("message", {}).get("parts", []):
        if part["type"] == "text":
            lines.append(part["text"])
        elif part["type"] == RESOURCE_PART:
            lines.append(resources[resource_key(part)])
        else:
            lines.append(attachment_line(part))
            if part["id"] in attachments:
                lines.append(attachments[part["id"]])
    return "\n".join(lines)


def _message_text(message: dict[str, Any]) -> str:
    """What the user wrote: the message's text parts, without what it attached or referred to."""
    return " ".join(part["text"] for part in message["message"]["parts"] if part["type"] == "text")


@dataclass(frozen=True)
class _Referred:
    """A kind of input a message refers to rather than writes: the part type, the key of the
    history entry that names them, the noun that counts them, and the line that names one."""

    part_type: str
    key: str
    noun: str
    line: Callable[[dict[str, Any]], str]


_REFERRED = (
    _Referred(ATTACHMENT_PART, "attachments", "attachment", attachment_line),
    _Referred(RESOURCE_PART, "resources", "resource", resource_line),
)


def _referred_parts(message: dict[str, Any]) -> Iterator[tuple[_Referred, list[dict[str, Any]]]]:
    """Each kind of input the message referred to, with its parts (attachments first)."""
    parts = message["message"]["parts"]
    for kind in _REFERRED:
        if found := [part for part in parts if part["type"] == kind.part_type]:
            yield kind, found


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _history_referred(message: dict[str, Any]) -> dict[str, list[str]]:
    """An earlier message's referred inputs (its attachments, its MCP resources) by the
    reference lines that name them: the platform's record of an attachment (id, media type,
    size, digest, never the uploader's file name), a resource's URI and media type as its
    server listed them. Of each kind the first HISTORY_REFERRED, then how many more. Their
    content is read only in their own run: a later run is told they exist, so the model can
    ask for them again. The lines are data of the user's turn, like the message itself."""
    referred = {}
    for kind, parts in _referred_parts(message):
        lines = [kind.line(part) for part in parts[:HISTORY_REFERRED]]
        if (more := len(parts) - HISTORY_REFERRED) > 0:
            lines.append(f"(+{_counted(more, f'more {kind.noun}')})")
        referred[kind.key] = lines
    return referred


def _summary_line(entry: dict[str, Any]) -> str:
    """An older run in the rolling summary: the start of its message, how many of each kind
    of input it referred to, how it ended."""
    counts = ", ".join(
        f"+{_counted(len(parts), kind.noun)}" for kind, parts in _referred_parts(entry["message"])
    )
    referred = f" ({counts})" if counts else ""
    return f"{_message_text(entry['message'])[:SUMMARY_CHARS]}{referred} -> {entry['status']}"


_EARLIER_RUNS = PreparedQuery(
    lambda session_id, before: (
        Run.objects.filter(session_id=session_id, created_at__lt=before)
        .order_by("-created_at")
        .values(
            "id",
            "created_at",
            "message",
            "status",
            "reason_code",
            question=KT("result__question"),
            answer=KT("result__output__answer"),
            data_scope=KT("capability__data_scope__max_data_classification"),
        )[: HISTORY_RUNS + SUMMARY_RUNS]
    ),
    session_id=UUID,
    before=datetime,
)


def _history(run: Run) -> list[dict[str, Any]]:
    """The session's earlier messages and how their runs ended, newest last: the last
    HISTORY_RUNS as they were (with the attachments and resources each message referred
    to), and before them a rolling summary of up to SUMMARY_RUNS older ones (counting those),
    marked with when it was generated and which runs it covers. A session its run's
    ingest created (written in the same statement, after the run's row took its time) has no
    earlier run to read. What an earlier run said back is left out when that run could read
    data above this run's scope (another agent's policy): it may quote such data."""
    if run.session.created_at >= run.created_at:
        return []
    scope = run.capability["data_scope"]["max_data_classification"]
    readable = DATA_CLASSIFICATION_LEVELS[: DATA_CLASSIFICATION_LEVELS.index(scope) + 1]
    earlier = _EARLIER_RUNS(session_id=run.session_id, before=run.created_at)
    recent, older = earlier[:HISTORY_RUNS], earlier[HISTORY_RUNS:]
    history: list[dict[str, Any]] = []
    if older:
        oldest, newest = older[-1], older[0]
        history.append(
            {
                "summary": "; ".join(_summary_line(entry) for entry in reversed(older)),
                "generated_at": timezone.now().isoformat(),
                "source": {
                    "runs": len(older),
                    "from_run": str(oldest["id"]),
                    "from": oldest["created_at"].isoformat(),
                    "to_run": str(newest["id"]),
                    "to": newest["created_at"].isoformat(),
                },
            }
        )
    return history + [
        {
            "message": _message_text(entry["message"]),
            **_history_referred(entry["message"]),
            "status": entry["status"],
            "reason_code": entry["reason_code"],
            **(
                {"reply": reply[:REPLY_CHARS]}
                if entry["data_scope"] in readable and (reply := _reply(entry))
                else {}
            ),
        }
        for entry in reversed(recent)
    ]


def _reply(entry: dict[str, Any]) -> str:
    """What an earlier run said back to the user: the question it asked, or its answer,
    without the credentials it may hold: it is the model's text, stored as written and shown
    to people without them, and the message it answered lost its own at the ingress. They go
    before the cut, since a key cut in half is no longer recognised."""
    for text in (entry["question"], entry["answer"]):
        if isinstance(text, str) and text.strip():
            return secrets_removed(text)
    return ""


def _node_tools(run: Run, node: Node) -> list[ToolVersion]:
    """Gate 1's allowlist: for a node the model drives, the activated skill's pinned tools
    that it names (the generic agent's node names none and gets all of them); for a node the
    host runs, the snapshot's tools that it names; any other node without tools gets none.
    Before approval (every node but one that may have side effects) only reads.
    Versions are immutable, so one lookup per node serves the whole step."""
    cache = run.__dict__.setdefault("_node_tools", {})
    if node.name not in cache:
        cache[node.name] = _load_node_tools(run, node)
    return cache[node.name]


def _load_node_tools(run: Run, node: Node) -> list[ToolVersion]:
    entries = run.capability.get("tools", [])
    if _skill_holds_tools(node):
        skill = _skill(run)
        pinned = frozenset(skill["tools"]) if skill else frozenset()
        entries = [entry for entry in entries if entry["name"] in pinned]
    if node.tools:
        entries = [entry for entry in entries if entry["name"] in node.tools]
    elif _workflow(run) is not AGENT:
        return []
    versions = versions_frozen(model=ToolVersion, ids=[entry["id"] for entry in entries])
    found = [versions[entry["id"]] for entry in entries if entry["id"] in versions]
    return [tool for tool in found if node.side_effects or tool.risk in READ_RISKS]


def _skill_holds_tools(node: Node) -> bool:
    """Whether gate 1 holds this node to the tools the skill in force pinned: a node the
    model drives (a tool another skill of the snapshot pinned is not the model's there). A
    node the host runs uses the tools the workflow names, from the snapshot."""
    return node.model_driven


def _effective_node(run: Run) -> Node:
    """The node with gate 1's allowlist spelled out: for a node the model drives, the tools
    it names that the skill in force pinned, or, for the generic agent, its read tools; a
    node the host runs, as the workflow names it. Gate 4 holds the risk of each."""
    node = _node(run)
    if node.tools and _skill_holds_tools(node):
        skill = _skill(run)
        return replace(node, tools=node.tools & frozenset(skill["tools"] if skill else ()))
    if node.tools or _workflow(run) is not AGENT:
        return node
    return replace(node, tools=frozenset(tool.tool.name for tool in _node_tools(run, node)))


def _merged_rules(
    workflow_rules: tuple[Rule, ...], *skill_versions: SkillVersion | None
) -> MergedRules:
    """The rules in force under these skill versions. Given every skill a run activates, the
    merge also finds the rules two of them bind differently under one id: they share the
    skill layer, so neither yields to the other."""
    skill_rules = tuple(
        Rule(id=rule["id"], scope=rule["scope"], priority=rule["priority"], text=rule["text"])
        for skill_version in skill_versions
        if skill_version is not None
        for rule in _shown(skill_version, "rules")
    )
    return merge_rules(
        {
            "platform": PLATFORM_RULES,
            "application": APPLICATION_RULES,
            "workflow": workflow_rules,
            "skill": skill_rules,
        }
    )


def _start(run: Run) -> None:
    """Route, activate the skill, merge its rules, gather the inputs, assemble the tools."""
    run.started_at = timezone.now()
    _route_and_assemble(run)
    tracing.span_add(
        run,
        "routing",
        started_at=run.started_at,
        workflow=run.state.get("workflow", ""),
        skill=run.skill,
        outcome=run.status,
    )


def _is_task(run: Run) -> bool:
    """A scheduled task's run: its message and metadata were written by the server
    (`runs.services.scheduler`), since clients cannot post on the task channel."""
    return run.channel == Channel.TASK


def _answer_how(run: Run, *, in_chat: str, in_task: str) -> str:
    """How the user answers a question the host asks: in a new message of the session; for
    a scheduled task's run, by changing the task, since a message in its session is a run of
    its own and changes neither the task's project nor its recipient."""
    return in_task if _is_task(run) else in_chat


def _session_state(run: Run) -> dict[str, Any]:
    """What the session remembers. A task's project and recipient are fixed by the task, so
    its run reads nothing from a session, whatever was said there."""
    if _is_task(run):
        return {}
    return run.session.state


def _route_and_assemble(run: Run) -> None:
    _transition(run, status=RunStatus.RUNNING)
    skill = _skill(run)
    workflow_key = skill.get("workflow", "") if skill else ""
    if workflow_key and workflow_key not in WORKFLOWS:
        # The skill version was published for a workflow this deployment no longer defines:
        # no other procedure runs it, the generic agent's included.
        _finish(
            run,
            status=RunStatus.REFUSED,
            reason_code="WORKFLOW_NOT_AVAILABLE",
            output={"workflow": workflow_key},
        )
        return
    workflow = WORKFLOWS.get(workflow_key, AGENT)
    skill_version = _skill_version(run)
    metadata = run.message.get("metadata", {})
    session_state = _session_state(run)
    date_from, date_to = _date_range(run)
    inputs = {
        "project_id": metadata.get("project_id") or session_state.get("project_id"),
        "date_from": date_from,
        "date_to": date_to,
        "recipient_role": RECIPIENT_ROLE,
    }
    route = route_decide(
        capability=run.capability,
        skill=skill,
        required_inputs=skill_version.required_inputs if skill_version else [],
        workflow=workflow,
        inputs=inputs,
    )
    events.route_selected(run, decision=route)
    workflow_rules = tuple(rule for node in workflow.nodes.values() for rule in node.rules)
    merged = _merged_rules(workflow_rules, skill_version)
    if skill_version is not None:
        events.skill_activated(
            run,
            skill=skill_version.qualified_name,
            skill_version_id=str(skill_version.pk),
            rules=merged.adopted(),
            overridden=list(merged.overridden),
        )
    run.state = {
        "workflow": workflow.key,
        "node": workflow.start,
        "phase": "model",
        "inputs": inputs,
        "confirmed_recipient": _confirmed_recipient(session_state, inputs),
        "corrections": 0,
        "history": _history(run),
    }
    loaded = {node.skill_name for node in workflow.nodes.values() if node.skill}
    ambiguous = {
        entry["skill"]: entry["candidates"]
        for entry in run.capability.get("excluded", [])
        if entry.get("reason") == "AMBIGUOUS"
    }
    if ambiguous:
        _finish(
            run,
            status=RunStatus.REFUSED,
            reason_code="WORKFLOW_SKILL_AMBIGUOUS",
            output={"skills": ambiguous},
        )
        return
    # The first entry of a name, as `_skill` activates it: a later one of the same name (a
    # granted platform skill bound beside the tenant's own) is never activated.
    snapshot: dict[str, dict[str, Any]] = {}
    for entry in run.capability.get("skills", []):
        snapshot.setdefault(entry["name"], entry)
    if loaded - set(snapshot):
        _finish(
            run,
            status=RunStatus.REFUSED,
            reason_code="WORKFLOW_SKILL_UNAVAILABLE",
            output={"skills": sorted(loaded - set(snapshot))},
        )
        return
    node_skill_versions = versions_frozen(
        model=SkillVersion, ids=[snapshot[name]["id"] for name in loaded]
    )
    activated = [
        skill_version,
        *(version for version in node_skill_versions.values() if version != skill_version),
    ]
    conflicts = _merged_rules(workflow_rules, *activated).conflicts
    if conflicts:
        _finish(
            run,
            status=RunStatus.REFUSED,
            reason_code="RULE_CONFLICT",
            output={"conflicting_rules": list(conflicts)},
        )
        return
    if route["mode"] == HUMAN_QUEUE:
        _follow_named_project(run)
        handoff = handoff_open(
            run=run, risks=route["for_people"], request=_message_text(run.message)
        )
        run.result = {
            "status": RunStatus.WAITING_APPROVAL,
            "handoff": {"id": str(handoff.pk)},
            "next_step": "A person handles this request; the run ends with their note.",
        }
        _transition(run, status=RunStatus.WAITING_APPROVAL)
        return
    if skill is None and no_skill_clarifies(run.capability):
        _ask(
            run,
            reason_code="NO_SKILL_MATCHED",
            question="Which task should I do? Say what you need (for example which report, "
            "for which project) in other words.",
        )
        return
    required = set(skill_version.required_inputs if skill_version else [])
    for required_input, key, reason_code, question, in_chat, in_task in UNREAD_INPUT_QUESTIONS:
        if required_input in required and not run.state["inputs"][key]:
            how = _answer_how(run, in_chat=in_chat, in_task=in_task)
            _ask(run, reason_code=reason_code, question=f"{question} {how}")
            return
    if MEMORY_INPUT in required:
        run.state["memory"] = memory_retrieve(
            tenant=run.tenant,
            user=run.actor,
            purpose=skill["name"] if skill else "any",
            max_sensitivity=run.capability["data_scope"]["max_data_classification"],
        )
    parts = run.message.get("message", {}).get("parts", [])
    read = sum(part["type"] == RESOURCE_PART or attachment_is_read(part) for part in parts)
    tokens = tokens_each(parts, read=read)
    run.transcript = [
        user_entry(
            _text(run, resources_attach(run, tokens=tokens), attachments_read(run, tokens=tokens))
        )
    ]
    _enter_node(run, workflow.start, leaving=skill)


def _follow_named_project(run: Run) -> None:
    """Make the project this message named the session's, for a run that ends waiting on the
    user or on people rather than going on: the user's next message may name no project, and
    it is about the project this one named, as it is when a run goes on."""
    if project_id := run.message.get("metadata", {}).get("project_id"):
        _remember(run, project_id=project_id)


def _ask(run: Run, *, reason_code: str, question: str) -> None:
    """End the run asking the user `question`, which they answer in the session's next
    message (`_follow_named_project`)."""
    _follow_named_project(run)
    _finish(run, status=RunStatus.NEEDS_CLARIFICATION, reason_code=reason_code, question=question)


def _enter_node(run: Run, name: str, *, leaving: dict[str, Any] | None) -> None:
    """Move to node `name` from a node whose skill in force was `leaving`: a node that loads
    another skill activates it."""
    run.state["node"] = name
    run.state["phase"] = "model"
    entered = _skill(run)
    if entered is not None and (leaving is None or entered["id"] != leaving["id"]):
        merged = _merged_rules(_node(run).rules, _skill_version(run))
        events.skill_activated(
            run,
            skill=f"{entered['name']}@{entered['version']}",
            skill_version_id=entered["id"],
            rules=merged.adopted(),
            overridden=list(merged.overridden),
            node=name,
        )
    _tools_assemble(run, _effective_node(run), executor.tools_withdrawn(run))


def _withdrawn_names(run: Run, withdrawn: frozenset[str]) -> list[str]:
    return sorted(
        f"{entry['name']}@{entry['version']}"
        for entry in run.capability.get("tools", [])
        if entry["id"] in withdrawn
    )


def _tools_assemble(run: Run, node: Node, withdrawn: frozenset[str]) -> None:
    """Record what the model is offered in `node`, and which of the snapshot's tool versions
    were `withdrawn` since the run started; the state keeps their names, so that a model turn
    records the tools again only when a withdrawal (or a grant given back) changed them."""
    allowed = sorted(tool.qualified_name for tool in _offered_tools(run, node, withdrawn))
    withdrawn_names = _withdrawn_names(run, withdrawn)
    deferred = sorted(
        {f"{entry['name']}@{entry['version']}" for entry in run.capability.get("tools", [])}
        - set(allowed)
        - set(withdrawn_names)
    )
    if withdrawn_names or run.state.get("tools_withdrawn"):
        # Granted again, a version is offered again, as its gate lets it through again.
        run.state["tools_withdrawn"] = withdrawn_names
    events.tools_assembled(
        run, node=node.name, allowlist=allowed, deferred=deferred, withdrawn=withdrawn_names
    )


def _remember(
    run: Run,
    *,
    project_id: str | None = None,
    recipient: dict | None = None,
    draft: dict | None = None,
) -> None:
    """Session state is the one authoritative copy: the project a run of the session last
    went on with, asked the user about or left to people (a run that uses it checks the
    actor's access to it again, gate 3), the recipient they confirmed (with its expiry) and
    the latest drafts. On PostgreSQL one UPDATE, written with the step (`runs.writes`), merges
    them into the session's current state (keys it does not name are kept, a malformed drafts
    value is replaced), where a locked read and a save would cost two round trips."""
    values = {
        key: value for key, value in (("project_id", project_id), ("recipient", recipient)) if value
    }
    if connection.vendor != "postgresql":
        session = Session.objects.select_for_update().get(pk=run.session_id)
        session.state.update(values)
        if draft:
            session.state["drafts"] = [*session.state.get("drafts", []), draft][-DRAFTS_KEPT:]
        session.save(update_fields=["state", "updated_at"])
        return
    state = "state || %s::jsonb"
    params: list[Any] = [timezone.now(), json.dumps(values)]
    if draft:
        state = (
            f"jsonb_set({state}, '{{drafts}}', (SELECT coalesce(jsonb_agg(kept.value ORDER BY "
            "kept.ordinality), '[]'::jsonb) FROM (SELECT value, ordinality FROM "
            "jsonb_array_elements(CASE jsonb_typeof(state->'drafts') WHEN 'array' THEN "
            "state->'drafts' ELSE '[]'::jsonb END || %s::jsonb) WITH ORDINALITY "
            "ORDER BY ordinality DESC LIMIT %s) AS kept))"
        )
        params += [json.dumps([draft]), DRAFTS_KEPT]
    writes.add_statement(
        run,
        f"UPDATE {Session._meta.db_table} SET updated_at = %s, state = {state} WHERE id = %s",
        [*params, run.session_id],
    )


def _confirmed_recipient(session_state: dict, inputs: dict) -> dict | None:
    """The recipient the user confirmed in this session for this project and role, if that
    confirmation has not expired (seed 000, step 3); the directory is asked otherwise."""
    confirmed = session_state.get("recipient")
    if (
        not isinstance(confirmed, dict)
        or confirmed.get("project_id") != inputs["project_id"]
        or confirmed.get("role") != inputs["recipient_role"]
        or confirmed.get("expires_at", "") <= timezone.now().isoformat()
    ):
        return None
    return confirmed["snapshot"]


def _recipient_choice(run: Run, candidates: list[dict]) -> dict | None:
    """The candidate the message names (`metadata.recipient_record_id`), if it has an email:
    the user's choice in a chat, the task's frozen recipient in a task's run."""
    chosen = run.message.get("metadata", {}).get("recipient_record_id")
    return next(
        (
            candidate
            for candidate in candidates
            if chosen and candidate["record_id"] == chosen and candidate.get("corporate_email")
        ),
        None,
    )


def _recipient_question(run: Run, *, frozen: Any, reachable: bool) -> str:
    """What the user is asked when the directory gives no one recipient: whom to choose, or,
    when no candidate has an email, that no choice can help."""
    inputs = run.state["inputs"]
    role, project = inputs["recipient_role"], inputs["project_id"]
    if not reachable:
        then = _answer_how(
            run,
            in_chat=", then send the message again.",
            in_task="; the task's next occurrence finds it.",
        )
        return (
            f"No {role} of project {project} has a corporate email in the directory, so the "
            f"summary cannot be sent to them. Ask the directory's owners to add one{then}"
        )
    named = (
        f"Directory record {frozen} is not a {role} of project {project} with an email. "
        if frozen
        else ""
    )
    how = _answer_how(
        run,
        in_chat="Send the message again in this session with metadata.recipient_record_id set "
        "to one of the candidates that has an email.",
        in_task="Change the task's recipient to one of the candidates that has an email.",
    )
    return f"{named}Who should receive the summary? {how}"


def _snapshot_tool_usable(run: Run, name: str) -> bool:
    """Whether the run's snapshot holds the tool `name` in a version neither revoked nor
    withdrawn from the tenant since (gates 1 and 2 would let a call of it through)."""
    entry = executor.snapshot_tool(run, name)
    return entry is not None and entry["id"] not in executor.tools_withdrawn(run)


def _directory_failed(run: Run, *, category: str, retryable: bool) -> None:
    """End the run whose recipient lookup, or its check alone, did not pass for `category`:
    refused a project out of the actor's reach, else failed, retryably when another try may
    pass."""
    if category == ErrorCategory.PERMISSION_DENIED:
        _finish(run, status=RunStatus.REFUSED, reason_code="PROJECT_ACCESS_DENIED")
    elif retryable:
        _finish(run, status=RunStatus.FAILED_RETRYABLE, reason_code=f"DIRECTORY_{category}")
    else:
        _finish(run, status=RunStatus.FAILED_FINAL, reason_code=f"DIRECTORY_{category}")


def _resolve_recipient(run: Run, made: executor.CallsMade) -> None:
    """The workflow, not the model, finds the recipient: a confirmation still valid in the
    session (unless the message chooses another), else the directory (exactly one active
    record with a corporate email, or the one the user chose among several), else the user
    is asked."""
    node = _node(run)
    inputs = run.state["inputs"]
    next_node = _workflow(run).transitions[node.name][0]
    confirmed = run.state.get("confirmed_recipient")
    chosen = run.message.get("metadata", {}).get("recipient_record_id")
    call = ToolCall(
        call_id=f"{HOST_CALL_PREFIX}recipient",
        name="directory_lookup",
        arguments={"project_id": inputs["project_id"], "role": inputs["recipient_role"]},
    )
    if confirmed is not None and chosen in (None, confirmed.get("record_id")):
        # The directory is not asked again, but the tool must still be the run's and the
        # project within the actor's reach, as the lookup's own gates would find.
        if not _snapshot_tool_usable(run, call.name):
            _finish(run, status=RunStatus.REFUSED, reason_code="DIRECTORY_TOOL_NOT_AVAILABLE")
            return
        refusal = executor.host_refusal(run=run, call=call, deadline=_calls_deadline(run))
        if refusal is not None:
            if (reason := _budget_overrun(run)) is not None:
                # The run's time ran out under the check, not the directory.
                _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code=reason)
                return
            _directory_failed(
                run,
                category=refusal.category,
                retryable=isinstance(refusal, ToolFailed) and refusal.retryable,
            )
            return
        run.state["recipient"] = {**confirmed, "confirmed": True}
        _remember(run, project_id=inputs["project_id"])
        _enter_node(run, next_node, leaving=_skill(run))
        return
    outcome = executor.calls_run(
        run=run,
        calls=[call],
        node=node,
        step=run.steps,
        deadline=_calls_deadline(run),
        made=made,
    )[0]
    envelope = outcome.envelope
    if outcome.status != ToolCallRecord.Status.COMPLETED:
        if (reason := _budget_overrun(run)) is not None:
            # The run's time ran out under the lookup (`_calls_deadline`), not the directory.
            _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code=reason)
            return
        category = (envelope.get("error") or {}).get("category", "UNKNOWN")
        if outcome.status == ToolCallRecord.Status.REJECTED and not _snapshot_tool_usable(
            run, call.name
        ):
            # Asking again cannot help: only a new grant or version of the directory can.
            _finish(run, status=RunStatus.REFUSED, reason_code="DIRECTORY_TOOL_NOT_AVAILABLE")
        else:
            _directory_failed(
                run, category=category, retryable=executor.unavailable_for_a_while(outcome)
            )
        return
    candidates = (envelope.get("raw") or {}).get("candidates", [])
    now = timezone.now()
    chosen = _recipient_choice(run, candidates)
    frozen = run.message.get("metadata", {}).get("recipient_record_id")
    reachable = [candidate for candidate in candidates if candidate.get("corporate_email")]
    if chosen is None and frozen and _is_task(run):
        _remember(run, project_id=inputs["project_id"])
        _finish(
            run,
            status=RunStatus.NEEDS_CLARIFICATION,
            reason_code="TASK_RECIPIENT_UNAVAILABLE",
            question=f"The task's recipient, directory record {frozen}, is no longer an "
            f"active {inputs['recipient_role']} of project {inputs['project_id']} with an "
            "email. Which record should receive it? Change the task's recipient.",
        )
        return
    # A choice the user named that is no candidate with an email is asked again, even where
    # the directory has one lead: the user meant someone, and it was not that lead.
    if chosen is None and (frozen or len(candidates) != 1 or not reachable):
        _remember(run, project_id=inputs["project_id"])
        _finish(
            run,
            status=RunStatus.NEEDS_CLARIFICATION,
            reason_code="RECIPIENT_NOT_UNIQUE_OR_EMAIL_MISSING",
            output={
                "candidates": [
                    {
                        "record_id": candidate["record_id"],
                        "display_name": candidate["display_name"],
                        "has_email": bool(candidate.get("corporate_email")),
                    }
                    for candidate in candidates
                ]
            },
            question=_recipient_question(run, frozen=frozen, reachable=bool(reachable)),
        )
        return
    snapshot = {**(chosen or candidates[0]), "looked_up_at": now.isoformat()}
    run.state["recipient"] = {**snapshot, "confirmed": chosen is not None}
    confirmation = None
    if chosen is not None:
        confirmation = {
            "project_id": inputs["project_id"],
            "role": inputs["recipient_role"],
            "snapshot": snapshot,
            "confirmed_at": now.isoformat(),
            "expires_at": (
                now + timedelta(seconds=settings.RECIPIENT_CONFIRMATION_SECONDS)
            ).isoformat(),
        }
    _remember(run, project_id=inputs["project_id"], recipient=confirmation)
    _enter_node(run, next_node, leaving=_skill(run))


def _offered_tools(run: Run, node: Node, withdrawn: frozenset[str]) -> list[ToolVersion]:
    """Gate 1's allowlist without the versions `withdrawn` since the run started: the model is
    not offered what gate 1 would let through only for the call to be rejected (a model that
    names one anyway still is)."""
    tools = _node_tools(run, node)
    return [tool for tool in tools if str(tool.pk) not in withdrawn] if withdrawn else tools


def _tool_specs(run: Run, node: Node, withdrawn: frozenset[str]) -> list[ToolSpec]:
    """The tools as the model sees them; an evaluation sandbox may show other descriptions
    (an attack hidden in a tool's description)."""
    tenant = run.tenant
    shown = tenant.sandbox_settings.get("tool_descriptions", {}) if tenant.sandbox_of_id else {}
    return [
        ToolSpec(
            name=tool.tool.name,
            description=secrets_removed(shown[tool.tool.name])
            if shown.get(tool.tool.name)
            else "\n".join(
                filter(
                    None,
                    [_shown(tool, name) for name in ("description", "when_not_to_use", "returns")],
                )
            ),
            input_schema=_shown(tool, "input_schema"),
        )
        for tool in sorted(_offered_tools(run, node, withdrawn), key=lambda tool: tool.tool.name)
    ]


_MODEL_CONFIG = PreparedQuery(
    lambda model_id: ModelConfig.objects.filter(pk=model_id).order_by()[:1], model_id=int
)


def _model_config(run: Run, model_configs: dict[int, ModelConfig]) -> ModelConfig:
    """The model the snapshot pinned, even if the agent has moved to another since; read
    once per execution (`run_execute`), not once per turn, and kept in the process while
    the registry's generation read with the run stays the same (`registry.generation`)."""
    model_id = run.capability["model"]["id"]
    if model_id not in model_configs:
        model_config = registry_cached(
            getattr(run, "registry_generation", None),
            ("model", model_id),
            lambda: _MODEL_CONFIG.first(model_id=model_id),
        )
        if model_config is None:
            raise ModelConfig.DoesNotExist(f"No model config {model_id}.")
        model_configs[model_id] = model_config
    return model_configs[model_id]


class Prices(NamedTuple):
    """A run's prices per 1k tokens: input, and of it the tokens read from the provider's
    prompt cache and those written to it, and output."""

    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    output: Decimal


def _prices(run: Run, model_config: ModelConfig) -> Prices:
    """The prices the run pays: those its snapshot pinned at its start, whatever an admin has
    set on the model config since; a run started before snapshots pinned them pays the
    config's current prices, and one started before they pinned a cached or a cache write
    price pays the input price for those tokens, as it did."""
    pinned = run.capability["model"]
    if "price_per_1k_input" not in pinned:
        per_1k_input, per_1k_cached, per_1k_cache_write, per_1k_output = (
            model_config.price_per_1k_input,
            model_config.price_per_1k_cached_input,
            model_config.price_per_1k_cache_write,
            model_config.price_per_1k_output,
        )
    else:
        per_1k_input, per_1k_cached, per_1k_cache_write, per_1k_output = (
            Decimal(pinned["price_per_1k_input"]),
            pinned.get("price_per_1k_cached_input"),
            pinned.get("price_per_1k_cache_write"),
            Decimal(pinned["price_per_1k_output"]),
        )
    return Prices(
        input=per_1k_input,
        cached_input=per_1k_input if per_1k_cached is None else Decimal(per_1k_cached),
        cache_write=per_1k_input if per_1k_cache_write is None else Decimal(per_1k_cache_write),
        output=per_1k_output,
    )


def _cost(prices: Prices, usage: Usage) -> Decimal:
    """What a turn of `usage` costs: its input tokens read from the prompt cache at the
    cached price, those written to it at the cache write price, the rest of its input at the
    input price."""
    uncached = usage.input_tokens - usage.cached_input_tokens - usage.cache_write_input_tokens
    return (
        prices.input * uncached
        + prices.cached_input * usage.cached_input_tokens
        + prices.cache_write * usage.cache_write_input_tokens
        + prices.output * usage.output_tokens
    ) / 1000


def _tokens(usage: Usage) -> dict[str, int]:
    """A turn's tokens as `model.responded` records them, reported or counted."""
    return {
        "input": usage.input_tokens,
        "cached_input": usage.cached_input_tokens,
        "cache_write_input": usage.cache_write_input_tokens,
        "output": usage.output_tokens,
    }


def _spend(run: Run, prices: Prices, usage: Usage) -> Decimal:
    """Count a turn's tokens and cost on the run and the tenant's day; returns the cost.
    However much a provider claims, the totals stay within their columns; the budgets end
    the run long before."""
    cost = _cost(prices, usage)
    quotas.tenant_cost_add(quotas.payer_id(run.tenant), cost)
    run.tokens_used = min(
        run.tokens_used + usage.input_tokens + usage.output_tokens, TOKENS_USED_MAX
    )
    run.cost = min(run.cost + cost, COST_MAX)
    return cost


def _turn_unaffordable(
    run: Run, prices: Prices, input_tokens: int, *, tokens_left: int
) -> str | None:
    """Whether the next turn's context alone would spend what the run's token or cost budget
    has left (`tokens_left`: the tokens left once it is sent), leaving nothing for an answer
    that costs: such a turn is not sent, since the run could not use its answer, and the
    provider would be paid for it all the same (a cost budget of 0 thus pays for no turn of a
    priced model)."""
    if tokens_left <= 0:
        return "TOKEN_BUDGET"
    budgets = run.capability["budgets"]
    cost_left = Decimal(budgets["max_cost"]) - run.cost - _cost(prices, Usage(input_tokens))
    if cost_left < 0 or (cost_left == 0 and any(prices)):
        return "COST_BUDGET"
    return None


def _model_turn(run: Run, model_config: ModelConfig) -> None:
    pinned = run.capability["model"]
    if not model_config.is_active:
        # An admin switched the model off since the run started: no run asks it any more.
        _finish(
            run,
            status=RunStatus.FAILED_FINAL,
            reason_code="MODEL_CONFIG_INACTIVE",
            output={"model_config": model_config.name},
        )
        return
    if (model_config.provider, model_config.model_name) != (pinned["provider"], pinned["model"]):
        # The config was edited in place since the run started: the snapshot's model is no
        # longer what it calls, and the run never asks another.
        _finish(
            run,
            status=RunStatus.FAILED_FINAL,
            reason_code="MODEL_CONFIG_CHANGED",
            output={
                "pinned": {"provider": pinned["provider"], "model": pinned["model"]},
                "now": {"provider": model_config.provider, "model": model_config.model_name},
            },
        )
        return
    try:
        client = model_client_for(model_config, within_s=_calls_deadline(run) - time.monotonic())
    except ModelError as error:
        # A credential not set or not granted, a bad setting: wrong until an operator fixes
        # it, so no retry; nothing was asked of the provider.
        _finish(
            run,
            status=RunStatus.FAILED_FINAL,
            reason_code="MODEL_ERROR",
            output=model_error_output(error),
        )
        return
    context_started = timezone.now()
    node = _effective_node(run)
    withdrawn = executor.tools_withdrawn(run)
    if _withdrawn_names(run, withdrawn) != run.state.get("tools_withdrawn", []):
        # A version was withdrawn (or granted again) since the tools were last recorded: the
        # record says what this turn offers.
        _tools_assemble(run, node, withdrawn)
    skill = _skill(run)
    skill_version = _skill_version(run)
    merged = _merged_rules(node.rules, skill_version)
    built = context_build(
        run_state=run.state,
        transcript=run.transcript,
        node=node,
        merged_rules=merged,
        skill=skill,
        skill_instructions=_shown(skill_version, "instructions") if skill_version else "",
        tools=_tool_specs(run, node, withdrawn),
        output_contract=_shown(skill_version, "output_contract") if skill_version else {},
        examples=_shown(skill_version, "examples") if skill_version else [],
    )
    # What the context builder counted is what the turn sends (and what a provider that
    # reports no usage is charged with).
    input_estimate = sum(section.get("tokens", 0) for section in built.sections.values())
    tokens_left = run.capability["budgets"]["max_tokens"] - run.tokens_used - input_estimate
    prices = _prices(run, model_config)
    turn_not_made = {"turn_not_made": {"input_tokens": input_estimate}}
    reason = _turn_unaffordable(run, prices, input_estimate, tokens_left=tokens_left)
    if reason is not None:
        _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code=reason, output=turn_not_made)
        return
    quota = quotas.tenant_quota_spent(run.tenant, turn_cost=_cost(prices, Usage(input_estimate)))
    if quota is not None:
        # As for the run's cost budget: the provider would be paid for a turn whose answer
        # the run could not pay for.
        _finish(
            run,
            status=RunStatus.BUDGET_EXHAUSTED,
            reason_code="TENANT_DAILY_COST_QUOTA",
            output=quota | turn_not_made,
        )
        return
    request = replace(
        built.request, max_output_tokens=min(built.request.max_output_tokens, tokens_left)
    )
    run.steps += 1
    events.context_built(run, step=run.steps, sections=built.sections, budget=built.budget)
    if built.budget["over_by"]:
        # What is never cut (the rules, the skill, the task, the tool schemas, the recipient,
        # the last turn's results) filled more than the budget: sizes only, never content.
        logger.warning(
            "run %s step %s: the context (%s tokens) exceeds CONTEXT_MAX_TOKENS (%s) by %s "
            "tokens in sections that are never cut",
            run.pk,
            run.steps,
            built.budget["tokens"],
            built.budget["max_tokens"],
            built.budget["over_by"],
        )
    model_started = timezone.now()
    tracing.span_add(
        run,
        "context",
        started_at=context_started,
        ended_at=model_started,
        step=run.steps,
        node=node.name,
        tokens={name: section.get("tokens", 0) for name, section in built.sections.items()},
    )
    events.model_requested(
        run, step=run.steps, model=model_config.model_name, offline=client.is_offline
    )
    if client.is_offline:
        logger.info("run %s step %s: the offline planner answers (no provider)", run.pk, run.steps)
    model = {"model": model_config.model_name, "provider": model_config.provider, "step": run.steps}
    try:
        answered = client.complete(request)
    except ModelError as error:
        if error.retryable:
            if _seconds_left(run) <= 0:
                # The run's time ran out under the call (`within_s`), not the provider's: no
                # retry could answer within it.
                _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code="TIME_BUDGET")
                return
            raise ModelTemporarilyUnavailable(error, run_id=str(run.pk)) from error
        usage = error.usage or Usage()
        cost = _spend(run, prices, usage)
        tracing.span_add(
            run,
            "model.turn",
            started_at=model_started,
            error=True,
            **model,
            error_category="MODEL_ERROR",
            input_tokens=usage.input_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            cache_write_input_tokens=usage.cache_write_input_tokens,
            output_tokens=usage.output_tokens,
            cost=str(cost),
        )
        _finish(
            run,
            status=RunStatus.FAILED_FINAL,
            reason_code="MODEL_ERROR",
            output=model_error_output(error),
        )
        return
    response = response_kept(answered)
    # A provider that reports no usage (0) is counted with the local estimate, which
    # `model.responded` says beside what it reported: of what the model sent, arguments too
    # large to keep included.
    counted = replace(
        response.usage,
        input_tokens=response.usage.input_tokens or input_estimate,
        output_tokens=response.usage.output_tokens
        or estimate_tokens(
            answered.text + "".join(jsontext.dumps(call.arguments) for call in answered.tool_calls)
        ),
    )
    estimated = [
        name
        for name, reported in (
            ("input", response.usage.input_tokens),
            ("output", response.usage.output_tokens),
        )
        if not reported
    ]
    cost = _spend(run, prices, counted)
    tracing.span_add(
        run,
        "model.turn",
        started_at=model_started,
        **model,
        # What a gateway or an alias chose for the model asked, as `model.responded` has it.
        response_model=response.model,
        input_tokens=response.usage.input_tokens,
        cached_input_tokens=response.usage.cached_input_tokens,
        cache_write_input_tokens=response.usage.cache_write_input_tokens,
        output_tokens=response.usage.output_tokens,
        # What the run counted and charged, as `model.responded` has it beside the above.
        counted_input_tokens=counted.input_tokens,
        counted_cached_input_tokens=counted.cached_input_tokens,
        counted_cache_write_input_tokens=counted.cache_write_input_tokens,
        counted_output_tokens=counted.output_tokens,
        estimated_tokens=estimated,
        cost=str(cost),
        tool_calls=len(response.tool_calls),
        stop_reason=response.stop_reason,
    )
    calls = calls_with_own_ids(response.tool_calls, transcript=run.transcript)
    run.transcript.append(assistant_entry(response.text, calls, response.reasoning))
    events.model_responded(
        run,
        step=run.steps,
        text=response.text,
        tool_calls=[
            {"call_id": call.call_id, "name": call.name, "arguments": call.arguments}
            | ({} if call is given else {"provider_call_id": given.call_id})
            for call, given in zip(calls, response.tool_calls, strict=True)
        ],
        usage=_tokens(response.usage),
        counted=_tokens(counted) | {"estimated": estimated},
        cost=str(cost),
        stop_reason=response.stop_reason,
        model=response.model,
    )
    if (reason := _budget_overrun(run)) is not None:
        _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code=reason)
        return
    if response.is_refused:
        # Asked again, the model or its filter would refuse again, and be paid again; what
        # the turn holds (in `model.responded`) is neither acted on nor shown as an answer.
        _finish(
            run,
            status=RunStatus.REFUSED,
            reason_code="MODEL_REFUSED",
            output={"stop_reason": response.stop_reason},
        )
        return
    if response.is_paused:
        # Continuing the turn takes the provider's own blocks back as they came, which the
        # transcript does not keep; its partial text is neither an answer nor a draft.
        _finish(
            run,
            status=RunStatus.FAILED_RETRYABLE,
            reason_code="MODEL_TURN_PAUSED",
            output={"stop_reason": response.stop_reason},
        )
        return
    if response.is_cut_off:
        _cut_off(
            run, calls, limit=request.max_output_tokens, model_limit=built.request.max_output_tokens
        )
        return
    if calls:
        run.state["phase"] = "tools"
        return
    _final(run, response.text)


def _cut_off(run: Run, calls: tuple[ToolCall, ...], *, limit: int, model_limit: int) -> None:
    """A turn the provider stopped at the output limit (`limit`) may end midway: its last
    word is neither an answer nor a draft, and its last call's arguments may be cut (sent as
    far as they went, or read whole by a gateway that parsed what came), so none of its
    `calls` is run; each is answered as not run. Where the run's token budget set the limit
    below the model's own (`model_limit`), the budget ran out; otherwise the model is told
    once to keep within the limit, and the run ends PARTIAL if it is cut off again."""
    for call in calls:
        run.transcript.append(
            result_entry(
                call_id=call.call_id,
                name=call.name,
                content=f"Not run: the turn was cut off at the output limit of {limit} tokens, "
                "so the call's arguments may be incomplete.",
                is_error=True,
            )
        )
    if limit < model_limit:
        _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code="TOKEN_BUDGET")
        return
    what, reason_code = (
        ("answer", "ANSWER_CONTRACT_NOT_MET")
        if _workflow(run) is AGENT
        else ("draft", "DRAFT_CONTRACT_NOT_MET")
    )
    problem = (
        f"The {what} was cut off at the output limit of {limit} tokens: it must fit within it."
    )
    _contract_missed(run, [problem], what=what, reason_code=reason_code)


def _citations_kept(draft: Any) -> Any:
    """The draft, each of its items citing its source as the run keeps that reference
    (`source_reference`): a tool's raw answer shows the model a long reference whole, and
    the Source, its envelope entry and its events hold it shortened. A citation of the whole
    reference is then one of the run's Source; any other reference stays unknown."""
    if not isinstance(draft, dict):
        return draft
    return draft | {
        name: [
            item | {"source": source_reference(item["source"])}
            if isinstance(item, dict) and isinstance(item.get("source"), str)
            else item
            for item in draft[name]
        ]
        for name in DRAFT_SECTIONS
        if isinstance(draft.get(name), list)
    }


def _draft_problems(draft: Any, known: set[str]) -> list[str]:
    if not isinstance(draft, dict):
        return ["The draft is not a JSON object."]
    problems = [
        f"Missing section {name}." if name not in draft else f"Section {name} is not a list."
        for name in DRAFT_SECTIONS
        if not isinstance(draft.get(name), list)
    ]
    risks = draft["risks"] if isinstance(draft.get("risks"), list) else []
    # The correction names a risk by its place: its text may be a tool's, and the correction
    # is a user turn (tool data reaches the model only as untrusted data).
    for index, risk in enumerate(risks, start=1):
        source = risk.get("source") if isinstance(risk, dict) else None
        if not isinstance(source, str) or source not in known:
            problems.append(f"Risk {index} has no source returned by a tool.")
    subject = draft.get("subject")
    if not isinstance(subject, str) or not subject.strip():
        problems.append("Missing subject: one line of text.")
    elif not one_line(subject):
        problems.append("The subject is one line of text.")
    if not isinstance(draft.get("body", ""), str):
        problems.append("The body is text.")
    if holds_secret(draft):
        # Named, never quoted: the correction is a turn the model reads back.
        problems.append("The draft holds a credential (a key, a token, a password): remove it.")
    return problems


_EVIDENCE_REFERENCES = PreparedQuery(
    lambda run_id: (
        Source.objects.filter(run_id=run_id, allowed_use=EVIDENCE_USE)
        .order_by()
        .values_list("reference", flat=True)
    ),
    run_id=UUID,
)


def _ended_unavailable(run: Run, **output: Any) -> bool:
    """End the run FAILED_RETRYABLE (EVIDENCE_UNAVAILABLE) if a tool call of it failed, or
    was turned away, in a way that may pass (a retry may reach the tool), with `output` and
    those tools; returns whether it did. The calls of the step under way count too: a turn
    that follows its tool turn in one step (`_turn_follows`) sees them before they are
    written."""
    failed = [ToolCallRecord.Status.FAILED, ToolCallRecord.Status.REJECTED]
    unavailable = sorted(
        {
            *run.tool_calls.filter(status__in=failed, envelope__retryable=True).values_list(
                "name", flat=True
            ),
            *(
                record.name
                for record in writes.pending(run, ToolCallRecord)
                if record.status in failed and record.envelope.get("retryable") is True
            ),
        }
    )
    if unavailable:
        _finish(
            run,
            status=RunStatus.FAILED_RETRYABLE,
            reason_code="EVIDENCE_UNAVAILABLE",
            output={**output, "unavailable_tools": unavailable},
        )
    return bool(unavailable)


# What of an agent's question the run keeps for the user.
QUESTION_CHARS = 1000


def _clarification(text: str) -> str | None:
    """The question of a last word that asks the user for an input its tools need
    (`{"clarification": "<question>"}`, as the generic node's finish says), if it is one."""
    try:
        answer = _json_value(text)
    except ValueError:
        return None
    if not isinstance(answer, dict) or set(answer) != {"clarification"}:
        return None
    question = answer["clarification"]
    if not isinstance(question, str) or not question.strip():
        return None
    return question.strip()[:QUESTION_CHARS]


def _agent_answer(run: Run, text: str) -> None:
    """The generic agent's last word. A question for an input its tools need ends the run
    NEEDS_CLARIFICATION. Otherwise it is the run's answer when the agent needed no tool or
    one of its calls returned a result that is not an error (`_tool_turn`). After calls that
    all failed or were refused, by the host or by the business (a tool's own refusal in a
    result), the answer rests on nothing its node asks for ("grounded in tool results"): the
    run fails, retryably when a tool was only unavailable for a while, and is PARTIAL
    otherwise; the answer stays in the result either way. The result names the failed tools
    of the run's snapshot and only counts calls of names it does not have: a name the model
    wrote is not repeated as if it were a tool. An empty last word answers nothing: the model
    is told so once, and the run ends PARTIAL (ANSWER_CONTRACT_NOT_MET) if it answers empty
    again, unless its calls all failed or were refused and a tool was only unavailable for a
    while: then it fails retryably, as with an answer."""
    results = [entry for entry in run.transcript if entry.get("kind") == "tool_result"]
    grounded = not results or not all(entry["is_error"] for entry in results)
    if not text.strip():
        if _corrected(run) and not grounded and _ended_unavailable(run):
            return
        _contract_missed(
            run, ["The answer is empty."], what="answer", reason_code="ANSWER_CONTRACT_NOT_MET"
        )
        return
    if (question := _clarification(text)) is not None:
        _finish(
            run,
            status=RunStatus.NEEDS_CLARIFICATION,
            reason_code="AGENT_NEEDS_INPUT",
            question=question,
        )
        return
    if grounded:
        _finish(run, status=RunStatus.COMPLETED, reason_code="ANSWERED", output={"answer": text})
        return
    if _ended_unavailable(run, answer=text):
        return
    granted = {entry["name"] for entry in run.capability.get("tools", [])}
    called = [entry["name"] for entry in results]
    _finish(
        run,
        status=RunStatus.PARTIAL,
        reason_code="NO_TOOL_RESULT",
        output={
            "answer": text,
            "failed_tools": sorted(granted.intersection(called)),
            "unknown_tool_calls": sum(name not in granted for name in called),
        },
    )


# A last word that is one Markdown code block, as models often write the JSON they are asked
# for: its content is the JSON (text around it, or a second block, makes it no JSON).
_FENCED = re.compile(r"\s*```(?:json)?[ \t]*\r?\n(.*)\r?\n[ \t]*```\s*", re.DOTALL | re.IGNORECASE)


def _json_value(text: str) -> Any:
    """The JSON value a last word holds: the text, or the one code block it is; ValueError
    when it holds none."""
    if (fenced := _FENCED.fullmatch(text)) is not None:
        text = fenced.group(1)
    return jsontext.loads_bounded(text)


def _final(run: Run, text: str) -> None:
    if _workflow(run) is AGENT:
        _agent_answer(run, text)
        return
    known = executor.known_rows(run)
    if known is not None:
        evidence = set(known.evidence)
    else:
        evidence = set(_EVIDENCE_REFERENCES(run_id=run.pk))
    evidence.update(
        source.reference
        for source in writes.pending(run, Source)
        if source.allowed_use == EVIDENCE_USE
    )
    if not evidence:
        if not _ended_unavailable(run):
            _finish(run, status=RunStatus.FAILED_FINAL, reason_code="NO_EVIDENCE")
        return
    try:
        draft = _json_value(text)
    except ValueError:
        draft = text
    draft = _citations_kept(draft)
    problems = _draft_problems(draft, evidence)
    if not problems:
        _await_approval(run, draft)
    else:
        _contract_missed(run, problems, what="draft", reason_code="DRAFT_CONTRACT_NOT_MET")


def _corrected(run: Run) -> bool:
    """Whether the model was told once already that its last word missed its contract."""
    return run.state["corrections"] >= 1


def _contract_missed(run: Run, problems: list[str], *, what: str, reason_code: str) -> None:
    """A last word (`what`: the draft, the answer) that misses its node's output contract:
    the model is told once what is wrong and gets another turn; missed again, the run ends
    PARTIAL with `reason_code` and the problems."""
    if _corrected(run):
        _finish(
            run,
            status=RunStatus.PARTIAL,
            reason_code=reason_code,
            output={"problems": problems},
        )
        return
    run.state["corrections"] += 1
    run.transcript.append(
        user_entry(f"The {what} does not meet the output contract: " + " ".join(problems))
    )


def _await_approval(run: Run, draft: dict[str, Any]) -> None:
    """The drafting ends: the draft and the recipient the host resolved (never the model) are
    frozen into a Business Action that waits for a human."""
    send_tool = next(
        (
            entry
            for entry in run.capability["tools"]
            if entry["name"] in _workflow(run).nodes["send"].tools
        ),
        None,
    )
    if send_tool is None:
        _finish(run, status=RunStatus.REFUSED, reason_code="SEND_TOOL_NOT_AVAILABLE")
        return
    if run.tool_call_count >= run.capability["budgets"]["max_tool_calls"]:
        # No tool call is left for the send: nothing is put before an approver.
        _finish(
            run,
            status=RunStatus.BUDGET_EXHAUSTED,
            reason_code="TOOL_CALL_BUDGET",
            output={"calls_not_made": [send_tool["name"]]},
        )
        return
    recipient = run.state.get("recipient", {})
    payload = {
        "recipient_snapshot": recipient,
        "subject": draft["subject"],
        "body": draft.get("body", ""),
        "skill_version": _skill(run)["version"] if _skill(run) else None,
        "tool_versions": {entry["name"]: entry["version"] for entry in run.capability["tools"]},
    }
    action = action_freeze(
        run=run,
        kind=send_tool["name"],
        payload=payload,
        tool_version=versions_frozen(model=ToolVersion, ids=[send_tool["id"]])[send_tool["id"]],
        skill_version=_skill_version(run),
    )
    run.state["draft"] = draft
    run.state["draft_hash"] = action.payload_hash
    run.state["action_id"] = str(action.pk)
    _remember(run, draft={"run_id": str(run.pk), "draft_hash": action.payload_hash})
    events.draft_created(run, draft=draft)
    events.approval_required(
        run,
        action_id=str(action.pk),
        draft_hash=action.payload_hash,
        recipient=recipient,
        expires_at=action.expires_at.isoformat(),
    )
    run.result = {
        "status": RunStatus.WAITING_APPROVAL,
        "output": draft,
        "recipient": recipient,
        "action": {"id": str(action.pk), "payload_hash": action.payload_hash},
        "next_step": "An approver reviews the draft.",
        "model": run.capability.get("model", {}),
    }
    _enter_node(run, APPROVAL_NODE, leaving=_skill(run))
    _transition(run, status=RunStatus.WAITING_APPROVAL)


def _tool_turn(run: Run, made: executor.CallsMade) -> None:
    """Gates 1-8 for the calls of the last model turn that have no result yet. A result is an
    error, for the model and for what an answer rests on (`_agent_answer`), when its call did
    not complete or completed with a business status that is not `business_done`: HTTP 200 with a
    business refusal is not success (gate 7)."""
    node = _effective_node(run)
    pending = pending_calls(run.transcript)
    budget_left = run.capability["budgets"]["max_tool_calls"] - run.tool_call_count
    within = pending[: max(budget_left, 0)]
    records = executor.calls_run(
        run=run,
        calls=within,
        node=node,
        step=run.steps,
        deadline=_calls_deadline(run),
        made=made,
    )
    for call, record in zip(within, records, strict=True):
        content = jsontext.dumps(record.envelope, sort_keys=True)
        run.transcript.append(
            result_entry(
                call_id=call.call_id,
                name=call.name,
                content=wrap_untrusted(
                    source=record.envelope.get("tool", call.name),
                    fetched_at=timezone.now().isoformat(),
                    content=content,
                    allowed_use="evidence",
                    references=[s["reference"] for s in record.envelope.get("sources", [])],
                ),
                is_error=record.status != ToolCallRecord.Status.COMPLETED
                or not business_done(record.envelope["business_status"]),
            )
        )
    if len(within) < len(pending):
        _finish(
            run,
            status=RunStatus.BUDGET_EXHAUSTED,
            reason_code="TOOL_CALL_BUDGET",
            output={"calls_not_made": [call.call_id for call in pending[len(within) :]]},
        )
        return
    run.state["phase"] = "model"


def _budget_overrun(run: Run, *, reached: bool = False) -> str | None:
    """Whether the run went past its time, token or cost budget (or, `reached`, used it all):
    past it after a turn, what the turn answered is recorded, and neither drafted from nor
    acted on."""
    budgets = run.capability["budgets"]
    over = operator.ge if reached else operator.gt
    if _seconds_left(run) < 0:
        return "TIME_BUDGET"
    if over(run.tokens_used, budgets["max_tokens"]):
        return "TOKEN_BUDGET"
    if run.cost > 0 and over(run.cost, Decimal(budgets["max_cost"])):
        return "COST_BUDGET"
    return None


def _seconds_left(run: Run) -> float:
    """What the run's wall-time budget has left: its snapshot's max_seconds from its start
    (below 0: it went past it)."""
    elapsed = (timezone.now() - run.started_at).total_seconds()
    return run.capability["budgets"]["max_seconds"] - elapsed


def _calls_deadline(run: Run) -> float:
    """When (monotonic) the model turn and the tool calls of the run's step must have ended,
    retries and waits included: the step's task time (`executor.tries_deadline`), or the end
    of the run's wall-time budget when that comes first. A call cut short by it fails TIMEOUT
    as one past its timeout does (a model turn: the task retries the step), and the run ends
    TIME_BUDGET at its next check. An approved send is not bound by it
    (`executor.side_effect_admit`): the wait for the approval is not the run's work."""
    return min(executor.tries_deadline(), time.monotonic() + _seconds_left(run))


def _budget_exhausted(run: Run) -> str | None:
    """Whether the run has no budget left for its next step."""
    if (reason := _budget_overrun(run, reached=True)) is not None:
        return reason
    if run.state.get("phase") == "model" and run.steps >= run.capability["budgets"]["max_steps"]:
        return "STEP_BUDGET"
    return None


def _save(run: Run, *, next_step_follows: bool) -> None:
    """The step's one write: the run's row with the rows the step made (`runs.writes`),
    without a memory item the user deleted while the step held the run, and with one the
    user raised or lowered at its new level (a deletion or a new level skips a run a step
    holds; one made between steps has already reached the run's row, which the next step
    reads again, `Execution`). The step saved starts the count of failed steps again
    (`runs.tasks.STEP_FAILURES_MAX`); when its execution takes another step at once, the
    write counts that step in advance, as a delivery of the run's task counts its first
    (`runs.tasks._delivery_count`): a worker that dies in it leaves it counted, with no write
    of its own."""
    run.state = memories_kept(run)
    run.lease_expires_at = timezone.now() + timedelta(seconds=settings.RUN_LEASE_SECONDS)
    run.attempts = 1 if next_step_follows else 0
    written = writes.run_update(
        run,
        fields=[
            "attempts",
            "status",
            "reason_code",
            "finished_at",
            "state",
            "transcript",
            "steps",
            "tool_call_count",
            "tokens_used",
            "cost",
            "started_at",
            "lease_expires_at",
            "result",
            "last_event_seq",
        ],
    )
    executor.known_rows_add(run, written)
    tracing.export_on_commit(written)


@dataclass
class Execution:
    """What one `run_execute` carries from step to step: the model configs it has read, and
    the run as its last step saved it. The next step locks the row and reuses that copy
    when the row's version (updated_at, last_event_seq) shows nobody wrote it since (a
    cancel, an approval); otherwise it reads the row again. Either way the step reads the
    registry's generation anew, under which it may reuse what it resolved from the registry
    (the model config, which pinned versions are revoked). A copy it reuses also carries
    the call ids and evidence of the run's tool calls (`executor.KnownRows`). It takes no
    step after `steps_until` (monotonic; None: one step at a time), which each step checks
    before it saves (`is_out_of_time`), so that its save knows whether another step follows.
    """

    model_configs: dict[int, ModelConfig] = field(default_factory=dict)
    run: Run | None = None
    steps_until: float | None = None
    is_out_of_time: bool = True
    # Whether the step under way went on from a move that asked no model to a model turn.
    turn_followed: bool = False
    # What the calls the step under way executed gave, for its move taken again alone
    # after a fault in the turn that followed it (`run_advance_step`).
    calls_made: executor.CallsMade = field(default_factory=dict)


def _cancel_asked() -> Exists:
    """Whether a cancel request waits beside the run (`runs.models.CancelRequest`)."""
    return Exists(CancelRequest.objects.filter(run_id=OuterRef("pk")))


# A step locks the run's row FOR NO KEY UPDATE: it changes no key, and a cancel request,
# whose foreign key check shares the key, need not wait for the step to end.
# The row's version, locked, with the registry's generation now, whether a cancel request
# waits, and the run's standing: the statement every step after an execution's first starts
# with.
_RUN_VERSION_LOCKED = PreparedQuery(
    lambda run_id: (
        Run.objects.select_for_update(no_key=True)
        .annotate(
            registry_generation=generation_sql(),
            cancel_asked=_cancel_asked(),
            requester_standing=requester_standing(),
            agent_active=agent_active(),
        )
        .filter(pk=run_id)
        .order_by()
        .values_list(
            "updated_at",
            "last_event_seq",
            "registry_generation",
            "cancel_asked",
            "requester_standing",
            "agent_active",
        )[:1]
    ),
    run_id=UUID,
)
# With the registry's generation, under which the model config and which pinned versions are
# revoked are kept (`registry.generation`).
_RUN_LOCKED = PreparedQuery(
    lambda run_id: (
        Run.objects.select_for_update(no_key=True, of=("self",))
        .select_related("tenant", "actor", "session")
        .annotate(
            registry_generation=generation_sql(),
            cancel_asked=_cancel_asked(),
            requester_standing=requester_standing(),
            agent_active=agent_active(),
        )
        .filter(pk=run_id)
        .order_by()[:1]
    ),
    run_id=UUID,
)


def _standing_withdrawn(run: Run) -> tuple[RunStatus, str] | None:
    """Why the run may not take another step, if its standing was withdrawn since it was
    accepted: its requester may no longer start runs in the tenant, an admin switched its
    agent off (as the ingress takes no new message for it, no accepted run goes on under
    it), or a skill version of its snapshot was revoked or is no longer granted (never used
    again, pinned or not)."""
    if not run.requester_standing:
        return RunStatus.REFUSED, REQUESTER_NO_LONGER_AUTHORISED
    if not run.agent_active:
        return RunStatus.FAILED_FINAL, AGENT_CONFIG_INACTIVE
    skill_ids = [entry["id"] for entry in run.capability.get("skills", [])]
    if skill_ids and version_ids_withdrawn(
        model=SkillVersion, ids=skill_ids, tenant=run.tenant, generation=run.registry_generation
    ):
        return RunStatus.FAILED_FINAL, "SKILL_VERSION_NOT_AVAILABLE"
    return None


def _locked_run(run_id: str, execution: Execution) -> Run | None:
    saved = execution.run
    if saved is not None:
        version = _RUN_VERSION_LOCKED.first(run_id=run_id)
        if version is not None and version[:2] == (saved.updated_at, saved.last_event_seq):
            (
                saved.registry_generation,
                saved.cancel_asked,
                saved.requester_standing,
                saved.agent_active,
            ) = version[2:]
            return saved
    run = _RUN_LOCKED.first(run_id=run_id)
    if run is not None:
        executor.known_rows_start(run)
    return run


def run_advance_step(*, run_id: str, execution: Execution | None = None) -> bool:
    """Advance the run by one transaction: a move that asks no model (the host's own steps,
    start and recipient, or the tool calls of one turn) with the model turn that follows it,
    or one model turn. A model turn's output is committed before its tools run. A move that
    asks no model is followed in its transaction by a turn of a planner in this process
    (`_turn_follows`), which answers in a moment: the tool results are committed with the
    turn they feed. When that turn raises (a fault), the move is taken again alone and
    saved, then the error goes on to the task, as when it was a step of its own; its tool
    calls are recorded from what they gave, not executed again. Returns whether there is
    more to do."""
    execution = execution or Execution()
    execution.calls_made.clear()
    try:
        return _step(run_id, execution, turn_may_follow=True)
    except Exception:
        if not execution.turn_followed:
            raise
        _step(run_id, execution, turn_may_follow=False)
        raise


def _step(run_id: str, execution: Execution, *, turn_may_follow: bool) -> bool:
    execution.turn_followed = False
    with transaction.atomic():
        run = _locked_run(run_id, execution)
        execution.run = None
        if run is None or run.status not in (RunStatus.QUEUED, RunStatus.RUNNING):
            return False
        if run.state.get("node") in HOST_NODES:
            return False
        if run.cancel_asked:
            cancel_request_take_in(run)
        if run.cancel_requested_at is not None:
            run_finish(run=run, status=RunStatus.CANCELLED, reason_code=run.cancel_reason)
            return False
        if (withdrawn := _standing_withdrawn(run)) is not None:
            status, reason_code = withdrawn
            run_finish(run=run, status=status, reason_code=reason_code)
            return False
        if (changed := workflow_changed(run.capability)) is not None:
            run_finish(
                run=run,
                status=RunStatus.FAILED_FINAL,
                reason_code=WORKFLOW_CHANGED,
                output=changed,
            )
            return False
        writes.hold(run)
        if _move(run, execution) and turn_may_follow and _turn_follows(run, execution):
            execution.turn_followed = True
            _move(run, execution)
        execution.is_out_of_time = (
            execution.steps_until is None or time.monotonic() >= execution.steps_until
        )
        _save(
            run,
            next_step_follows=run.status == RunStatus.RUNNING
            and run.state.get("node") not in HOST_NODES
            and not execution.is_out_of_time,
        )
    execution.turn_followed = False
    execution.run = run
    return run.status == RunStatus.RUNNING


def _move(run: Run, execution: Execution) -> bool:
    """Take the locked run's next move; returns whether it asked no model (the run's start,
    the recipient's resolution, a tool turn)."""
    asked_no_model = run.status == RunStatus.QUEUED
    if asked_no_model:
        _start(run)
    elif (reason := _budget_exhausted(run)) is not None:
        _finish(run, status=RunStatus.BUDGET_EXHAUSTED, reason_code=reason)
    elif (quota := quotas.tenant_quota_spent(run.tenant)) is not None:
        _finish(
            run,
            status=RunStatus.BUDGET_EXHAUSTED,
            reason_code="TENANT_DAILY_COST_QUOTA",
            output=quota,
        )
    elif run.state["phase"] == "tools":
        _tool_turn(run, execution.calls_made)
        asked_no_model = True
    elif run.state["node"] != "resolve_recipient":
        _model_turn(run, _model_config(run, execution.model_configs))
    if run.status == RunStatus.RUNNING and run.state["node"] == "resolve_recipient":
        _resolve_recipient(run, execution.calls_made)
        asked_no_model = True
    return asked_no_model


def _turn_follows(run: Run, execution: Execution) -> bool:
    """Whether a model turn is the run's next move, within the execution's time, asked of a
    planner in this process. A provider over the network takes seconds, beside which a
    commit is nothing: the move before it is saved first, so the run shows its start, or
    its tool results, while the provider thinks, and a provider that is unavailable for a
    while leaves nothing of that move to be done again."""
    return (
        run.status == RunStatus.RUNNING
        and run.state["phase"] == "model"
        and run.state["node"] not in HOST_NODES
        and run.state["node"] != "resolve_recipient"
        and run.capability["model"]["provider"] in IN_PROCESS_PROVIDERS
        and (execution.steps_until is None or time.monotonic() < execution.steps_until)
    )


def run_execute(*, run_id: str, seconds: float | None = None) -> bool:
    """Advance the run until it pauses, ends, or needs a retry, starting no step after about
    `seconds` (None: no bound). Returns whether steps remain."""
    execution = Execution(steps_until=math.inf if seconds is None else time.monotonic() + seconds)
    while run_advance_step(run_id=run_id, execution=execution):
        if execution.is_out_of_time:
            return True
    return False
