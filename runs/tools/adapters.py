"""How a tool version is executed: a Python handler in this process, an HTTP service, or a
tool of an MCP server.

The host builds the `ToolContext` (identity, tenant, idempotency key, short-lived credential);
the model never supplies any of it. A handler refuses with `ToolRefused` (gate 3, nothing was
done) and fails with `ToolFailed` (it ran, and may or may not have had an effect).

Every adapter answers within the tool version's `timeout_s`, or sooner when the call's
`deadline` comes first (`attempt_seconds`). A Python handler runs on a
handler thread (`threads.call_within`), on that thread's own database connection; one that
has not answered in time fails its call TIMEOUT and is abandoned: it runs on until it
returns, and whatever it returns then is dropped, never recorded.
"""

import importlib
import json
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError

from config import jsontext
from config.egress import (
    EgressRefused,
    HTTPTransport,
    text_encoding,
    unasked_encoding,
    unasked_encoding_named,
)
from registry.choices import READ_RISKS, AdapterKind
from registry.mcp.connections import (
    Deadline,
    McpAnswerInvalid,
    McpRefused,
    McpRemoteError,
    McpTimeout,
    McpUnavailable,
    ToolListing,
    connections,
    endpoint_for,
)
from registry.mcp.review import served_hash
from registry.models import McpRemoteTool, McpServer, Tenant, ToolVersion
from registry.selectors import mcp_server_of, mcp_server_usable
from registry.services.mcp import mcp_definitions_sync
from runs.model_clients.provider_errors import is_retryable_status, retry_after
from runs.models.tools import EVIDENCE_USE
from runs.tools import threads
from runs.tools.envelope import BUSINESS_OK, ErrorCategory, strip_secrets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolContext:
    run_id: str
    call_id: str
    tenant: Tenant
    actor: AbstractBaseUser
    idempotency_key: str
    credential: str | None = None
    resources: dict[str, Any] = field(default_factory=dict, compare=False)
    """What gate 3 authorised for this call (e.g. the project), for the handler to reuse."""
    deadline: float | None = None
    """When (monotonic) the call, and its check, must have ended whatever the tool's timeout
    (its step's task time or its run's time left, `loop._calls_deadline`; its send's task
    time, `executor.tries_deadline`); None: no such bound."""


def attempt_seconds(tool_version: ToolVersion, context: ToolContext) -> float:
    """How long one try of the call, or its check, may take: the tool's timeout, or the time
    left before the context's deadline when that is shorter (a timeout may be up to 600 s,
    longer than a step is sure to have: Celery would stop the step mid-call, its work lost);
    0 when none is left. A try given less time than its timeout fails as one past it does."""
    if context.deadline is None:
        return tool_version.timeout_s
    return max(0.0, min(tool_version.timeout_s, context.deadline - time.monotonic()))


@dataclass(frozen=True)
class SourceDraft:
    reference: str
    content: str
    allowed_use: str = EVIDENCE_USE


@dataclass
class ToolOutput:
    business_status: str
    raw: Any
    normalized: dict[str, Any] = field(default_factory=dict)
    sources: list[SourceDraft] = field(default_factory=list)


def one_line(text: str) -> bool:
    """Whether `text` holds no line boundary of any kind: those of `str.splitlines` (\\n, \\r,
    \\v, \\f, \\x1c-\\x1e, \\x85, \\u2028, \\u2029), at each of which Python's email package
    folds a header."""
    return text.splitlines() in ([text], [])


class ToolRefused(Exception):
    """Gate 3: the call is not authorised for this actor, tenant or resource."""

    def __init__(self, message: str, *, category: ErrorCategory = ErrorCategory.PERMISSION_DENIED):
        super().__init__(message)
        self.category = category


class ToolFailed(Exception):
    def __init__(
        self,
        message: str,
        *,
        category: ErrorCategory,
        retryable: bool,
        may_have_side_effect: bool = False,
        raw: Any = None,
        attempted: bool = True,
        turned_away: bool = False,
        retry_after: float | None = None,
    ) -> None:
        """`attempted` is False when the call never reached the tool (the host refused to
        send it, or could not): nothing happened, whatever the tool does. `turned_away`: a
        limit turned it away (not attempted either), and it may pass once a slot frees or the
        circuit closes. `retry_after`: the seconds the tool
        asked to wait before another try (an HTTP service's Retry-After), or until the
        tool's open circuit lets a trial through or its rate window frees a place
        (`limits.calls_enter`). A category outside
        the envelope's set (a handler's own word) is UNKNOWN: the model and the run's reason
        codes are given only the stable ones."""
        super().__init__(message)
        self.category = category if category in ErrorCategory.values else ErrorCategory.UNKNOWN
        self.retryable = retryable
        self.may_have_side_effect = may_have_side_effect
        self.raw = raw
        self.attempted = attempted and not turned_away
        self.turned_away = turned_away
        self.retry_after = retry_after


class Handler(Protocol):
    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None: ...

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput: ...


def python_handler(tool_version: ToolVersion) -> Handler:
    """The handler a `python` tool names, from a module installed for tool handlers only
    (`PYTHON_TOOL_HANDLER_MODULES`, checked again here for versions published before)."""
    module_path, _, name = tool_version.adapter_config["handler"].rpartition(".")
    if module_path not in settings.PYTHON_TOOL_HANDLER_MODULES:
        raise ToolFailed(
            f"The handler of {tool_version.qualified_name} is not in a module installed for tools.",
            category=ErrorCategory.PERMISSION_DENIED,
            retryable=False,
        )
    try:
        return getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError) as error:
        raise ToolFailed(
            f"The handler of {tool_version.qualified_name} is not installed.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
        ) from error


def _handler_within(
    tool_version: ToolVersion,
    context: ToolContext,
    function: Callable[..., Any],
    *arguments: Any,
    seconds: float,
    doing: str,
) -> Any:
    """`function(context, *arguments)` of the tool's handler on a handler thread, within
    `seconds`; `threads.Overran`, logged, when it has not returned by then (it runs on,
    abandoned)."""
    try:
        return threads.call_within(function, context, *arguments, seconds=seconds)
    except threads.Overran as overran:
        logger.error(
            "%s: the handler did not %s within %.3g s and was abandoned (run %s, call %s). %s",
            tool_version.qualified_name,
            doing,
            seconds,
            context.run_id,
            context.call_id,
            overran,
        )
        raise


def handler_failure(tool_version: ToolVersion, error: Exception) -> ToolFailed:
    """A handler that raised anything but ToolFailed (or a database error, which is the
    step's) has a bug: its call failed, category UNKNOWN, and the run goes on; a tool that is
    not a read may have done something first (reconciliation finds out). The log names the
    exception and where it was raised, not its message, which may quote what the handler held."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    logger.error(
        "%s: the handler raised %s%s", tool_version.qualified_name, type(error).__name__, where
    )
    return ToolFailed(
        f"The handler of {tool_version.qualified_name} failed unexpectedly.",
        category=ErrorCategory.UNKNOWN,
        retryable=False,
        may_have_side_effect=tool_version.risk not in READ_RISKS,
    )


def python_call(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    """The handler's answer within the tool's timeout (`attempt_seconds`). One that has not
    answered by then is abandoned: the call failed TIMEOUT, retryable, and a tool that is not
    a read may have done something."""
    handler = python_handler(tool_version)
    seconds = attempt_seconds(tool_version, context)
    try:
        return _handler_within(
            tool_version, context, handler, arguments, seconds=seconds, doing="answer"
        )
    except threads.Overran:
        raise ToolFailed(
            f"The handler of {tool_version.qualified_name} did not answer within {seconds:.3g} s.",
            category=ErrorCategory.TIMEOUT,
            retryable=True,
            may_have_side_effect=tool_version.risk not in READ_RISKS,
        ) from None


# What a service's answer that is not JSON keeps of its text.
TEXT_ANSWER_CHARS = 4000
_HTTP_CATEGORIES = {
    400: ErrorCategory.INVALID_ARGUMENT,
    401: ErrorCategory.PERMISSION_DENIED,
    403: ErrorCategory.PERMISSION_DENIED,
    404: ErrorCategory.NOT_FOUND,
    408: ErrorCategory.TIMEOUT,
    422: ErrorCategory.INVALID_ARGUMENT,
    429: ErrorCategory.RATE_LIMITED,
}


def _redirect_target(response: httpx.Response) -> str:
    """Where a redirect points, without credentials, query or fragment: a login URL may carry
    a state or session token, and the host is what tells an operator where the call went.
    None is told of a location that cannot be split into those parts."""
    try:
        location = urlsplit(response.headers.get("location", ""))
    except ValueError:
        return ""
    host = location.netloc.rpartition("@")[2]
    return urlunsplit((location.scheme, host, location.path, "", ""))


def _unreached_in_time() -> ToolFailed:
    """Nothing was sent: the name was not resolved, or no connection made, in time."""
    return ToolFailed(
        "The service could not be reached in time.",
        category=ErrorCategory.TIMEOUT,
        retryable=True,
        attempted=False,
    )


def _late() -> ToolFailed:
    return ToolFailed(
        "The service did not finish its answer in time.",
        category=ErrorCategory.TIMEOUT,
        retryable=True,
        may_have_side_effect=True,
    )


def _header_shown(value: str, *, chars: int, credential: str | None) -> str:
    """A header of the service's answer as an error message names it: its secrets (the
    credential, which a service may echo in any header) stripped before it is cut to
    `chars`, so that the cut leaves no part of one, which stripping would not find."""
    return strip_secrets(value, secrets=(credential or "",))[:chars]


def _unread_body(encoding: str) -> str:
    """What an error message says of a body left unread for its `encoding`."""
    return f" Its body was not read: it was in {unasked_encoding_named(encoding)}."


def _answer(
    tool_version: ToolVersion,
    *,
    seconds: float,
    body: dict[str, Any],
    headers: dict[str, str],
    credential: str | None,
) -> tuple[httpx.Response, bytes]:
    """The service's response and its body, read within `seconds` as a whole and up to
    TOOL_RESPONSE_MAX_BYTES (past it, the body of an answer that is not a success is cut
    there, and that of a success fails the call; one in an encoding not asked for is not
    read). httpx times each read, not the whole: a
    service that sends a byte now and then, of its headers or its body, would hold the call
    for ever. So the body is read against the deadline, and at the deadline the client is
    closed under a read of the headers, which then fails within one more read's timeout."""
    deadline = time.monotonic() + seconds
    limit = settings.TOOL_RESPONSE_MAX_BYTES
    may_have_side_effect = tool_version.risk not in READ_RISKS
    locations: list[str] = []

    def location_set_aside(response: httpx.Response) -> None:
        # httpx builds the request a redirect asks for even when it follows none, and takes
        # a Location that is no URL for a broken answer: a redirect it is all the same.
        if "location" in response.headers:
            locations.append(response.headers.pop("location"))

    with httpx.Client(
        timeout=seconds,
        transport=HTTPTransport(),
        event_hooks={"response": [location_set_aside]},
    ) as client:
        watchdog = threading.Timer(seconds, client.close)
        watchdog.start()
        try:
            with client.stream(
                "POST", tool_version.adapter_config["url"], json=body, headers=headers
            ) as response:
                sent = unasked_encoding(response.headers)
                # Asked for none: a compressed answer is inflated before its size is known.
                # That of a success fails the call; that of any other answer is not read, its
                # status saying what became of the call (a 429 or 503 may pass later).
                if sent is not None and response.is_success:
                    raise ToolFailed(
                        f"The service answered in {unasked_encoding_named(sent)}.",
                        category=ErrorCategory.UPSTREAM_ERROR,
                        retryable=False,
                        may_have_side_effect=may_have_side_effect,
                    )
                chunks, size = [], 0
                for chunk in () if sent is not None else response.iter_raw():
                    size += len(chunk)
                    if size > limit and not response.is_success:
                        # Its status says what became of the call (a 429 or 503 may pass
                        # later, after its Retry-After); its body only tells more, as far
                        # as the limit.
                        chunks.append(chunk[: len(chunk) - (size - limit)])
                        break
                    if size > limit:
                        raise ToolFailed(
                            f"The service's answer is larger than {limit} bytes.",
                            category=ErrorCategory.UPSTREAM_ERROR,
                            retryable=False,
                            may_have_side_effect=may_have_side_effect,
                        )
                    if time.monotonic() > deadline:
                        raise _late()
                    chunks.append(chunk)
        except httpx.HTTPError as error:
            if time.monotonic() < deadline:
                raise
            if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
                raise _unreached_in_time() from error
            raise _late() from error
        finally:
            watchdog.cancel()
    if locations:
        response.headers["location"] = locations[0]
    return response, b"".join(chunks)


def _json(content: bytes, charset: str | None) -> Any:
    """The JSON of a service's answer: in UTF-8 (or UTF-16, UTF-32), as RFC 8259 has it and
    whatever charset it declares, or else in the charset it declares (a service sending
    ISO-8859-1 or Shift_JIS). Read as text instead, its business status would be lost, and a
    refusal taken for a success."""
    try:
        return json.loads(content)
    except UnicodeDecodeError:
        if not charset:
            raise
        return json.loads(content.decode(text_encoding(charset)).removeprefix("\ufeff"))


def _header_value(text: str) -> bool:
    """Whether `text` may be sent in an HTTP header as it is: printable ASCII, no space at
    either end (a secret's variable set from a file often ends in a line break)."""
    return text.isascii() and text.isprintable() and text == text.strip()


def http_call(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    """POST the arguments as JSON; the host adds identity, idempotency key and credential."""
    headers = {"Idempotency-Key": context.idempotency_key, "Accept-Encoding": "identity"}
    if context.credential and not _header_value(context.credential):
        # Sent, it would fail as an answer that broke off (after the call went out, so a
        # write would be taken as maybe done), with the credential in the client's error.
        raise ToolFailed(
            f"The credential {tool_version.adapter_config.get('credential_ref')} is no valid "
            "HTTP header value (a line break, a space at either end, or a character outside "
            "printable ASCII); nothing was sent.",
            category=ErrorCategory.PERMISSION_DENIED,
            retryable=False,
            attempted=False,
        )
    if context.credential:
        headers["Authorization"] = f"Bearer {context.credential}"
    body = {
        "arguments": arguments,
        "context": {
            "tenant": context.tenant.slug,
            "actor": context.actor.get_username(),
            "run_id": context.run_id,
            "call_id": context.call_id,
        },
    }
    try:
        response, content = _answer(
            tool_version,
            seconds=attempt_seconds(tool_version, context),
            body=body,
            headers=headers,
            credential=context.credential,
        )
    except EgressRefused as refused:
        raise ToolFailed(
            str(refused),
            category=ErrorCategory.PERMISSION_DENIED,
            retryable=False,
            attempted=False,
        ) from None
    except httpx.ConnectTimeout as error:
        raise _unreached_in_time() from error
    except httpx.TimeoutException as error:
        raise ToolFailed(
            "The service did not answer in time.",
            category=ErrorCategory.TIMEOUT,
            retryable=True,
            may_have_side_effect=True,
        ) from error
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as error:
        raise ToolFailed(
            "The service could not be reached.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            attempted=False,
        ) from error
    except httpx.HTTPError as error:
        # The request went out: a tool that changes something may have done it.
        raise ToolFailed(
            "The service's answer broke off.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            may_have_side_effect=tool_version.risk not in READ_RISKS,
        ) from error
    # A body in an encoding not asked for was left unread (only an answer that is not a
    # success gets this far with one): the error says so, and keeps no body for it.
    unasked = unasked_encoding(response.headers)
    unread = "" if unasked is None else _unread_body(unasked)
    is_json = True
    try:
        payload = None if unasked is not None else _json(content, response.charset_encoding)
    except (ValueError, RecursionError):
        # Not JSON, or nested too deep to parse: kept as text. Secrets go before the cut,
        # which could leave part of one; they are looked for in twice what is kept, which
        # holds whole a secret (even a private key) that starts before the cut, and bounds
        # the work on a large answer.
        is_json = False
        text = content.decode(text_encoding(response.encoding), errors="replace")
        text = text[: 2 * TEXT_ANSWER_CHARS]
        payload = {
            "text": strip_secrets(text, secrets=(context.credential or "",))[:TEXT_ANSWER_CHARS]
        }
    if 300 <= response.status_code < 400:
        # Redirects are not followed (the POST, its credential and idempotency key go to the
        # published URL only): a gateway that sends the call to a login page did not run it.
        raise ToolFailed(
            f"The service answered {response.status_code} (a redirect, not followed) "
            f"instead of a result.{unread}",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=False,
            raw={"location": _redirect_target(response), "body": payload},
        )
    if not response.is_success:
        # A try that may pass later is told when, if the service said (as a call the tool's
        # own rate limit turned away is).
        retryable = is_retryable_status(response.status_code)
        wait = retry_after(response.headers)
        when = f"; try again in {math.ceil(wait)} s" if retryable and wait is not None else ""
        raise ToolFailed(
            f"The service answered {response.status_code}{when}.{unread}",
            category=_HTTP_CATEGORIES.get(response.status_code, ErrorCategory.UPSTREAM_ERROR),
            retryable=retryable,
            may_have_side_effect=response.status_code >= 500,
            raw=payload,
            retry_after=wait,
        )
    if not is_json:
        # The service states what it did in its JSON: a 2xx without it (a proxy's page, an
        # empty body) says nothing of the business outcome. Taken for a success, a write
        # nobody knows was done would be recorded as done; it may have been, so it is left
        # unknown for reconciliation, and a read has no result. A later try may pass.
        kind = response.headers.get("content-type", "no content type").split(";")[0].strip()
        raise ToolFailed(
            f"The service answered {response.status_code} without JSON the host can read "
            f"({_header_shown(kind, chars=60, credential=context.credential)}, "
            f"{len(content)} bytes).",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            may_have_side_effect=tool_version.risk not in READ_RISKS,
            raw=payload,
        )
    if not isinstance(payload, dict):
        # The contract's answer is an object that states the business outcome: any other JSON
        # value (null, a list, a word, a number) says no more of it than a page does.
        raise ToolFailed(
            f"The service answered {response.status_code} with JSON that is not an object "
            f"({len(content)} bytes).",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            may_have_side_effect=tool_version.risk not in READ_RISKS,
            raw=payload,
        )
    normalized = payload.get("normalized") or {}
    # Sources are a list; of any other value (a number, a word) there are none.
    sources = payload.get("sources")
    # A status given as another JSON value (null, an object) is kept as its JSON text: no
    # such status is success.
    business_status = payload.get("business_status", BUSINESS_OK)
    return ToolOutput(
        business_status=business_status
        if isinstance(business_status, str)
        else jsontext.dumps(business_status),
        raw=payload.get("data", payload),
        normalized=normalized if isinstance(normalized, dict) else {"value": normalized},
        sources=[
            SourceDraft(reference=_source_reference(item), content=_source_text(item))
            for item in (sources if isinstance(sources, list) else [])
            if isinstance(item, dict) and item.get("reference")
        ],
    )


def _source_reference(source: dict[str, Any]) -> str:
    """A source's reference as the run keeps it: text as given, and any other JSON value (an
    object, a list, a number, a literal) as its canonical JSON text (compact, keys sorted),
    so that the same value is always the same reference for the model to cite."""
    reference = source["reference"]
    return reference if isinstance(reference, str) else jsontext.dumps(reference, sort_keys=True)


def _source_text(source: dict[str, Any]) -> str:
    """A source's content as the run keeps it: text as given, none (missing or null) as no
    text, and any other JSON value (an object, a list, a number) as its JSON text."""
    content = source.get("content")
    if content is None:
        return ""
    return content if isinstance(content, str) else jsontext.dumps(content)


MCP_META_PREFIX = "agentgov/"


def mcp_identity(*, tenant: Tenant, actor: AbstractBaseUser, run_id: str) -> dict[str, str]:
    """Who asks, in an MCP request's `_meta`: the run's tenant and requester, and the run. A
    server answers a tool call or a resource read with what that person may see."""
    return {
        f"{MCP_META_PREFIX}tenant": tenant.slug,
        f"{MCP_META_PREFIX}actor": actor.get_username(),
        f"{MCP_META_PREFIX}run_id": run_id,
    }


def _mcp_server(tool_version: ToolVersion, context: ToolContext) -> McpServer:
    """The call's server, if it is available to the run's tenant. Gate 3 finds it and keeps
    it in the call's resources; the call itself reuses it."""
    key = f"mcp_server:{tool_version.pk}"
    if key not in context.resources:
        server = mcp_server_of(tool_version)
        if not mcp_server_usable(server=server, tenant=context.tenant):
            raise ToolRefused(
                f"The MCP server of {tool_version.qualified_name} is not available here."
            )
        context.resources[key] = server
    return context.resources[key]


def _mcp_output(
    *, server: McpServer, remote_name: str, context: ToolContext, result: Any, secrets: tuple
) -> ToolOutput:
    """Content blocks, structured content and `isError` into the envelope's parts. Every text
    from the server is untrusted data: kept as evidence, never as instructions."""
    blocks: list[dict[str, Any]] = []
    texts: list[str] = []
    sources: list[SourceDraft] = []
    for block in result.content:
        if block.type == "text":
            texts.append(block.text)
            blocks.append({"type": "text", "text": block.text})
        elif block.type == "resource":
            uri, text = str(block.resource.uri), getattr(block.resource, "text", None)
            blocks.append({"type": "resource", "uri": uri, "mimeType": block.resource.mimeType})
            if text:
                sources.append(SourceDraft(reference=uri, content=text))
        elif block.type == "resource_link":
            blocks.append({"type": "resource_link", "uri": str(block.uri), "name": block.name})
        else:
            blocks.append({"type": block.type, "mimeType": getattr(block, "mimeType", None)})
    structured = result.structuredContent
    raw = strip_secrets({"content": blocks, "structuredContent": structured}, secrets=secrets)
    if result.isError:
        return ToolOutput(business_status="failed", raw=raw)
    content = (
        json.dumps(structured, ensure_ascii=False, sort_keys=True)
        if structured is not None
        else "\n".join(texts)
    )
    sources.insert(
        0,
        SourceDraft(
            reference=f"mcp://{server.name}/{remote_name}#{context.call_id}",
            content=content,
        ),
    )
    return ToolOutput(
        business_status=BUSINESS_OK,
        raw=raw,
        normalized=raw["structuredContent"] if isinstance(structured, dict) else {},
        sources=[
            SourceDraft(
                reference=strip_secrets(draft.reference, secrets=secrets),
                content=strip_secrets(draft.content, secrets=secrets),
                allowed_use=draft.allowed_use,
            )
            for draft in sources
        ],
    )


def mcp_call(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    """`tools/call` on the server's shared session, after checking that the server still
    serves the definition this version was reviewed against, as this process's listing (kept
    MCP_DEFINITION_CACHE_SECONDS) and the registry's record (which any process that saw a
    change wrote) both say; a tool that is not a read (an approved send) lists the server
    afresh, never from the copy, so what it does is the contract reviewed as served now. The
    host, never the model, supplies the credential (in the connection) and the identity (in
    `_meta`). All of it (the server's name looked up, its session opened, its tools listed
    again when the copy is stale or the call writes, the call) ends within the version's
    timeout (`attempt_seconds`). A failure before the call was sent (the server unreachable,
    its listing late or refused, the tool changed) did nothing: it was not attempted."""
    deadline = Deadline.after(attempt_seconds(tool_version, context))
    server = _mcp_server(tool_version, context)
    config = tool_version.adapter_config
    remote_name = config["remote_name"]
    writes = tool_version.risk not in READ_RISKS
    sent = False
    secrets: tuple[str, ...] = ()
    try:
        endpoint = endpoint_for(server, deadline=deadline)
        secrets = endpoint.secrets
        listing = connections.tools_cached(
            endpoint,
            max_age_s=0 if writes else settings.MCP_DEFINITION_CACHE_SECONDS,
            deadline=deadline,
        )
        reviewed = config["definition_hash"]
        recorded = _mcp_recorded_hash(server, remote_name)
        if not writes and _mcp_served_hash(listing, remote_name) == reviewed != recorded:
            # Another process saw a change this process's copy is too young to show: the
            # server decides, listed again.
            listing = connections.tools(endpoint, deadline=deadline)
        served = _mcp_served_hash(listing, remote_name)
        if served != recorded:
            # Recorded once, by the call that sees it first: a write moves the registry's
            # generation, and with it every process's cached snapshots.
            mcp_definitions_sync(server=server, listing=listing, secrets=secrets)
        if served != reviewed:
            change = f"changed or removed {remote_name} since {tool_version.qualified_name}"
            if remote_name in listing.ambiguous:
                change = (
                    f"lists {remote_name} more than once with different definitions (which of "
                    f"them it runs is not known) since {tool_version.qualified_name}"
                )
            raise ToolFailed(
                f"{server} {change} was reviewed; a new reviewed version is needed.",
                category=ErrorCategory.TOOL_DEFINITION_CHANGED,
                retryable=False,
                attempted=False,
            )
        sent = True
        result = connections.call_tool(
            endpoint,
            remote_name,
            arguments,
            meta={
                **mcp_identity(tenant=context.tenant, actor=context.actor, run_id=context.run_id),
                f"{MCP_META_PREFIX}call_id": context.call_id,
                f"{MCP_META_PREFIX}idempotency_key": context.idempotency_key,
            },
            deadline=deadline,
        )
    except McpRefused as error:
        raise ToolFailed(
            str(error), category=ErrorCategory.PERMISSION_DENIED, retryable=False, attempted=sent
        ) from error
    except McpTimeout as error:
        raise ToolFailed(
            strip_secrets(str(error), secrets=secrets),
            category=ErrorCategory.TIMEOUT,
            retryable=True,
            may_have_side_effect=writes and sent,
            attempted=sent,
        ) from error
    except McpUnavailable as error:
        raise ToolFailed(
            strip_secrets(str(error), secrets=secrets),
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
            may_have_side_effect=writes and sent,
            attempted=sent,
        ) from error
    except McpRemoteError as error:
        # The server's own message: it may echo what it was sent, credential included. A
        # protocol error says the call was not run; an answer the host cannot read does not.
        raise ToolFailed(
            strip_secrets(str(error), secrets=secrets),
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=False,
            may_have_side_effect=writes and sent and isinstance(error, McpAnswerInvalid),
            attempted=sent,
        ) from error
    limit = settings.TOOL_RESPONSE_MAX_BYTES
    if _mcp_answer_size(result) > limit:
        raise ToolFailed(
            f"The server's answer is larger than {limit} bytes.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=False,
            may_have_side_effect=writes,
        )
    return _mcp_output(
        server=server, remote_name=remote_name, context=context, result=result, secrets=secrets
    )


def _mcp_served_hash(listing: ToolListing, remote_name: str) -> str | None:
    """The hash of the definition the listing serves under `remote_name`, if it serves one
    (and one only: a name listed with different definitions serves none)."""
    served = listing.definitions.get(remote_name)
    return None if served is None else served_hash(served)[0]


def _mcp_recorded_hash(server: McpServer, remote_name: str) -> str | None:
    """The hash of the definition the registry records `server` serving under `remote_name`
    (what any process that listed it last saw), unless it records that it stopped."""
    return (
        McpRemoteTool.objects.filter(
            server=server, remote_name=remote_name, removed_at__isnull=True
        )
        .values_list("current__definition_hash", flat=True)
        .first()
    )


def _mcp_answer_size(result: Any) -> int:
    """Bytes of the texts and structured content of an MCP answer, as the run would keep them."""
    size = 0
    for block in result.content:
        if block.type == "text":
            text = block.text
        else:
            text = getattr(getattr(block, "resource", None), "text", None)
        if isinstance(text, str):
            size += len(text.encode(errors="replace"))
    if result.structuredContent is not None:
        size += len(jsontext.dumps_bytes(result.structuredContent, default=str))
    return size


def authorize(tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]) -> None:
    """Gate 3 for Python handlers; an HTTP service or an MCP server authorises the identity
    the host sends, once the host found the MCP server available to the run's tenant (the
    platform's own rows). A handler's check is its own code, which may ask a database or a
    service: it runs within the tool's timeout, as the call does (`attempt_seconds`: the
    checks of a step's calls run one after another, within the step's time), so a slow check
    fails the call TIMEOUT, before anything ran, instead of holding the step and its run's
    lock. With no time left, the handler is not asked."""
    if tool_version.adapter_kind == AdapterKind.PYTHON:
        handler = python_handler(tool_version)
        seconds = attempt_seconds(tool_version, context)
        if seconds <= 0:
            raise ToolFailed(
                f"The handler of {tool_version.qualified_name} was not asked to authorise the "
                "call: its step had no time left for it.",
                category=ErrorCategory.TIMEOUT,
                retryable=True,
                attempted=False,
            )
        try:
            _handler_within(
                tool_version,
                context,
                handler.authorize,
                arguments,
                seconds=seconds,
                doing="authorise the call",
            )
        except threads.Overran:
            raise ToolFailed(
                f"The handler of {tool_version.qualified_name} did not authorise the call "
                f"within {seconds:.3g} s.",
                category=ErrorCategory.TIMEOUT,
                retryable=True,
                attempted=False,
            ) from None
    elif tool_version.adapter_kind == AdapterKind.MCP:
        _mcp_server(tool_version, context)


def reconcile(tool_version: ToolVersion, context: ToolContext) -> ToolOutput:
    """The outcome of an earlier call with `context.idempotency_key`, from the tool itself,
    asked on a handler thread within the tool's timeout, or sooner when the reconciliation's
    task time ends first (`attempt_seconds`): the run's row and action stay locked while it
    answers. Raises ToolFailed: NOT_FOUND when the tool has no record of the key (it never
    started), UNKNOWN (may_have_side_effect) when the outcome is still not known, or the
    handler did not tell it in time, or raised (`handler_failure`: a bug, or a system it asks
    that is down), so the attempt counts and the next is made after its backoff."""
    handler = (
        python_handler(tool_version) if tool_version.adapter_kind == AdapterKind.PYTHON else None
    )
    if handler is None or not hasattr(handler, "reconcile"):
        raise ToolFailed(
            f"{tool_version.qualified_name} cannot be asked about an earlier call.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
            may_have_side_effect=True,
        )
    seconds = attempt_seconds(tool_version, context)
    try:
        return _handler_within(
            tool_version, context, handler.reconcile, seconds=seconds, doing="tell the outcome"
        )
    except threads.Overran:
        raise ToolFailed(
            f"The handler of {tool_version.qualified_name} did not tell the outcome within "
            f"{seconds:.3g} s.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
            may_have_side_effect=True,
        ) from None
    except (ToolFailed, DatabaseError):
        raise
    except Exception as error:
        raise handler_failure(tool_version, error) from error


def execute(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    if tool_version.adapter_kind == AdapterKind.PYTHON:
        return python_call(tool_version, context, arguments)
    if tool_version.adapter_kind == AdapterKind.HTTP:
        return http_call(tool_version, context, arguments)
    return mcp_call(tool_version, context, arguments)
