"""The run's transcript as stored JSON and as the model clients' items: an assistant turn with
its call ids first, then the result of each call, in order.

A call id names one call of the run: its record, its result, its idempotency key. The host
makes its own calls under ids that start with `host-`; a model's call keeps the id its
provider gave it unless that id could name another call (`calls_with_own_ids`).
"""

import re
from dataclasses import replace
from typing import Any

from runs.model_clients.base import AssistantTurn, ToolCall, ToolResult, TranscriptItem, UserMessage


def to_items(stored: list[dict[str, Any]]) -> tuple[TranscriptItem, ...]:
    items: list[TranscriptItem] = []
    for entry in stored:
        if entry["kind"] == "user":
            items.append(UserMessage(text=entry["text"]))
        elif entry["kind"] == "assistant":
            calls = tuple(
                ToolCall(call_id=call["call_id"], name=call["name"], arguments=call["arguments"])
                for call in entry["tool_calls"]
            )
            items.append(
                AssistantTurn(
                    text=entry["text"],
                    tool_calls=calls,
                    reasoning=tuple(entry.get("reasoning", ())),
                )
            )
        else:
            items.append(
                ToolResult(
                    call_id=entry["call_id"],
                    name=entry["name"],
                    content=entry["content"],
                    is_error=entry["is_error"],
                )
            )
    return tuple(items)


def user_entry(text: str) -> dict[str, Any]:
    return {"kind": "user", "text": text}


def assistant_entry(
    text: str, calls: tuple[ToolCall, ...], reasoning: tuple[dict[str, Any], ...] = ()
) -> dict[str, Any]:
    entry = {
        "kind": "assistant",
        "text": text,
        "tool_calls": [
            {"call_id": call.call_id, "name": call.name, "arguments": call.arguments}
            for call in calls
        ],
    }
    if reasoning:
        entry["reasoning"] = list(reasoning)
    return entry


def result_entry(*, call_id: str, name: str, content: str, is_error: bool) -> dict[str, Any]:
    return {
        "kind": "tool_result",
        "call_id": call_id,
        "name": name,
        "content": content,
        "is_error": is_error,
    }


HOST_CALL_PREFIX = "host-"
# An id every provider accepts back in the calls and results it is sent.
_PROVIDER_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def calls_with_own_ids(
    calls: tuple[ToolCall, ...], *, transcript: list[dict[str, Any]]
) -> tuple[ToolCall, ...]:
    """The calls of a model turn, each under an id no other call of the run has: its
    provider's, unless that id is missing or unusable, is the host's (`host-`), or was given
    to an earlier call of the run or of this turn (a provider may number calls per turn, or
    repeat one); then `call` and the call's number in the run in five digits (the next free
    one). Answered by a reused id, a call would be paired with another call's result, or pass
    no gate as a call already made. The id is sent back to the provider with the call and
    its result: nine letters and digits is what the strictest takes (Mistral's rule, also
    behind an OpenAI-compatible gateway)."""
    earlier = [
        call["call_id"]
        for entry in transcript
        if entry["kind"] == "assistant"
        for call in entry["tool_calls"]
    ]
    taken = set(earlier)
    number = len(earlier)
    own = []
    for call in calls:
        number += 1
        call_id = call.call_id
        if (
            not isinstance(call_id, str)
            or not _PROVIDER_CALL_ID.fullmatch(call_id)
            or call_id.startswith(HOST_CALL_PREFIX)
            or call_id in taken
        ):
            call_id = f"call{number:05d}"
            while call_id in taken:
                number += 1
                call_id = f"call{number:05d}"
        taken.add(call_id)
        own.append(call if call_id == call.call_id else replace(call, call_id=call_id))
    return tuple(own)


def pending_calls(stored: list[dict[str, Any]]) -> list[ToolCall]:
    """The calls of the last assistant turn that have no result yet."""
    answered = {entry["call_id"] for entry in stored if entry["kind"] == "tool_result"}
    for entry in reversed(stored):
        if entry["kind"] == "assistant":
            return [
                ToolCall(call_id=call["call_id"], name=call["name"], arguments=call["arguments"])
                for call in entry["tool_calls"]
                if call["call_id"] not in answered
            ]
    return []
