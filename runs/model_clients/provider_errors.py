"""Provider failures turned into ModelError, shared by the SDK clients.

The message is built here from the status code and the provider's own error text, never from
the SDK's exception text: a proxy or a provider may echo what it received, credential included.
"""

import math
import re
import time
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import ModuleType

from runs.model_clients.base import ModelError
from runs.model_clients.transport import AnswerRefused
from runs.tools.envelope import strip_secrets

# Request timeout and rate limit; every 5xx too (see `is_retryable_status`). Not 409, which
# the SDKs' generic policy retries: both providers document it as a conflict with a resource's
# state, to be resolved before trying again, and a Messages or Chat Completions call sent again
# unchanged meets it again.
RETRYABLE_STATUS_CODES = frozenset({408, 429})
DETAIL_MAX_CHARS = 300


def request_parameters(
    configured: Mapping[str, object], requested: Mapping[str, object], *, reserved: frozenset[str]
) -> dict[str, object]:
    """The provider settings of one call; none may overwrite a field the client sets itself."""
    parameters = {**configured, **requested}
    overridden = sorted(parameters.keys() & reserved)
    if overridden:
        raise ModelError(f"Model parameters may not set {', '.join(overridden)}.", retryable=False)
    return parameters


@contextmanager
def provider_errors(
    provider: str, sdk: ModuleType, *, secret: str, timeout_s: float
) -> Iterator[None]:
    """The failures of one call through `sdk` (`openai` or `anthropic`, whose exceptions have
    the same names and shape) raised as ModelError, `from None`: the SDK's exception text may
    echo what the server received."""
    started = time.monotonic()
    try:
        yield
    except AnswerRefused as refused:
        raise refused_answer_error(provider, refused) from None
    except sdk.APIStatusError as error:
        raise status_error(
            provider, error.status_code, error.body, secret=secret, headers=error.response.headers
        ) from None
    except sdk.APIConnectionError as error:
        raise unreachable_error(
            provider,
            # At the deadline the transport closes the connection under the read.
            is_timeout=isinstance(error, sdk.APITimeoutError)
            or time.monotonic() - started >= timeout_s,
            timeout_s=timeout_s,
            cause=error.__cause__,
        ) from None


def is_retryable_status(status_code: int) -> bool:
    """429, 408 (a timeout) and 5xx pass with time; any other 4xx repeats identically."""
    return status_code in RETRYABLE_STATUS_CODES or status_code >= 500


def status_error(
    provider: str,
    status_code: int,
    body: object,
    *,
    secret: str,
    within: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> ModelError:
    """An HTTP error answer, classified by status, with the provider's reason kept short and
    without credentials (the call's key, verbatim or percent-encoded, and any that looks like
    one: a gateway may quote the key it sends upstream), and the wait its headers ask for;
    `within`: the error came as an object in an answer of that status (a gateway's 200)."""
    detail = detail_kept(_error_detail(body), secret=secret)
    message = f"{provider} answered HTTP {status_code}"
    if within is not None:
        message = f"{provider} answered HTTP {within} with an error ({status_code})"
    if detail:
        message = f"{message}: {detail}"
    return ModelError(
        message,
        retryable=is_retryable_status(status_code),
        status_code=status_code,
        retry_after=retry_after(headers or {}),
    )


def detail_kept(text: str, *, secret: str) -> str:
    """A provider's text as an error message quotes it: without credentials (the call's key,
    verbatim or percent-encoded, and any that looks like one), on one line without control
    characters, and short."""
    line = " ".join(strip_secrets(text, secrets=(secret,)).split())
    return "".join(char for char in line if unicodedata.category(char) != "Cc")[:DETAIL_MAX_CHARS]


# A number of seconds as HTTP writes one (digits; a fraction tolerated): float() would also
# read "1_0", "1e1", "+10" or other scripts' digits.
_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The seconds `Retry-After` asks for (a number of seconds or an HTTP date), or
    `retry-after-ms` (OpenAI's and Anthropic's own); None when neither says."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None and _SECONDS.fullmatch(milliseconds.strip()):
        return _seconds(float(milliseconds) / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    if _SECONDS.fullmatch(value.strip()):
        return _seconds(float(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return _seconds((when - datetime.now(UTC)).total_seconds())


def _seconds(value: float) -> float | None:
    return max(value, 0.0) if math.isfinite(value) else None


def unreachable_error(
    provider: str, *, is_timeout: bool, timeout_s: float, cause: BaseException | None = None
) -> ModelError:
    """No answer at all: a timeout or a refused/broken connection, both worth another try;
    or an answer the client did not take (`transport.AnswerRefused`), which would come again
    (the Anthropic SDK gives it as a connection error's cause; the OpenAI SDK lets it through
    as raised, and the client catches it itself)."""
    if isinstance(cause, AnswerRefused):
        return refused_answer_error(provider, cause)
    if is_timeout:
        return ModelError(f"{provider} did not answer within {timeout_s:g} s", retryable=True)
    return ModelError(f"{provider} could not be reached", retryable=True)


def refused_answer_error(provider: str, refused: AnswerRefused) -> ModelError:
    """An answer the client did not take (too large, compressed): it would come again."""
    return ModelError(f"{provider} {refused.message}", retryable=False)


def _error_detail(body: object) -> str:
    """The `error.message` of both providers' error bodies, or the raw text of anything else."""
    if isinstance(body, Mapping):
        error = body.get("error", body)
        message = error.get("message") if isinstance(error, Mapping) else error
        return message if isinstance(message, str) else ""
    return body if isinstance(body, str) else ""
