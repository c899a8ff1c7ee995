"""JSON text for the rows, envelopes and transcripts a run writes on every step: compact UTF-8
through orjson, several times faster than the standard library. A value orjson refuses (an
integer beyond 64 bits, a lone surrogate, nesting deeper than 254 levels) is written by the
standard library instead, as the same JSON with non-ASCII characters escaped.
"""

import json
from collections.abc import Callable
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
