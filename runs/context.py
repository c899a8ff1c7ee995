"""The context builder: what the model sees on one turn, within a token budget per section.

Sections in order of trust: platform and application rules, the workflow node, the skill (its
procedure, rules and examples), the task inputs and state, the tool schemas and the output
contract as instructions; then the transcript: the recipient the host resolved (seed 000, stage
7: the minimal snapshot of the directory record, as data the model may not change), earlier
messages of the session and the user's message, the model's calls and the wrapped tool results.
An example given twice (in other spacing or case too) is given once; when the whole is over
budget, examples go first (the last listed first), then earlier messages of the session, then
old tool results lose their content (their untrusted-data envelope keeps the source, the hash
and the references), then old turns but the last that called tools; rules, the skill's
procedure, the task, the recipient and the tool schemas are never cut: when they alone overrun
the budget, the turn is sent past it, and its record says by how much. Tool results reach the
model only inside an `untrusted_data` envelope, never among the instructions, with the
characters in it that show nothing or move other text (bidirectional controls, zero-width
characters, tag characters, other control characters but tab and line breaks) spelled out as
<U+XXXX>: raw, they could hide an instruction from whoever reads the evidence, or reorder it.
The envelope's `content_sha256` is the hash of the content as fetched (its UTF-8), which its
Source records too; `hidden_characters_spelled_out` says when the content shown is not that.
What the user said (their message, earlier messages of the session) and what is remembered about
them (text kept from an earlier run, which may have been pasted from anywhere) reach the model
with those characters spelled out too; the run and its events keep them as received.

What the model saw is recorded (`context.built`) as each section's size and keyed hash
(HMAC-SHA256 under a key derived from SECRET_KEY): the platform can tell whether a context it
rebuilds is the one a turn had, and whether two turns had the same section, but whoever reads
the record cannot test a guess against it (an auditor shown a masked recipient could
otherwise confirm a guessed address against the recipient section's plain hash). A section
in which hidden characters of the user's text or memory were spelled out says so
(`hidden_characters_spelled_out`): what it shows is not the text the run keeps.
"""

import hashlib
import json
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.crypto import salted_hmac

from config import jsontext
from registry.mcp.review import visible
from runs.model_clients.base import ModelRequest, ToolSpec
from runs.rules import MergedRules
from runs.tokens import estimate_tokens
from runs.transcript import to_items, user_entry
from runs.workflows import Node

INPUTS_MARKER = "## Task inputs"
# The share of the token budget what is remembered about the user may take at most; past it,
# and when the whole is over budget (after the examples and the earlier messages), items go.
MEMORY_SHARE = 0.25
# What the model sees of the confirmed recipient: the least that names them (seed 000, stage 7).
RECIPIENT_FIELDS = (
    "record_id",
    "display_name",
    "corporate_email",
    "record_version",
    "looked_up_at",
)
RECIPIENT_MARKER = (
    "# Recipient of the draft: the host attaches them to the mail; the draft never names an "
    "address, and this one is not to be changed"
)


def message_max_tokens() -> int:
    """What a message may take of the context (its text, and the excerpts of its attachments):
    three quarters of CONTEXT_MAX_TOKENS. The context never cuts the task, so the rest is left
    for the rules, the tools and the evidence."""
    return settings.CONTEXT_MAX_TOKENS * 3 // 4


# Characters that show nothing though they are not whitespace to `str.strip`: the Braille
# blank and the Hangul fillers.
_BLANKS = frozenset("\u2800\u115f\u1160\u3164\uffa0")


def text_shows_something(text: str) -> bool:
    """Whether `text` shows anything: a character that is not a space, a control or format
    character (zero-width ones included) or a blank. A message's text (and a scheduled task's
    goal, the message of its runs) that shows nothing asks nothing."""
    return any(
        unicodedata.category(character)[0] not in "CZ" and character not in _BLANKS
        for character in text
    )


def section_hash(text: str) -> str:
    """The keyed hash a section's text is recorded with."""
    return salted_hmac("runs.context.section", text, algorithm="sha256").hexdigest()


@dataclass(frozen=True)
class BuiltContext:
    request: ModelRequest
    sections: dict[str, dict[str, Any]]
    # CONTEXT_MAX_TOKENS, the tokens of the sections, and by how much they exceed it (what is
    # never cut may: the turn is sent past its budget, and says so).
    budget: dict[str, int]


def wrap_untrusted(
    *, source: str, fetched_at: str, content: str, allowed_use: str, references: list[str]
) -> str:
    """Someone else's text as the model is shown it: its hidden characters spelled out (in
    its source and references too), its hash that of the content as fetched."""
    shown = visible(content)
    return jsontext.dumps(
        {
            "untrusted_data": {
                "source": visible(source),
                "fetched_at": fetched_at,
                "content_sha256": hashlib.sha256(content.encode()).hexdigest(),
                "allowed_use": allowed_use,
                "references": [visible(reference) for reference in references],
                **({"hidden_characters_spelled_out": True} if shown != content else {}),
                "content": shown,
            }
        }
    )


def _shown_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A transcript entry as the model is shown it: a user's turn (the message, what the host
    told the model) with its hidden characters spelled out. The model's own turns are its
    output, and a tool result is already wrapped (`wrap_untrusted`): they stay the same."""
    if entry["kind"] != "user" or (shown := visible(entry["text"])) == entry["text"]:
        return entry
    return {**entry, "text": shown}


def _recipient_text(recipient: Any) -> str:
    """The recipient's snapshot as untrusted data: a directory record's name is data, never an
    instruction. Empty without a recipient."""
    if not isinstance(recipient, dict):
        return ""
    snapshot = {field: recipient.get(field) for field in RECIPIENT_FIELDS}
    return (
        RECIPIENT_MARKER
        + "\n"
        + wrap_untrusted(
            source="directory",
            fetched_at=str(recipient.get("looked_up_at") or ""),
            content=jsontext.dumps(snapshot, sort_keys=True),
            allowed_use="recipient",
            references=[f"directory:{snapshot['record_id']}@{snapshot['record_version']}"],
        )
    )


def _as_compared(value: Any) -> Any:
    """An example as it is compared with the others: its texts in NFKC, case-folded, without
    invisible (format) characters and with their whitespace collapsed. An example written
    again with other spacing or case teaches the model nothing more, and kept, it would
    leave less of the budget to the examples that do."""
    if isinstance(value, str):
        shown = unicodedata.normalize("NFKC", value)
        shown = "".join(char for char in shown if unicodedata.category(char) != "Cf")
        return " ".join(shown.casefold().split())
    if isinstance(value, dict):
        return {_as_compared(key): _as_compared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_compared(item) for item in value]
    return value


def _rules_text(merged: MergedRules) -> str:
    return "\n".join(f"- [{layer}:{rule.id}] {rule.text}" for layer, rule in merged.rules)


# What an old tool result keeps of its untrusted-data envelope when its content is cut.
_KEPT_WHEN_COMPRESSED = ("source", "fetched_at", "content_sha256", "allowed_use", "references")


def _cut_old_results(transcript: list[dict[str, Any]], keep_last: int) -> list[dict[str, Any]]:
    """Old tool results shrink to their envelope without its content: still untrusted data,
    with their source and references."""
    results = [index for index, entry in enumerate(transcript) if entry["kind"] == "tool_result"]
    shrink = set(results[:-keep_last] if keep_last else results)
    cut = []
    for index, entry in enumerate(transcript):
        if index in shrink:
            wrapped = json.loads(entry["content"]).get("untrusted_data", {})
            kept = {name: wrapped[name] for name in _KEPT_WHEN_COMPRESSED if name in wrapped}
            compressed = {"untrusted_data": {**kept, "compressed": True}}
            entry = {**entry, "content": jsontext.dumps(compressed)}
        cut.append(entry)
    return cut


def _last_turn_results(transcript: list[dict[str, Any]]) -> int:
    """How many tool results answer the last assistant turn that called tools (a draft sent
    back for a correction rests on them too)."""
    count = 0
    for entry in reversed(transcript):
        if entry["kind"] == "tool_result":
            count += 1
        elif entry["kind"] == "assistant" and count:
            break
    return count


def _drop_oldest_exchange(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Remove the oldest assistant turn together with its tool results, so no result is ever
    left without the call it answers; the first user message, the last turn and the last
    turn that called tools (a draft sent back for a correction rests on its results) stay,
    and so does what the host told the model after the turn (what its draft must mend)."""
    turns = [index for index, entry in enumerate(entries) if entry["kind"] == "assistant"]
    calling = [index for index in turns if entries[index]["tool_calls"]]
    if len(turns) < 2 or (calling and turns[0] >= calling[-1]):
        return entries
    start, end = turns[0], turns[1]
    told = [entry for entry in entries[start:end] if entry["kind"] == "user"]
    return entries[:start] + told + entries[end:]


def _unexpired(memory: list[Any]) -> list[Any]:
    """The run's copy of its requester's memory without the items whose `expires_at` has
    passed (the sweep or the step's save has not dropped them yet), and without that date,
    which the model is not shown. An item recalled before copies kept it stays."""
    now = timezone.now()
    return [
        {name: value for name, value in entry.items() if name != "expires_at"}
        if isinstance(entry, dict)
        else entry
        for entry in memory
        if not (
            isinstance(entry, dict)
            and "expires_at" in entry
            and datetime.fromisoformat(entry["expires_at"]) <= now
        )
    ]


def context_build(
    *,
    run_state: dict[str, Any],
    transcript: list[dict[str, Any]],
    node: Node,
    merged_rules: MergedRules,
    skill: dict[str, Any] | None,
    skill_instructions: str,
    tools: list[ToolSpec],
    output_contract: dict[str, Any],
    examples: list[Any],
) -> BuiltContext:
    budget = settings.CONTEXT_MAX_TOKENS
    fixed = {
        "rules": "# Rules (higher layers win)\n" + _rules_text(merged_rules),
        "node": f"# Workflow node: {node.name}\nFinish when: {node.terminates_when}",
        "skill": "\n".join(
            filter(None, [f"# Skill: {skill['name']}@{skill['version']}", skill_instructions])
        )
        if skill
        else "# No skill",
        "inputs": f"{INPUTS_MARKER}\n```json\n"
        + jsontext.dumps(run_state.get("inputs", {}), sort_keys=True)
        + "\n```",
        "output_contract": "# Output contract\n" + jsontext.dumps(output_contract, sort_keys=True),
    }
    recalled = _unexpired(run_state.get("memory") or [])
    memory = jsontext.strings_mapped(recalled, visible)
    earlier = list(run_state.get("history", []))
    conversation = jsontext.strings_mapped(earlier, visible)
    given = transcript
    # A user's turn is never cut (`_drop_oldest_exchange` keeps them): the transcript sent
    # shows a spelled-out character whenever the one given has one.
    transcript = [_shown_entry(entry) for entry in given]

    def memory_text() -> str:
        if not memory:
            return ""
        return (
            "# Remembered about this user (their own statements, each with its source)\n"
            + jsontext.dumps(memory, sort_keys=True)
        )

    # Memory has a section of its own: at most a MEMORY_SHARE of the budget.
    while memory and estimate_tokens(memory_text()) > budget * MEMORY_SHARE:
        memory.pop()
    memory_tokens = estimate_tokens(memory_text())
    tool_text = jsontext.dumps(
        [{"name": t.name, "description": t.description, "schema": t.input_schema} for t in tools],
        sort_keys=True,
    )
    # Each example once, in its place and as it is first written.
    by_text: dict[str, Any] = {}
    for example in examples:
        by_text.setdefault(jsontext.dumps(_as_compared(example), sort_keys=True), example)
    examples = list(by_text.values())

    def examples_text() -> str:
        return "# Examples\n" + jsontext.dumps(examples) if examples else ""

    entries = list(transcript)
    recipient = _recipient_text(run_state.get("recipient"))
    used = sum(estimate_tokens(text) for text in (*fixed.values(), tool_text, recipient))
    # Each entry is counted once, however often the budget is checked: a cut makes new
    # entries, the others stay the same objects.
    counted: dict[int, tuple[dict[str, Any], int]] = {}

    def entry_tokens(entry: dict[str, Any]) -> int:
        known = counted.get(id(entry))
        if known is None or known[0] is not entry:
            known = counted[id(entry)] = (
                entry,
                estimate_tokens(jsontext.dumps(entry)),
            )
        return known[1]

    def conversation_text() -> str:
        if not conversation:
            return ""
        return "# Earlier in this session\n" + jsontext.dumps(conversation, sort_keys=True)

    conversation_tokens = estimate_tokens(conversation_text())

    def total() -> int:
        return (
            used
            + memory_tokens
            + estimate_tokens(examples_text())
            + conversation_tokens
            + sum(entry_tokens(entry) for entry in entries)
        )

    while total() > budget and examples:
        examples.pop()
    while total() > budget and conversation:
        conversation.pop(0)
        conversation_tokens = estimate_tokens(conversation_text())
    while total() > budget and memory:
        memory.pop()
        memory_tokens = estimate_tokens(memory_text())
    # The results of the last turn are what the model is to work from now: never compressed.
    last_turn = _last_turn_results(transcript)
    keep = max(2, last_turn)
    while total() > budget and keep >= last_turn:
        entries = _cut_old_results(transcript, keep_last=keep)
        keep -= 1
    while total() > budget:
        shorter = _drop_oldest_exchange(entries)
        if shorter == entries:
            break
        entries = shorter
    sections = {**fixed, "examples": examples_text()}
    instructions = "\n\n".join(text for text in sections.values() if text)
    if memory:
        sections["memory"] = memory_text()
    sections["tools"] = tool_text
    if recipient:
        sections["recipient"] = recipient
    sections["conversation"] = conversation_text()
    # Each text is one section: memory and earlier messages are counted as theirs. Keys are
    # sorted: a step's own entries and the same entries read back from PostgreSQL (whose JSON
    # orders keys its own way) are one text, with one hash.
    sections["transcript"] = jsontext.dumps(entries, sort_keys=True)
    # The recipient (directory data) and what the user said before (remembered statements,
    # earlier messages) go with the user's turn, never among the instructions.
    if before := "\n\n".join(filter(None, [recipient, memory_text(), conversation_text()])):
        entries = [user_entry(before), *entries]
    # What the budget left of memory (its first items) and of the earlier messages (the last).
    spelled_out = {
        name
        for name, shown, kept in (
            ("memory", memory, recalled[: len(memory)]),
            ("conversation", conversation, earlier[len(earlier) - len(conversation) :]),
            ("transcript", transcript, given),
        )
        if shown != kept
    }
    recorded = {
        name: {
            "tokens": estimate_tokens(text),
            "hmac_sha256": section_hash(text),
            **({"hidden_characters_spelled_out": True} if name in spelled_out else {}),
        }
        for name, text in sections.items()
    }
    tokens = sum(section["tokens"] for section in recorded.values())
    return BuiltContext(
        request=ModelRequest(
            instructions=instructions, transcript=to_items(entries), tools=tuple(tools)
        ),
        sections=recorded,
        budget={"max_tokens": budget, "tokens": tokens, "over_by": max(tokens - budget, 0)},
    )
