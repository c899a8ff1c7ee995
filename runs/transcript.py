"""The run's transcript as stored JSON and as the model clients' items: an assistant turn with
its call ids first, then the result of each call, in order."""

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
            items.append(AssistantTurn(text=entry["text"], tool_calls=calls))
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


def assistant_entry(text: str, calls: tuple[ToolCall, ...]) -> dict[str, Any]:
    return {
        "kind": "assistant",
        "text": text,
        "tool_calls": [
            {"call_id": call.call_id, "name": call.name, "arguments": call.arguments}
            for call in calls
        ],
    }


def result_entry(*, call_id: str, name: str, content: str, is_error: bool) -> dict[str, Any]:
    return {
        "kind": "tool_result",
        "call_id": call_id,
        "name": name,
        "content": content,
        "is_error": is_error,
    }


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
