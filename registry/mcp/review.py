"""What the registry reads off a remote MCP tool before a human reviews it: its definition hash,
the risk its annotations propose, and flags on text that speaks to the model.

Descriptions and schemas from a server are data written by someone else. Nothing here trusts
them: annotations only propose a risk the publisher can raise, and flagged text is shown to the
reviewer, escaped, with hidden characters made visible.
"""

import hashlib
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import rfc8785

from config import jsontext
from registry.canonical import canonical_hash
from registry.choices import Risk

# From least to most dangerous; a publisher may move a proposed risk only up this list.
RISK_ORDER: tuple[str, ...] = (
    Risk.READ,
    Risk.READ_SENSITIVE,
    Risk.INTERNAL_WRITE,
    Risk.EXTERNAL_SIDE_EFFECT,
    Risk.DESTRUCTIVE,
    Risk.FINANCIAL,
)


def definition_of(tool: Any) -> dict[str, Any]:
    """The parts of a remote tool (an `mcp.types.Tool`) the registry keeps and hashes."""
    return {
        "name": tool.name,
        "title": tool.title,
        "description": tool.description or "",
        "inputSchema": tool.inputSchema,
        "outputSchema": tool.outputSchema,
        "annotations": tool.annotations.model_dump(exclude_none=True) if tool.annotations else {},
    }


def listed_ambiguously(listed: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """The names (or URIs) a listing gives more than once with different definitions, each
    with how many times it is listed: which of them the server acts on is not known. A name
    listed again exactly alike is not among them."""
    times: Counter[str] = Counter()
    forms: dict[str, set[str]] = {}
    for name, definition in listed:
        times[name] += 1
        text = json.dumps(definition, sort_keys=True, ensure_ascii=False, default=str)
        forms.setdefault(name, set()).add(text)
    return {name: times[name] for name, texts in forms.items() if len(texts) > 1}


def ambiguity(ambiguous: dict[str, int], name: str) -> str | None:
    """Why `name` is skipped, if the listing gives it with different definitions (`ambiguous`,
    as `listed_ambiguously` found)."""
    if name not in ambiguous:
        return None
    return f"listed {ambiguous[name]} times with different definitions"


def nested_too_deep(names: Iterable[str]) -> str:
    """Why the tools `names` are not kept whole: their definitions nest deeper than the
    registry keeps (`jsontext.MAX_DEPTH`), whether the listing could be read or not."""
    return (
        f"the definition of tool {', '.join(names)} nests deeper than {jsontext.MAX_DEPTH} levels"
    )


def served_hash(definition: dict[str, Any]) -> tuple[str, bool]:
    """The definition's hash, and whether it is the canonical one (`definition_hash`). A
    definition RFC 8785 cannot hash (a number past what a double holds) gets the sha256 of
    its sorted JSON instead: it never equals a reviewed hash, so it shows as a change."""
    try:
        return definition_hash(definition), True
    except rfc8785.CanonicalizationError:
        text = json.dumps(definition, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), False


def definition_hash(definition: dict[str, Any]) -> str:
    """sha256 of the RFC 8785 canonical JSON of name, description and schemas."""
    hashed = {
        "name": definition["name"],
        "description": definition.get("description") or "",
        "inputSchema": definition.get("inputSchema") or {},
        "outputSchema": definition.get("outputSchema"),
    }
    return canonical_hash(hashed)


def proposed_risk(annotations: dict[str, Any]) -> str:
    """The risk the annotations claim, read with the protocol's defaults (not read-only,
    destructive, open world): a tool that says nothing is proposed as destructive."""
    if annotations.get("readOnlyHint", False):
        return Risk.READ
    if annotations.get("destructiveHint", True):
        return Risk.DESTRUCTIVE
    if annotations.get("openWorldHint", True):
        return Risk.EXTERNAL_SIDE_EFFECT
    return Risk.INTERNAL_WRITE


def risk_at_least(risk: str, floor: str) -> bool:
    return RISK_ORDER.index(risk) >= RISK_ORDER.index(floor)


_LOCAL_NAME = re.compile(r"[^a-z0-9_]+")


def local_tool_name(remote_name: str) -> str:
    """The registry's name for a remote tool: lower case, letters, digits and '_'."""
    name = _LOCAL_NAME.sub("_", remote_name.lower()).strip("_") or "tool"
    if not name[0].isalpha():
        name = f"t_{name}"
    return name[:64]


@dataclass(frozen=True)
class Flag:
    code: str
    field: str
    excerpt: str

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "field": self.field, "excerpt": self.excerpt}


_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "OVERRIDE_INSTRUCTIONS",
        re.compile(
            r"\b(ignore|disregard|forget|override)\b.{0,40}\b(previous|prior|above|earlier|all|"
            r"system|other)\b.{0,20}\b(instructions?|rules?|prompts?|messages?)\b",
            re.I | re.S,
        ),
    ),
    (
        "ADDRESSES_THE_MODEL",
        re.compile(
            r"\b(you must|you should|you are now|as an ai|do not (tell|inform|mention|reveal)|"
            r"don't (tell|inform|mention|reveal)|without (telling|informing) the user|"
            r"before (using|calling) (any|this|the) (other )?tool|always (call|use|send)|"
            r"instead of (calling|using))\b",
            re.I,
        ),
    ),
    (
        "MENTIONS_OTHER_TOOLS",
        re.compile(r"\b(other|another|every|all) tools?\b|\btool named\b", re.I),
    ),
    (
        "MENTIONS_SECRETS",
        re.compile(
            r"\b(passwords?|passwd|secrets?|api[ _-]?keys?|access[ _-]?tokens?|tokens?|"
            r"credentials?|private[ _-]?keys?|ssh|\.env|id_rsa)\b",
            re.I,
        ),
    ),
    # An address and a tag are matched from where their run of characters starts, and a tag
    # ends before the next one opens: tried at each character of a long word, or at each of
    # many unclosed tags, the search would read the rest of the text again (quadratic).
    (
        "MENTIONS_RECIPIENTS",
        re.compile(
            r"(?<![\w.+-])[\w.+-]+@[\w-]+(\.[\w-]+)+|"
            r"\b(send|forward|mail|email|post|upload|exfiltrate)\b.{0,60}\bto\b|\b(bcc|cc)\b",
            re.I | re.S,
        ),
    ),
    ("MARKUP", re.compile(r"<\s*/?\s*[a-z][a-z0-9_-]*[^<>]*>|<!--|\[\[|\]\]|\{\{", re.I)),
)
_HIDDEN_CATEGORIES = frozenset({"Cf", "Co", "Cn"})


# The control characters of ASCII text: the only hidden ones it can hold.
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _hidden(text: str) -> set[str]:
    """The hidden and control characters `text` holds (tab and line breaks are neither), each
    once: every character of a tool's result is looked at, so each distinct one is classified
    once, and ASCII text is searched for its control characters alone."""
    if text.isascii():
        return set(_ASCII_CONTROL.findall(text))
    return {
        char
        for char in set(text)
        if unicodedata.category(char) in _HIDDEN_CATEGORIES
        or (unicodedata.category(char) == "Cc" and char not in "\n\r\t")
    }


def visible(text: str) -> str:
    """`text` with every hidden or control character spelled out as <U+XXXX>."""
    spelled = {ord(char): f"<U+{ord(char):04X}>" for char in _hidden(text)}
    return text.translate(spelled) if spelled else text


def _texts(definition: dict[str, Any]) -> list[tuple[str, str]]:
    """Every piece of free text in a definition, with where it sits."""
    found = [("description", definition.get("description") or "")]
    if definition.get("title"):
        found.append(("title", definition["title"]))

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in {"description", "title"} and isinstance(item, str):
                    found.append((f"{path}/{key}", item))
                else:
                    walk(item, f"{path}/{key}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")
        elif isinstance(value, str) and path.rsplit("/", 1)[-1] in {"default", "const"}:
            found.append((path, value))

    walk(definition.get("inputSchema") or {}, "inputSchema")
    walk(definition.get("outputSchema") or {}, "outputSchema")
    return found


def poisoning_flags(definition: dict[str, Any]) -> list[dict[str, str]]:
    """Why a reviewer should read this definition closely: instructions to the model,
    mentions of other tools, secrets or recipients, hidden Unicode or markup."""
    flags: list[Flag] = []
    for field, text in _texts(definition):
        hidden = _hidden(text)
        if hidden:
            flags.append(
                Flag(
                    "HIDDEN_CHARACTERS",
                    field,
                    ", ".join(sorted({f"U+{ord(char):04X}" for char in hidden})),
                )
            )
        for code, pattern in _PATTERNS:
            match = pattern.search(text)
            if match:
                start = max(match.start() - 30, 0)
                flags.append(Flag(code, field, visible(text[start : match.end() + 30])))
    return [flag.as_dict() for flag in flags]
