"""JSON text for the rows, envelopes and transcripts a run writes on every step: compact UTF-8
through orjson, several times faster than the standard library. A value orjson refuses (an
integer beyond 64 bits, a lone surrogate, nesting deeper than 254 levels) is written by the
standard library instead, as the same JSON with non-ASCII characters escaped.
"""

import json
import math
import re
from collections.abc import Callable
from datetime import date, datetime, time
from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumps_bytes(
    value: Any, *, default: Callable[[Any], Any] | None = None, sort_keys: bool = False
) -> bytes:
    """`value` as compact JSON in UTF-8; `default` turns a value JSON has no type for into one
    it has, or raises TypeError (which is raised as it is)."""
    try:
        options = _OPTIONS | orjson.OPT_SORT_KEYS if sort_keys else _OPTIONS
        if default is None:
            return orjson.dumps(value, option=options)
        return orjson.dumps(value, default=default, option=options)
    except orjson.JSONEncodeError as error:
        if isinstance(error.__cause__, TypeError):
            raise error.__cause__ from None
        return json.dumps(
            value, default=default, sort_keys=sort_keys, separators=(",", ":")
        ).encode()


def dumps(
    value: Any, *, default: Callable[[Any], Any] | None = None, sort_keys: bool = False
) -> str:
    """`value` as compact JSON text."""
    return dumps_bytes(value, default=default, sort_keys=sort_keys).decode()


# JSON from outside (a tool's response, a model's output) nests at most this many objects and
# arrays: deeper data is not kept whole, and the walks over what a run keeps (secret stripping,
# canonical hashing, the API's redaction) stay far from the interpreter's recursion limit.
MAX_DEPTH = 64
# What stands in for data nested deeper.
TOO_DEEP = f"[nested deeper than {MAX_DEPTH} levels: not kept]"
# What PostgreSQL's JSON cannot hold in text: NUL, and surrogates UTF-8 has no bytes for.
_NOT_STORABLE = re.compile(r"[\x00\ud800-\udfff]")


def storable_text(text: str) -> str:
    """`text` with NUL and unpaired surrogates replaced by U+FFFD."""
    if text.isascii() and "\x00" not in text:
        return text
    return _NOT_STORABLE.sub("\ufffd", text)


def storable(
    value: Any,
    *,
    text: Callable[[str], str] = storable_text,
    key: Callable[[str], tuple[str, bool]] | None = None,
    hidden: Any = None,
    depth: int = 0,
) -> Any:
    """`value`, given by a tool or a model, as JSON PostgreSQL stores: `text` applied to every
    string (by default `storable_text`, which any other `text` must also do) and key, a key
    made text first; with `key`, each key is shown as `key` names it (storable), and its value
    is `hidden` when `key` says so. Tuples and sets become arrays, numbers that are not finite
    null, times ISO 8601 text, any other object its text, and what nests deeper than
    MAX_DEPTH is TOO_DEEP."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        kept = {}
        for name, item in value.items():
            name = name if isinstance(name, str) else str(name)
            shown, hide = (text(name), False) if key is None else key(name)
            kept[shown] = (
                hidden
                if hide
                else storable(item, text=text, key=key, hidden=hidden, depth=depth + 1)
            )
        return kept
    if isinstance(value, list | tuple | set | frozenset):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        return [
            storable(item, text=text, key=key, hidden=hidden, depth=depth + 1) for item in value
        ]
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    return text(str(value))


def deeper_than(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests objects and arrays more than `limit` levels deep (`{}` is one).
    Walked with a stack of its own, so any depth is answered."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def loads_bounded(text: str | bytes) -> Any:
    """JSON text from outside, parsed and `storable` (its escapes may spell a NUL, a lone
    surrogate or NaN); ValueError when it is not JSON or nests deeper than MAX_DEPTH (also
    when it nests too deep for the standard library's parser)."""
    try:
        value = json.loads(text)
    except RecursionError as error:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels.") from error
    if deeper_than(value):
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels.")
    return storable(value)


def strings_mapped(value: Any, function: Callable[[str], str]) -> Any:
    """A JSON value with `function` applied to each of its strings, its objects' keys
    included."""
    if isinstance(value, str):
        return function(value)
    if isinstance(value, dict):
        return {function(key): strings_mapped(item, function) for key, item in value.items()}
    if isinstance(value, list):
        return [strings_mapped(item, function) for item in value]
    return value
