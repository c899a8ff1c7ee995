"""Provider failures turned into ModelError, shared by the SDK clients.

The message is built here from the status code and the provider's own error text, never from
the SDK's exception text: a proxy or a provider may echo what it received, credential included.
"""

from collections.abc import Mapping

from runs.model_clients.base import ModelError

# Request timeout and rate limit; every 5xx too (see `is_retryable_status`). Not 409, which
# the SDKs' generic policy retries: both providers document it as a conflict with a resource's
# state, to be resolved before trying again, and a Messages or Chat Completions call sent again
# unchanged meets it again.
RETRYABLE_STATUS_CODES = frozenset({408, 429})
DETAIL_MAX_CHARS = 300
REDACTED = "[redacted]"


def request_parameters(
    configured: Mapping[str, object], requested: Mapping[str, object], *, reserved: frozenset[str]
) -> dict[str, object]:
    """The provider settings of one call; none may overwrite a field the client sets itself."""
    parameters = {**configured, **requested}
    overridden = sorted(parameters.keys() & reserved)
    if overridden:
        raise ModelError(f"Model parameters may not set {', '.join(overridden)}.", retryable=False)
    return parameters


def is_retryable_status(status_code: int) -> bool:
    """429, 408 (a timeout) and 5xx pass with time; any other 4xx repeats identically."""
    return status_code in RETRYABLE_STATUS_CODES or status_code >= 500


def status_error(provider: str, status_code: int, body: object, *, secret: str) -> ModelError:
    """An HTTP error answer, classified by status, with the provider's reason kept short."""
    detail = " ".join(_redact(_error_detail(body), secret).split())[:DETAIL_MAX_CHARS]
    message = f"{provider} answered HTTP {status_code}"
    if detail:
        message = f"{message}: {detail}"
    return ModelError(
        message,
        retryable=is_retryable_status(status_code),
        status_code=status_code,
    )


def unreachable_error(provider: str, *, is_timeout: bool, timeout_s: float) -> ModelError:
    """No answer at all: a timeout or a refused/broken connection, both worth another try."""
    if is_timeout:
        return ModelError(f"{provider} did not answer within {timeout_s:g} s", retryable=True)
    return ModelError(f"{provider} could not be reached", retryable=True)


def _error_detail(body: object) -> str:
    """The `error.message` of both providers' error bodies, or the raw text of anything else."""
    if isinstance(body, Mapping):
        error = body.get("error", body)
        message = error.get("message") if isinstance(error, Mapping) else error
        return message if isinstance(message, str) else ""
    return body if isinstance(body, str) else ""


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, REDACTED) if secret else text
