"""A provider's answer read as plain JSON, whatever its shape.

The SDKs build their response objects without validating them, so a server that only looks
like OpenAI or Anthropic (vLLM, Ollama, a LiteLLM or OpenRouter gateway, a proxy's error page)
hands the clients strings where objects belong, `None` where a number belongs, or an error
object in a 200. The clients take the answer's bytes instead and read each field here with the
type it must have: a field of another type counts as absent. An answer that is not a JSON
object, or that is an error, becomes a `ModelError`, never an exception the step cannot place.
"""

import json
from collections.abc import Mapping
from typing import Any

import httpx

from runs.model_clients.base import ModelError, Usage
from runs.model_clients.provider_errors import detail_kept, status_error

# The longest model name kept, as long as `ModelConfig.model_name` may be.
MODEL_NAME_MAX_CHARS = 200
# Tokens one turn may count: ten times the largest context a model offers today. A provider
# that reports more (or a negative count) is wrong, and a run's total must fit its column.
TURN_TOKENS_MAX = 10_000_000
# The status an error object in a 200 stands for, when it names a kind and not a status
# (Anthropic's error types; OpenAI-style gateways also name rate limits so).
_ERROR_KIND_STATUS = {
    "invalid_request_error": 400,
    "context_length_exceeded": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
    "api_error": 500,
    "overloaded_error": 529,
}
# An error object that says neither: a gateway's trouble, worth another try.
_UNKNOWN_ERROR_STATUS = 502


def text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def model_name(value: Any) -> str:
    """The model a provider says answered, as long as a model config may name one: a gateway
    that reports more would make every turn's event carry it."""
    return text(value)[:MODEL_NAME_MAX_CHARS]


def mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def tokens(*values: Any) -> int:
    """A turn's token count from the provider's fields: each a non-negative integer or none."""
    counted = sum(value for value in values if type(value) is int and value > 0)
    return min(counted, TURN_TOKENS_MAX)


def body(
    provider: str, response: httpx.Response, *, answer_key: str, secret: str
) -> Mapping[str, Any]:
    """The JSON object of a 2xx answer. Anything else is a `ModelError`, retryable: a proxy's
    page or a cut answer passes with time. An error object (`{"error": ...}` without
    `answer_key`, or Anthropic's `"type": "error"`) is the error it describes."""
    try:
        # Parsed whole: arguments nested too deep are cut later (`base.response_kept`).
        answer = json.loads(response.content)
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, Mapping):
        # A proxy's header, quoted in the run's result and the worker's log.
        kind = detail_kept(response.headers.get("content-type", "").split(";")[0], secret=secret)
        raise ModelError(
            f"{provider} answered HTTP {response.status_code} with something other than a "
            f"JSON object ({kind or 'no content type'}, {len(response.content)} bytes).",
            retryable=True,
            status_code=response.status_code,
        )
    if answer.get("type") == "error" or ("error" in answer and answer_key not in answer):
        raise status_error(
            provider,
            _error_status(mapping(answer.get("error"))),
            answer,
            secret=secret,
            within=response.status_code,
        )
    return answer


def _error_status(error: Mapping[str, Any]) -> int:
    for key in ("code", "status"):
        value = error.get(key)
        # An HTTP status has three digits; int() refuses a text of thousands of them.
        if isinstance(value, str) and value.isdecimal() and len(value) == 3:
            value = int(value)
        if type(value) is int and 400 <= value <= 599:
            return value
    for key in ("type", "code"):
        if (status := _ERROR_KIND_STATUS.get(text(error.get(key)))) is not None:
            return status
    return _UNKNOWN_ERROR_STATUS


def no_turn(provider: str, *, missing: str, usage: Usage) -> ModelError:
    """An answer that holds no turn at all: a Chat Completions answer without a choice, a
    Messages answer without a content list (a content filter's, a gateway's). Final, as the
    same request meets it again, and paid for, as the provider bills the prompt all the same.
    A turn with nothing in it (a choice without content, Claude's `"content": []`) is another
    matter: it is a turn, which the run answers like any other."""
    return ModelError(
        f"{provider} answered without a turn (no {missing}).", retryable=False, usage=usage
    )


def arguments(value: Any) -> Any:
    """Call arguments as sent: an object (some servers send one where text belongs), or
    none, which is no arguments. Any other value is left as it is, for `base.response_kept`
    to keep as its JSON text, which the schema gate refuses as not an object."""
    return {} if value is None else value
