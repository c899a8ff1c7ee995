"""One interface to every model: a request of instructions, an ordered transcript and tool
specs in; one turn (text and/or tool calls with their call ids, usage) out.

The transcript is the run's own record, independent of any provider format: each assistant
turn keeps its tool calls with their ids, and each tool result names the call it answers.
Clients rebuild the provider's format from it on every turn.
"""

import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from django.conf import settings

from config.jsontext import TOO_DEEP, deeper_than, dumps, dumps_bytes, storable, storable_text


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    name: str
    arguments: dict[str, Any] | str
    """Parsed JSON arguments, or the raw string when the model sent something unparsable."""


@dataclass(frozen=True)
class UserMessage:
    text: str


@dataclass(frozen=True)
class AssistantTurn:
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: tuple[dict[str, Any], ...] = ()
    """Blocks the provider wants back with the turn, as it sent them (`ModelResponse`)."""


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    name: str
    content: str
    """The result envelope as JSON text, wrapped as untrusted data by the context builder."""
    is_error: bool = False


TranscriptItem = UserMessage | AssistantTurn | ToolResult


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    """Of the input tokens, those the provider read from its prompt cache, at its cached price."""
    cache_write_input_tokens: int = 0
    """Of the input tokens, those the provider wrote to its prompt cache, at its cache write
    price (Anthropic's `cache_creation_input_tokens`)."""


@dataclass(frozen=True)
class ModelRequest:
    instructions: str
    transcript: tuple[TranscriptItem, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_output_tokens: int = 2048
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelResponse:
    text: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    stop_reason: str
    model: str
    reasoning: tuple[dict[str, Any], ...] = ()
    """The provider's own record of its reasoning, which it wants back, unchanged, with the
    turn it belongs to: Anthropic's thinking blocks (signed) when extended thinking is on."""
    is_cut_off: bool = False
    """The provider stopped the turn at the request's output limit (`max_output_tokens`), or
    at the model's context window: its text, or its last call's arguments, may end midway."""
    is_refused: bool = False
    """The model refused the request, or its provider withheld the turn (a content filter):
    what the turn holds is no answer, and the same request meets the same refusal."""
    is_paused: bool = False
    """The provider paused a long turn before it ended (Anthropic's `pause_turn`), to be
    continued with provider-side content the run does not keep: what it holds is unfinished."""


# What stands in for arguments larger than TOOL_CALL_ARGUMENTS_MAX_BYTES, with their size and
# the limit: text the schema gate refuses, saying why (`arguments_too_large`).
TOO_LARGE = "[{size} bytes of arguments, more than the {limit} a tool call may send: not kept]"
_TOO_LARGE = re.compile(
    r"\[(?P<size>\d+) bytes of arguments, more than the (?P<limit>\d+) a tool call may send: "
    r"not kept\]"
)


def arguments_too_large(arguments: Any) -> tuple[int, int] | None:
    """The size and the limit of arguments kept as TOO_LARGE, if they were."""
    if not isinstance(arguments, str) or (match := _TOO_LARGE.fullmatch(arguments)) is None:
        return None
    return int(match["size"]), int(match["limit"])


def response_kept(response: ModelResponse) -> ModelResponse:
    """The response as the run keeps it: a model, or a server speaking for one, may send NUL
    characters or unpaired surrogates, which PostgreSQL does not store, or call arguments
    nested deeper than a run keeps (`config.jsontext.storable`); such arguments become
    `TOO_DEEP`, text the schema gate refuses as not an object. Arguments larger than a call
    may send become `TOO_LARGE`: kept whole, they would be stored in the transcript, its
    events and the call's record, and sent back to the model on every later turn."""
    return replace(
        response,
        text=storable_text(response.text),
        stop_reason=storable_text(response.stop_reason),
        model=storable_text(response.model),
        reasoning=tuple(storable(block) for block in response.reasoning),
        tool_calls=tuple(
            ToolCall(
                call_id=(
                    storable_text(call.call_id) if isinstance(call.call_id, str) else call.call_id
                ),
                name=storable_text(call.name),
                arguments=_arguments_kept(call.arguments),
            )
            for call in response.tool_calls
        ),
    )


def _arguments_kept(arguments: Any) -> dict[str, Any] | str:
    """An object, or text the schema gate refuses (what is neither, as its JSON text)."""
    if isinstance(arguments, str):
        kept = storable_text(arguments)
        size = len(kept.encode())
    elif deeper_than(arguments):
        return TOO_DEEP
    else:
        kept = storable(arguments) if isinstance(arguments, dict) else dumps(storable(arguments))
        size = len(kept.encode()) if isinstance(kept, str) else len(dumps_bytes(kept))
    limit = settings.TOOL_CALL_ARGUMENTS_MAX_BYTES
    return kept if size <= limit else TOO_LARGE.format(size=size, limit=limit)


class ModelError(Exception):
    """A provider failure. `retryable` (429, 5xx, timeouts, connection errors) decides between
    FAILED_RETRYABLE and FAILED_FINAL; the message never carries a credential."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status_code: int | None = None,
        retry_after: float | None = None,
        usage: Usage | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status_code = status_code
        self.retry_after = retry_after
        """Seconds the provider asked the caller to wait before trying again (Retry-After)."""
        self.usage = usage
        """What the provider reported spending on an answer the run cannot use: it bills it
        all the same."""


class ModelClient(Protocol):
    is_offline: bool

    def complete(self, request: ModelRequest) -> ModelResponse: ...
