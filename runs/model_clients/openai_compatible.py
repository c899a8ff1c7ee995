"""Chat Completions through the official `openai` SDK. The model config's base URL picks the
server, so OpenAI, vLLM, Ollama and LiteLLM are all reached by this one client."""

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import openai

from config.jsontext import loads_bounded
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

PROVIDER = "OpenAI-compatible provider"
OFFICIAL_API_HOST = "api.openai.com"
# The finish reason of a choice ended at the output limit.
CUT_OFF_FINISH_REASON = "length"
# The finish reason of a choice the provider's content filter withheld (in part).
FILTERED_FINISH_REASON = "content_filter"
# Set by the client from the request; parameters may not replace them.
CLIENT_FIELDS = frozenset(
    {"model", "messages", "tools", "max_tokens", "max_completion_tokens", "stream"}
)


class OpenAICompatibleClient:
    """One Chat Completions call per turn, the transcript rebuilt in OpenAI's format each time."""

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
        # OpenAI's own API refuses `max_tokens` for its reasoning models; the servers that mimic
        # it (vLLM, Ollama, LiteLLM) have always accepted `max_tokens`.
        self.output_limit_field = (
            "max_completion_tokens"
            if urlsplit(model_config.base_url).hostname in (None, OFFICIAL_API_HOST)
            else "max_tokens"
        )
        self.base_url = model_config.base_url or None

    def _sdk(self) -> openai.OpenAI:
        """An SDK client for one call, over the bounded transport (`transport`)."""
        return openai.OpenAI(
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
            provider_errors(PROVIDER, openai, secret=self.api_key, timeout_s=self.timeout_s),
            self._sdk() as sdk,
        ):
            answer = sdk.chat.completions.with_raw_response.create(
                model=self.model_name,
                messages=chat_messages(request.instructions, request.transcript),
                tools=[function_tool(tool) for tool in request.tools] or openai.omit,
                extra_body=parameters or None,
                **{self.output_limit_field: request.max_output_tokens},
            )
        return model_response(
            answers.body(PROVIDER, answer.http_response, answer_key="choices", secret=self.api_key)
        )


def model_response(completion: Mapping[str, Any]) -> ModelResponse:
    """The turn a Chat Completions answer holds (`runs.model_clients.answers`): the first
    choice's text, given as a string or as a list of parts, and its function calls, also
    those of servers that leave out `"type": "function"`. A refusal (the message's
    `refusal`, with no content) is the turn's text. Cached input tokens are counted within
    `prompt_tokens`."""
    reported = answers.mapping(completion.get("usage"))
    input_tokens = answers.tokens(reported.get("prompt_tokens"))
    cached = answers.mapping(reported.get("prompt_tokens_details")).get("cached_tokens")
    usage = Usage(
        input_tokens=input_tokens,
        output_tokens=answers.tokens(reported.get("completion_tokens")),
        cached_input_tokens=min(answers.tokens(cached), input_tokens),
    )
    choices = answers.items(completion.get("choices"))
    if not choices or not isinstance(choices[0], Mapping):
        raise answers.no_turn(PROVIDER, missing="choice", usage=usage)
    choice = choices[0]
    message = answers.mapping(choice.get("message"))
    content = message.get("content")
    refusal = answers.text(message.get("refusal"))
    if refusal and not content:
        content = refusal
    return ModelResponse(
        text=(
            content
            if isinstance(content, str)
            else "".join(
                answers.text(answers.mapping(part).get("text")) for part in answers.items(content)
            )
        ),
        tool_calls=tuple(
            ToolCall(
                call_id=answers.text(call.get("id")),
                name=answers.text(function.get("name")),
                arguments=parsed_arguments(function.get("arguments")),
            )
            for call in map(answers.mapping, answers.items(message.get("tool_calls")))
            if call.get("type") in (None, "function")
            for function in [answers.mapping(call.get("function"))]
        ),
        usage=usage,
        stop_reason=answers.text(choice.get("finish_reason")),
        model=answers.model_name(completion.get("model")),
        is_cut_off=choice.get("finish_reason") == CUT_OFF_FINISH_REASON,
        is_refused=bool(refusal) or choice.get("finish_reason") == FILTERED_FINISH_REASON,
    )


def chat_messages(
    instructions: str, transcript: tuple[TranscriptItem, ...]
) -> list[dict[str, Any]]:
    """Instructions as the system message, then one message per transcript item in order: an
    assistant message carries its tool calls, and each tool message answers one call by id.

    An assistant turn with no text and no tool call is left out: `content` may be null only
    beside `tool_calls`, and an empty string becomes an empty text block, which gateways to
    Anthropic or Bedrock refuse. The run's own transcript keeps the empty turn. User items in
    a row (what the user said before, then their message) become one user message: the chat
    templates of some local servers (vLLM, Ollama) refuse roles that do not alternate."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in transcript:
        match item:
            case UserMessage() if messages and messages[-1]["role"] == "user":
                messages[-1]["content"] += "\n\n" + item.text
            case UserMessage():
                messages.append({"role": "user", "content": item.text})
            case AssistantTurn() if not item.text and not item.tool_calls:
                continue
            case AssistantTurn():
                message: dict[str, Any] = {"role": "assistant", "content": item.text or None}
                if item.tool_calls:
                    message["tool_calls"] = [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": raw_arguments(call)},
                        }
                        for call in item.tool_calls
                    ]
                messages.append(message)
            case ToolResult():
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.content}
                )
    return messages


def function_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema,
        },
    }


def raw_arguments(call: ToolCall) -> str:
    """The arguments as the model sent them: unparsable text goes back verbatim."""
    if isinstance(call.arguments, str):
        return call.arguments
    return json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"))


def parsed_arguments(arguments: Any) -> Any:
    """A JSON object, or the raw text so the schema gate can reject it and the model see why.
    Some servers send an empty string for a call without arguments, or the object itself."""
    if not isinstance(arguments, str):
        return answers.arguments(arguments)
    if not arguments.strip():
        return {}
    try:
        parsed = loads_bounded(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments
