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
from config.secret_names import secret_key
from runs.redaction import REDACTED, key_shown, secrets_removed

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
    return jsontext.storable(
        value,
        text=functools.partial(_text_stripped, secrets=secrets),
        key=functools.partial(_key_stripped, secrets=secrets),
        hidden=REDACTED,
    )


def _text_stripped(text: str, *, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return jsontext.storable_text(secrets_removed(text))


def _key_stripped(key: str, *, secrets: tuple[str, ...]) -> tuple[str, bool]:
    """The key as kept, and whether it names a secret (its value is then dropped)."""
    if secrets and any(secret in key for secret in secrets):
        return _text_stripped(key, secrets=secrets), secret_key(key)
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
    """The largest n in 0..`longest` for which `fits(n)`, found by bisection (each longer
    cut is as large or larger), after which the envelope holds that cut; None when not even
    n = 0 fits."""
    if not fits(0):
        return None
    shortest = 0
    while shortest < longest:
        middle = (shortest + longest + 1) // 2
        if fits(middle):
            shortest = middle
        else:
            longest = middle - 1
    fits(shortest)
    return shortest


def _cut(envelope: Envelope, part: str, max_bytes: int) -> bool:
    """Replace `part` (raw or normalized) with a preview of its JSON text: the longest start
    of it that the envelope allows, ending after a whole value (`_value_ends`); returns
    whether the envelope fits now."""
    text = json.dumps(getattr(envelope, part), ensure_ascii=False, default=str)
    setattr(envelope, part, {"preview": text})
    if envelope.size() <= max_bytes:
        return True
    # A preview of more characters than the envelope's bytes cannot fit: its ends are not
    # looked for.
    ends = _value_ends(text, max_bytes)

    def fits(index: int) -> bool:
        setattr(envelope, part, {"preview": text[: ends[index]]})
        return envelope.size() <= max_bytes

    return _longest_that_fits(fits, len(ends) - 1) is not None


def _message_cut(envelope: Envelope, max_bytes: int) -> bool:
    """Cut the error's message to its longest start that fits the envelope, in bytes as the
    envelope is stored, followed by ENVELOPE_CUT_MARKER; whole characters only. No message
    at all when not even the marker fits. Returns whether the envelope fits now."""
    error = envelope.error
    message = error.get("message", "")
    if not message:
        return envelope.size() <= max_bytes

    def fits(length: int) -> bool:
        envelope.error = {**error, "message": message[:length] + ENVELOPE_CUT_MARKER}
        return envelope.size() <= max_bytes

    if _longest_that_fits(fits, len(message) - 1) is not None:
        return True
    envelope.error = {**error, "message": ""}
    return envelope.size() <= max_bytes


def _part_size(envelope: Envelope, part: str) -> int:
    """The bytes `part` takes in the envelope: the raw response, the normalised fields or the
    error's message; none for a part that is absent."""
    if part == "message":
        value = (envelope.error or {}).get("message") or None
    else:
        value = getattr(envelope, part)
    return 0 if value is None else len(jsontext.dumps_bytes(value, default=str))


def fit(envelope: Envelope, *, max_bytes: int) -> Envelope:
    """Keep the envelope under `max_bytes`: of the raw response, the normalised fields and the
    error's message, the largest is cut first, then the next, until the envelope fits; a part
    that is absent (a failed call's raw response) stays absent. The raw response and the
    normalised fields are cut to a preview of their JSON text that ends after a whole value
    (the full response stays in a Source of the call), the message to all of it that fits,
    marked as cut. Then, should the references alone be too many, the last of them go (their
    Sources stay). The statuses, the error category and the call are never cut."""
    if envelope.size() <= max_bytes:
        return envelope
    envelope.truncated = True
    cuts = {
        "raw": lambda: _cut(envelope, "raw", max_bytes),
        "normalized": lambda: _cut(envelope, "normalized", max_bytes),
        "message": lambda: _message_cut(envelope, max_bytes),
    }
    sizes = {part: _part_size(envelope, part) for part in cuts}
    for part in sorted((part for part in cuts if sizes[part]), key=sizes.get, reverse=True):
        if cuts[part]():
            return envelope
    while envelope.size() > max_bytes and envelope.sources:
        envelope.sources.pop()
    return envelope
    envelope.truncated = True
    if _cut(envelope, "raw", max_bytes) or _cut(envelope, "normalized", max_bytes):
        return envelope
    if envelope.error is not None and _message_cut(envelope, max_bytes):
        return envelope
    while envelope.size() > max_bytes and envelope.sources:
        envelope.sources.pop()
    return envelope
