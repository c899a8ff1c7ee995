"""The result envelope every tool call returns, whatever its adapter (DESIGN.md, gate 7).

HTTP 200 with a business refusal is not success: protocol status and business status are kept
apart. The raw business response is kept as complete as the size limit allows, with secrets
stripped; the whole response of a call cut to fit stays in a Source the model can cite by
reference (`executor._record`).
"""

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from django.db import models

from config import jsontext
from config.secret_names import cached_by_name
from runs.redaction import (
    REDACTED,
    key_shown,
    known_secrets_replaced,
    names_secret,
    secrets_removed,
)

# The business status of a call that did what it was asked: what a Python handler or an MCP
# tool that succeeded answers, and what the HTTP adapter takes when the service says none.
BUSINESS_OK = "ok"
# The business status of a call an evaluation sandbox kept from its system: it answers what
# it would have done (`runs.tools.executor._sandboxed`).
DRY_RUN = "dry_run"


def business_done(status: str) -> bool:
    """Whether a call that answered with this business status did what it was asked (in a
    sandbox, would have). Any other status (an MCP tool's `isError`, a service's 200 with
    "refused" or "queued") is a result the model is told is an error, on which no answer rests
    (`runs.loop._tool_turn`), whose sources are no evidence (`runs.tools.executor._record`),
    and which does not settle an approved action (`approvals.services._unconfirmed`)."""
    return status in (BUSINESS_OK, DRY_RUN)


# What ends an error message cut to fit its envelope.
ENVELOPE_CUT_MARKER = "…"


class ErrorCategory(models.TextChoices):
    TIMEOUT = "TIMEOUT"
    RATE_LIMITED = "RATE_LIMITED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UPSTREAM_ERROR = "UPSTREAM_ERROR"
    TOOL_DEFINITION_CHANGED = "TOOL_DEFINITION_CHANGED"
    UNKNOWN = "UNKNOWN"


@dataclass
class Envelope:
    call_id: str
    tool: str
    protocol_status: str
    business_status: str
    raw: Any = None
    normalized: dict[str, Any] = field(default_factory=dict)
    error: dict[str, str] | None = None
    retryable: bool = False
    may_have_side_effect: bool = False
    sources: list[dict[str, str]] = field(default_factory=list)
    truncated: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict; nested values are shared, not copied (an envelope is built
        once per call and not changed after)."""
        return {name: getattr(self, name) for name in _ENVELOPE_FIELDS}

    def size(self) -> int:
        """Bytes of the envelope as compact JSON (UTF-8)."""
        return len(jsontext.dumps_bytes(self.as_dict(), default=str))


_ENVELOPE_FIELDS = tuple(item.name for item in fields(Envelope))


def strip_secrets(value: Any, *, secrets: tuple[str, ...] = ()) -> Any:
    """A tool's output as the run keeps it: credential-like keys dropped anywhere and known
    secret values redacted, in keys as in values; JSON PostgreSQL stores, whatever the tool
    returned (`jsontext.storable`)."""
    secrets = tuple(filter(None, secrets))
    if not secrets:
        return jsontext.storable(value, text=_text_cleared, key=_key_cleared, hidden=REDACTED)
    return jsontext.storable(
        value,
        text=functools.partial(_text_stripped, secrets=secrets),
        key=functools.partial(_key_stripped, secrets=secrets),
        hidden=REDACTED,
    )


def _text_cleared(text: str) -> str:
    return jsontext.storable_text(secrets_removed(text))


@cached_by_name
def _key_cleared(key: str) -> tuple[str, bool]:
    """`_key_stripped` with no known secret: the same few keys repeat in every answer."""
    return _key_stripped(key, secrets=())


def _text_stripped(text: str, *, secrets: tuple[str, ...]) -> str:
    return _text_cleared(known_secrets_replaced(text, secrets))


def _key_stripped(key: str, *, secrets: tuple[str, ...]) -> tuple[str, bool]:
    """The key as kept, and whether it names a secret (its value is then dropped)."""
    if secrets and any(secret in key for secret in secrets):
        return _text_stripped(key, secrets=secrets), names_secret(key)
    shown, hidden = key_shown(key, cleared=True)
    return jsontext.storable_text(shown), hidden


# A token of JSON text: a string, a number or literal, a bracket, a comma or a colon.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^\s"{}\[\],:]+|[{}\[\],:]')
_KEY_FOLLOWS = re.compile(r"\s*:")


def _value_ends(text: str, limit: int) -> list[int]:
    """Where a preview of the JSON `text` may end, up to `limit`, in ascending order: at its
    start, after an opening bracket or after a whole value (a string that is no key, a
    number, a literal, a closing bracket); never inside a string or a number, so that each
    value a preview shows is whole, as masking finds it (a sensitive name cut to "Zoë Br"
    would be found nowhere)."""
    ends = [0]
    for token in _JSON_TOKEN.finditer(text):
        if token.end() > limit:
            break
        first = token.group()[0]
        if first in ",:" or (first == '"' and _KEY_FOLLOWS.match(text, token.end())):
            continue
        ends.append(token.end())
    return ends


def _longest_that_fits(fits: Callable[[int], bool], longest: int) -> int | None:
    """The largest n in 0..`longest` for which `fits(n)`, found by bisection (each larger n
    fits no better); None when not even n = 0 fits."""
    if not fits(0):
        return None
    shortest = 0
    while shortest < longest:
        middle = (shortest + longest + 1) // 2
        if fits(middle):
            shortest = middle
        else:
            longest = middle - 1
    return shortest


def _size(value: Any) -> int:
    """Bytes of `value` as compact JSON (UTF-8), as the envelope stores it."""
    return len(jsontext.dumps_bytes(value, default=str))


class _Part:
    """A part of the envelope that may be cut, with its cuts from the smallest to the whole:
    `cut(bound)` is its longest cut of at most `bound` bytes, or its smallest cut when none
    is that small; a part no larger than its smallest cut is never cut."""

    def __init__(self, whole: Any, cuts: Callable[[int], Any], count: int) -> None:
        self.whole = whole
        self._cuts = cuts
        self._count = count
        self._smallest = _size(cuts(0))
        self.size = _size(whole)

    def cut(self, bound: int) -> Any:
        if self.size <= max(bound, self._smallest):
            return self.whole
        index = _longest_that_fits(lambda index: _size(self._cuts(index)) <= bound, self._count)
        return self._cuts(index or 0)


def _preview(value: Any, max_bytes: int) -> _Part:
    """The raw response or the normalised fields, cut to a preview of its JSON text that ends
    after a whole value (`_value_ends`); a preview of more characters than the envelope's
    bytes cannot fit, so its ends are not looked for."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    ends = _value_ends(text, max_bytes)
    return _Part(value, lambda index: {"preview": text[: ends[index]]}, len(ends) - 1)


def _message(message: str, max_bytes: int) -> _Part:
    """The error's message, cut to its start in whole characters followed by
    ENVELOPE_CUT_MARKER, or to no message at all when not even the marker fits; a start of
    more characters than the envelope's bytes cannot fit, so none is tried."""

    def cuts(length: int) -> str:
        return message[: length - 1] + ENVELOPE_CUT_MARKER if length else ""

    return _Part(message, cuts, min(len(message), max_bytes))


def fit(envelope: Envelope, *, max_bytes: int) -> Envelope:
    """Keep the envelope under `max_bytes`: of the raw response, the normalised fields and the
    error's message, every part larger than one bound is cut to at most that bound, the
    largest bound with which the envelope fits, so the largest parts are cut first, the parts
    cut share the room alike, and a part no larger than the bound (or absent: a failed call's
    null raw response) stays whole. The raw response and the normalised fields are cut to a
    preview of their JSON text that ends after a whole value (the full response stays in a
    Source of the call), the message to its start, marked as cut. Should the references be
    too many even with every part cut to its smallest, the last of them go first (their
    Sources stay). The statuses, the error category and the call are never cut."""
    if envelope.size() <= max_bytes:
        return envelope
    envelope.truncated = True
    error = envelope.error or {}
    parts = {
        "raw": _preview(envelope.raw, max_bytes),
        "normalized": _preview(envelope.normalized, max_bytes),
    }
    if error.get("message"):
        parts["message"] = _message(error["message"], max_bytes)

    def fits(bound: int) -> bool:
        envelope.raw = parts["raw"].cut(bound)
        envelope.normalized = parts["normalized"].cut(bound)
        if "message" in parts:
            envelope.error = {**error, "message": parts["message"].cut(bound)}
        return envelope.size() <= max_bytes

    references = len(envelope.sources)
    while not fits(0) and envelope.sources:
        envelope.sources.pop()
    # An envelope marked as cut has something cut: a part, when no reference went (the mark
    # alone can make an envelope one byte over its limit fit).
    largest = max(part.size for part in parts.values())
    if len(envelope.sources) == references:
        largest -= 1
    fits(_longest_that_fits(fits, min(largest, max_bytes)) or 0)
    return envelope
