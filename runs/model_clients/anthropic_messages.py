"""Anthropic Messages through the official `anthropic` SDK."""

from collections.abc import Mapping
from typing import Any

import anthropic

from registry.models import ModelConfig
from runs.model_clients import answers
from runs.model_clients.base import (
    AssistantTurn,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResult,
    ToolSpec,
    TranscriptItem,
    Usage,
    UserMessage,
)
from runs.model_clients.provider_errors import provider_errors, request_parameters
from runs.model_clients.transport import http_client

PROVIDER = "Anthropic"
# Set by the client from the request; parameters may not replace them.
CLIENT_FIELDS = frozenset({"model", "system", "messages", "tools", "max_tokens", "stream"})
# Stop reasons of a turn ended at the output limit or at the model's context window.
CUT_OFF_STOP_REASONS = frozenset({"max_tokens", "model_context_window_exceeded"})
# The stop reason of a turn Claude's safety classifiers stopped.
REFUSAL_STOP_REASON = "refusal"
# The stop reason of a turn the API paused midway (a long turn of its own server-side work).
PAUSED_STOP_REASON = "pause_turn"
# Blocks of extended thinking, sent back verbatim with their turn (their signature is checked).
REASONING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


class AnthropicClient:
    """One Messages call per turn, the transcript rebuilt in Anthropic's format each time."""

    is_offline = False

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        api_key: str,
        timeout_s: float,
        parameters: dict[str, Any],
    ) -> None:
        self.model_name = model_config.model_name
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.parameters = parameters
        self.base_url = model_config.base_url or None

    def _sdk(self) -> anthropic.Anthropic:
        """An SDK client for one call, over the bounded transport (`transport`)."""
        return anthropic.Anthropic(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout_s,
            max_retries=0,
            http_client=http_client(self.timeout_s),
        )

    def complete(self, request: ModelRequest) -> ModelResponse:
        """Send the whole transcript; retries belong to the run loop, so the SDK makes none."""
        parameters = request_parameters(self.parameters, request.parameters, reserved=CLIENT_FIELDS)
        with (
            provider_errors(PROVIDER, anthropic, secret=self.api_key, timeout_s=self.timeout_s),
            self._sdk() as sdk,
        ):
            answer = sdk.messages.with_raw_response.create(
                model=self.model_name,
                system=request.instructions or anthropic.omit,
                messages=anthropic_messages(request.transcript),
                tools=[anthropic_tool(tool) for tool in request.tools] or anthropic.omit,
                max_tokens=request.max_output_tokens,
                extra_body=parameters or None,
            )
        return model_response(
            answers.body(PROVIDER, answer.http_response, answer_key="content", secret=self.api_key)
        )


def model_response(message: Mapping[str, Any]) -> ModelResponse:
    """The turn a Messages answer holds (`runs.model_clients.answers`): its text blocks and
    tool_use blocks in order; the input tokens written to the prompt cache and read from it
    are reported beside `input_tokens`, and count as input, each kept apart for its price
    (within the input, however much a provider claims). An empty content list is an empty
    turn (Claude ends a turn so, right after tool results); none is no turn."""
    reported = answers.mapping(message.get("usage"))
    input_tokens = answers.tokens(
        reported.get("input_tokens"),
        reported.get("cache_creation_input_tokens"),
        reported.get("cache_read_input_tokens"),
    )
    cached_input_tokens = answers.tokens(reported.get("cache_read_input_tokens"))
    usage = Usage(
        input_tokens=input_tokens,
        output_tokens=answers.tokens(reported.get("output_tokens")),
        cached_input_tokens=cached_input_tokens,
        cache_write_input_tokens=min(
            answers.tokens(reported.get("cache_creation_input_tokens")),
            input_tokens - cached_input_tokens,
        ),
    )
    content = message.get("content")
    if not isinstance(content, list):
        raise answers.no_turn(PROVIDER, missing="content list", usage=usage)
    blocks = [answers.mapping(block) for block in content]
    return ModelResponse(
        text="".join(
            answers.text(block.get("text")) for block in blocks if block.get("type") == "text"
        ),
        tool_calls=tuple(
            ToolCall(
                call_id=answers.text(block.get("id")),
                name=answers.text(block.get("name")),
                arguments=answers.arguments(block.get("input")),
            )
            for block in blocks
            if block.get("type") == "tool_use"
        ),
        usage=usage,
        stop_reason=answers.text(message.get("stop_reason")),
        model=answers.model_name(message.get("model")),
        is_cut_off=answers.text(message.get("stop_reason")) in CUT_OFF_STOP_REASONS,
        is_refused=message.get("stop_reason") == REFUSAL_STOP_REASON,
        is_paused=message.get("stop_reason") == PAUSED_STOP_REASON,
        reasoning=tuple(
            dict(block) for block in blocks if answers.text(block.get("type")) in REASONING_BLOCKS
        ),
    )


def anthropic_messages(transcript: tuple[TranscriptItem, ...]) -> list[dict[str, Any]]:
    """Content blocks per transcript item, in order, with consecutive items of one role merged
    into one message: Anthropic wants every tool_result of a turn in the single user message
    that follows the assistant's tool_use blocks.

    An assistant turn with no text and no tool call (Claude may end a turn empty, often right
    after tool results) is left out: the API refuses a message without content, and a
    placeholder text would put words in the model's mouth. The user items on either side of
    it then merge into one user message, so roles still alternate. The run's own transcript
    keeps the empty turn."""
    messages: list[dict[str, Any]] = []
    for item in transcript:
        role, blocks = _content_blocks(item)
        if not blocks:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})
    return messages


def _content_blocks(item: TranscriptItem) -> tuple[str, list[dict[str, Any]]]:
    match item:
        case UserMessage():
            return "user", [{"type": "text", "text": item.text}]
        case AssistantTurn():
            # The API also refuses a text block of whitespace only. A turn of tool calls
            # starts with its thinking blocks, as they came: with extended thinking on, the
            # API refuses the turn sent back without them (it ignores those of other turns).
            text_blocks = [{"type": "text", "text": item.text}] if item.text.strip() else []
            thinking = list(item.reasoning) if item.tool_calls else []
            return "assistant", [*thinking, *text_blocks] + [
                {
                    "type": "tool_use",
                    "id": call.call_id,
                    "name": call.name,
                    "input": call.arguments if isinstance(call.arguments, dict) else {},
                }
                for call in item.tool_calls
            ]
        case ToolResult():
            return "user", [
                {
                    "type": "tool_result",
                    "tool_use_id": item.call_id,
                    "content": item.content,
                    "is_error": item.is_error,
                }
            ]


def anthropic_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema}
