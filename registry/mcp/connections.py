"""One client session per MCP server per process, shared by every call made in it.

The `mcp` SDK is asynchronous; workers, admin requests and beat tasks are not. Each process
runs one event loop on a daemon thread (started on first use, again after a fork) that holds
the sessions; synchronous callers hand it coroutines and wait with explicit timeouts. A
session whose transport broke is dropped and the next call opens a new one. Secrets (the stdio
environment, the HTTP bearer token) are read from the host's environment when a connection
opens and exist nowhere else.
"""

import asyncio
import atexit
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TextIO, TypeVar

import anyio
import anyio.abc
import httpx
import mcp.client.stdio as sdk_stdio
import mcp.client.streamable_http as sdk_http
import pydantic
from django.conf import settings
from mcp import ClientSession, McpError, StdioServerParameters
from mcp import types as mcp_types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage

from config import jsontext
from config.credentials import credential_refusal, credential_value
from config.egress import AsyncHTTPTransport, EgressRefused, egress_refusal
from registry.mcp.review import definition_of, listed_ambiguously, nested_too_deep
from registry.models import McpServer, Tenant
from runs.redaction import known_secrets_replaced, secrets_removed

logger = logging.getLogger(__name__)
T = TypeVar("T")
Page = TypeVar("Page", bound=mcp_types.PaginatedResult)

# A listing of more pages is refused (`_every_page`), never taken as complete.
LIST_PAGES_MAX = 100
CLOSE_TIMEOUT_S = 5.0
# A request's answer is waited for this long past its timeout (the SDK's own read timeout,
# where the operation sets one, ends it first).
ANSWER_GRACE_S = 1.0
# A session the server no longer knows is opened again once for the same request
# (`McpConnections._on_session`): an operation may make that many handshakes and requests.
SESSION_ATTEMPTS = 2
# How long a synchronous caller waits past the longest an operation may take
# (`McpConnections._longest_s`), for the event loop to hand over the operation's own outcome.
LOOP_GRACE_S = 2.0
# What the SDK answers a request with when the server no longer knows the session (HTTP 404:
# it restarted, or expired the session): the request was not run.
SESSION_TERMINATED = 32600
# An HTTP answer carries one message (over SSE, with the notifications before it), and so does
# a line a stdio server writes. A tool's answer within TOOL_RESPONSE_MAX_BYTES (its texts and
# structured content) fits in this many times as many bytes, JSON escapes included, and a page
# of a listing in the floor below, whatever that setting; one past both is not read further.
ANSWER_MAX_FACTOR = 4
ANSWER_MAX_BYTES_FLOOR = 1024 * 1024
# A stdio server's stderr is logged a line at a time, a line of at most this many bytes.
STDERR_LINE_MAX_BYTES = 4096


def _answer_max_bytes() -> int:
    return max(ANSWER_MAX_FACTOR * settings.TOOL_RESPONSE_MAX_BYTES, ANSWER_MAX_BYTES_FLOOR)


class McpUnavailable(Exception):
    """The server could not be reached, or its connection broke during the request."""


class McpRefused(McpUnavailable):
    """The platform does not call the server: its address is refused (`config.egress`), or a
    secret its connection needs is not granted or not set on this host. Nothing was sent, and
    no later try passes until an operator changes the setting."""


class McpTimeout(Exception):
    """The server did not answer within the request's timeout, or the platform stopped
    waiting for the request's outcome (the message says which)."""


class McpRemoteError(Exception):
    """The server answered the request with a protocol error."""


class McpAnswerInvalid(McpRemoteError):
    """The server answered the request, but not as the protocol allows (past the answer's
    size limit, a result of another shape, content outside the tool's output schema): unlike
    a protocol error, it says nothing of whether the server ran the request."""


class _SessionTerminated(Exception):
    """The server no longer knows the session the request was sent in."""


class _AnswerTooLarge(Exception):
    """An HTTP answer or a stdio server's line ran past its limit, or an HTTP answer came
    compressed (its size unknown until inflated): it was not read further."""


class _AnswerUnreadable(Exception):
    """An HTTP answer that is not JSON-RPC (a body of another content type, one that does not
    parse): the transport hands it to the session, which no request waiting sees."""


class _AnswerTooDeep(Exception):
    """An answer nesting deeper than the SDK's JSON parser reads (a tool listing with a schema
    about 100 levels deep): the SDK drops it, which would leave its request waiting."""


def _too_deep(error: pydantic.ValidationError) -> _AnswerTooDeep | None:
    """What an answer the SDK could not parse held too deep, if that is why: the tools it
    lists that nest deeper than jsontext.MAX_DEPTH (the most the registry keeps), named."""
    (detail, *_) = error.errors(include_url=False) or [{}]
    if detail.get("type") != "json_invalid" or "recursion limit" not in detail["msg"]:
        return None
    try:
        tools = json.loads(detail["input"])["result"]["tools"]
        names = [
            str(tool.get("name"))[:100]
            for tool in tools
            if isinstance(tool, dict) and jsontext.deeper_than(tool)
        ]
    except (RecursionError, ValueError, TypeError, KeyError, AttributeError):
        names = []
    if not names:
        return _AnswerTooDeep("an answer nesting too deep for the platform to read")
    return _AnswerTooDeep(f"a listing the platform cannot read: {nested_too_deep(names[:3])}")


class _BoundedStream(httpx.AsyncByteStream):
    """A response body that fails once it has given more than `limit` bytes."""

    def __init__(self, stream: httpx.AsyncByteStream, limit: int, on_too_large: Callable) -> None:
        self._stream, self._limit, self._on_too_large = stream, limit, on_too_large

    async def __aiter__(self):
        size = 0
        async for chunk in self._stream:
            size += len(chunk)
            if size > self._limit:
                raise self._on_too_large(f"larger than {self._limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class _BoundedTransport(AsyncHTTPTransport):
    """The egress transport, each answer read up to its limit (ANSWER_MAX_FACTOR). The SDK
    reads a JSON answer whole before parsing it, and an SSE event whole before its end, so
    the check is made as the bytes arrive; an answer past it closes the connection
    (`on_too_large`), which fails the request waiting for it."""

    def __init__(self, on_too_large: Callable[[str], _AnswerTooLarge]) -> None:
        super().__init__()
        self._on_too_large = on_too_large

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise self._on_too_large(f"in {encoding[:40]} encoding, which was not asked for")
        response.stream = _BoundedStream(response.stream, _answer_max_bytes(), self._on_too_large)
        return response


class _BoundedLines(anyio.abc.ByteReceiveStream):
    """A stdio server's output that fails once a line (one message) has run past `limit`
    bytes, before the rest of it is read."""

    def __init__(
        self, stream: anyio.abc.ByteReceiveStream, limit: int, on_too_large: Callable
    ) -> None:
        self._stream, self._limit, self._on_too_large = stream, limit, on_too_large
        self._line = 0  # bytes of the line not yet ended

    async def receive(self, max_bytes: int = 65536) -> bytes:
        chunk = await self._stream.receive(max_bytes)
        first, *rest = chunk.split(b"\n")
        lengths = [self._line + len(first), *map(len, rest)]
        if max(lengths) > self._limit:
            raise self._on_too_large(f"larger than {self._limit} bytes")
        self._line = lengths[-1]
        return chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class _BoundedProcess(anyio.abc.Process):
    """A stdio server's process, its output read through `_BoundedLines`. The SDK reads the
    output into one string until a newline, however long: it is given this process instead
    of the one it opened (`_create_process`), and the line fails as it arrives."""

    def __init__(self, process: anyio.abc.Process, limit: int, on_too_large: Callable) -> None:
        self._process = process
        self._stdout = process.stdout and _BoundedLines(process.stdout, limit, on_too_large)

    async def aclose(self) -> None:
        await self._process.aclose()

    async def wait(self) -> int:
        return await self._process.wait()

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, signal: int) -> None:
        self._process.send_signal(signal)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    @property
    def stdin(self) -> anyio.abc.ByteSendStream | None:
        return self._process.stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream | None:
        return self._stdout

    @property
    def stderr(self) -> anyio.abc.ByteReceiveStream | None:
        return self._process.stderr


# Set by a stdio connection while the SDK opens its server's process: what to bound the
# output by (its limit, and what fails the connection past it).
_stdout_bound: ContextVar[tuple[int, Callable] | None] = ContextVar("_stdout_bound", default=None)
_sdk_create_process = sdk_stdio._create_platform_compatible_process


async def _create_process(*args: Any, **kwargs: Any) -> anyio.abc.Process:
    """The SDK's process for a stdio server, its output bounded when the connection opening
    it says so (`_stdout_bound`). The SDK opens the process inside `stdio_client` and offers
    no other way in."""
    process = await _sdk_create_process(*args, **kwargs)
    bound = _stdout_bound.get()
    return process if bound is None else _BoundedProcess(process, *bound)


sdk_stdio._create_platform_compatible_process = _create_process


class _AnswerMissing(Exception):
    """An SSE answer to a request ended (or broke, or could not be read) without the request's
    result, and was not resumed: none will come."""


class _AnswerWatch:
    """Where a request's SSE answer is passed on to the session, noting whether the request's
    result (or error) went by."""

    def __init__(self, stream: Any, request_id: Any) -> None:
        self._stream, self._request_id = stream, request_id
        self.answered = False

    async def send(self, item: Any) -> None:
        if (
            isinstance(item, SessionMessage)
            and isinstance(item.message.root, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError)
            and item.message.root.id == self._request_id
        ):
            self.answered = True
        await self._stream.send(item)


_sdk_handle_sse_response = sdk_http.StreamableHTTPTransport._handle_sse_response


async def _handle_sse_response(
    transport: sdk_http.StreamableHTTPTransport,
    response: httpx.Response,
    ctx: sdk_http.RequestContext,
    is_initialization: bool = False,
) -> None:
    """The SDK's reading of a request's SSE answer, which returns quietly when the stream ends,
    breaks or cannot be decoded before the result came (and could not be resumed), leaving
    the request to wait for its timeout: then the session is handed `_AnswerMissing`, which
    closes the connection (`_Connection._on_message`) and fails the request at once."""
    watch = _AnswerWatch(ctx.read_stream_writer, ctx.session_message.message.root.id)
    await _sdk_handle_sse_response(
        transport, response, replace(ctx, read_stream_writer=watch), is_initialization
    )
    if not watch.answered:
        await ctx.read_stream_writer.send(_AnswerMissing("its answer ended without a result"))


sdk_http.StreamableHTTPTransport._handle_sse_response = _handle_sse_response


@dataclass(frozen=True)
class Deadline:
    """When a tool call must have ended, all it waits on included (the server's name looked
    up, its session opened, its tools listed again): `timeout_s` after it began."""

    timeout_s: float
    at: float

    @classmethod
    def after(cls, timeout_s: float) -> "Deadline":
        return cls(timeout_s, time.monotonic() + timeout_s)

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)


@dataclass(frozen=True)
class Endpoint:
    """How to reach one server, secrets resolved. Never logged or stored."""

    key: str
    label: str
    transport: str
    connect_timeout_s: float
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    url: str = ""
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """Values a response must never carry back into a run."""
        return tuple(value for _, value in self.env) + tuple(
            value.removeprefix("Bearer ") for _, value in self.headers
        )

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps(
                [self.transport, self.command, self.args, self.env, self.url, self.headers]
            ).encode()
        ).hexdigest()


def _secret(reference: str, *, server: McpServer, owner: Tenant | None) -> str:
    """The secret `reference` names, for a server whose credentials are `owner`'s (None: the
    platform's)."""
    refusal = credential_refusal(reference, owner=owner)
    if refusal:
        raise McpRefused(f"{server}: {refusal}")
    value = credential_value(reference, owner=owner)
    if not value:
        # Sent empty, the server would take the connection as anonymous, or refuse it after
        # the request went out, as an HTTP tool's or a model's unset credential would.
        raise McpRefused(
            f"{server}: the secret reference {reference} is not set or empty on this host; "
            "an operator must set it. Nothing was sent."
        )
    return value


def endpoint_for(server: McpServer, *, deadline: Deadline | None = None) -> Endpoint:
    """How to reach `server`; the name of an HTTP server is looked up within its timeout, or
    what is left before `deadline` if less."""
    common = {
        "key": str(server.pk),
        "label": str(server),
        "transport": server.transport,
        "connect_timeout_s": float(server.timeout_s),
    }
    if server.transport == McpServer.Transport.STDIO:
        # Only a platform admin registers a stdio server: its environment is the platform's.
        return Endpoint(
            **common,
            command=server.command,
            args=tuple(server.args),
            env=tuple(
                sorted(
                    (name, _secret(reference, server=server, owner=None))
                    for name, reference in server.env.items()
                )
            ),
        )
    lookup_s = float(server.timeout_s)
    if deadline is not None:
        lookup_s = min(lookup_s, deadline.left())
    if refusal := egress_refusal(server.url, timeout=lookup_s):
        raise McpRefused(f"{server}: {refusal}")
    headers = ()
    if server.credential_ref:
        secret = _secret(server.credential_ref, server=server, owner=server.tenant)
        headers = (("Authorization", f"Bearer {secret}"),)
    return Endpoint(**common, url=server.url, headers=headers)


def _stderr_logged(endpoint: Endpoint) -> TextIO:
    """Where a stdio server's stderr goes: a pipe whose lines a thread logs (INFO), with the
    secrets its environment was given redacted. The SDK would hand the process the worker's
    own stderr, where a server printing its environment, or a traceback quoting its token,
    would leave the credential in the worker's log."""
    read_end, write_end = os.pipe()
    threading.Thread(
        target=_log_stderr,
        args=(read_end, endpoint.label, endpoint.secrets),
        name=f"mcp-stderr-{endpoint.key}",
        daemon=True,
    ).start()
    return os.fdopen(write_end, "w")


def _log_stderr(read_end: int, label: str, secrets: tuple[str, ...]) -> None:
    """Log each line until the server's process closes its stderr, without the secrets it
    was given nor any other credential it prints (`secrets_removed`). A line longer than
    STDERR_LINE_MAX_BYTES is dropped whole: read in pieces, a piece could hold part of a
    secret that no redaction would recognise."""
    starts_line = True
    with os.fdopen(read_end, "rb") as stream:
        for line in iter(lambda: stream.readline(STDERR_LINE_MAX_BYTES), b""):
            ends_line = line.endswith(b"\n") or len(line) < STDERR_LINE_MAX_BYTES
            whole, starts_line = starts_line and ends_line, ends_line
            if not whole:
                continue
            text = secrets_removed(
                known_secrets_replaced(line.decode(errors="replace").rstrip(), secrets)
            )
            if text:
                logger.info("%s (stderr): %s", label, text)


class _Connection:
    """A task on the loop that opens the transport and the session, keeps them open until
    asked to close, and closes them in the same task (as anyio requires)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.fingerprint = endpoint.fingerprint
        # The handshake's outcome, for the requests waiting on it (each through a shield). A
        # failure whose waiters all gave up (timed out, cancelled) is read by `_forget`, not
        # reported by the loop as lost: each waiter has told its caller already, and the
        # connection keeps the failure as `error`.
        self.ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(_forget)
        self.closing = asyncio.Event()
        self.broken = False
        self.error: BaseException | None = None
        # Requests waiting on this connection; a retired one closes when the last ends.
        self.in_flight = 0
        self.retired = False
        self.task = asyncio.ensure_future(self._hold())

    async def _open(self, stack: AsyncExitStack) -> ClientSession:
        endpoint = self.endpoint
        if endpoint.transport == McpServer.Transport.STDIO:
            parameters = StdioServerParameters(
                command=endpoint.command,
                args=list(endpoint.args),
                env=dict(endpoint.env),
                cwd=settings.BASE_DIR,
            )
            bound = _stdout_bound.set((_answer_max_bytes(), self._too_large))
            errlog = _stderr_logged(endpoint)
            try:
                read, write = await stack.enter_async_context(
                    stdio_client(parameters, errlog=errlog)
                )
            finally:
                # The process holds its own end: the log ends when the process does.
                errlog.close()
                _stdout_bound.reset(bound)
        else:
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    headers={**dict(endpoint.headers), "Accept-Encoding": "identity"},
                    timeout=httpx.Timeout(endpoint.connect_timeout_s, read=None),
                    transport=_BoundedTransport(self._too_large),
                )
            )
            read, write, _ = await stack.enter_async_context(
                streamable_http_client(endpoint.url, http_client=client)
            )
        session = await stack.enter_async_context(
            ClientSession(read, write, message_handler=self._on_message)
        )
        await session.initialize()
        return session

    async def _on_message(self, message: Any) -> None:
        """Over HTTP the transport hands the session an answer it could not read (not
        JSON-RPC, a body of another content type) as an exception, which the request waiting
        for that answer never sees: the connection is closed, which fails it at once. Over
        stdio such a line is noise between answers (a server's stray print) and is passed,
        unless it is JSON nesting too deep for the SDK to read (an answer, which it drops)."""
        if isinstance(message, pydantic.ValidationError) and (too_deep := _too_deep(message)):
            self.error = too_deep
            self.close()
        elif (
            isinstance(message, Exception) and self.endpoint.transport != McpServer.Transport.STDIO
        ):
            self.error = (
                message
                if isinstance(message, _AnswerMissing)
                else _AnswerUnreadable("its answer could not be read")
            )
            self.close()

    def _too_large(self, reason: str) -> _AnswerTooLarge:
        """An answer was not read to its end: the connection is closed, failing the request
        waiting for it (the SDK drops an SSE answer's error, which would leave it waiting;
        over stdio, the server's process is ended)."""
        self.error = _AnswerTooLarge(reason)
        self.close()
        return self.error

    async def _hold(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                self.ready.set_result(await self._open(stack))
                await self.closing.wait()
        except BaseException as error:
            self.error = self.error or error
            if not self.ready.done():
                refused = _refused(self.error)
                self.ready.set_exception(
                    McpRefused(f"{self.endpoint.label}: {refused}")
                    if refused
                    else McpUnavailable(
                        f"{self.endpoint.label}: could not connect ({_describe(self.error)})."
                    )
                )
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            self.broken = True

    def close(self) -> None:
        """Ask the holding task to close; one still opening (a handshake that hangs) is
        cancelled instead, so no task outlives its connection."""
        self.broken = True
        self.closing.set()
        if not self.ready.done():
            self.task.cancel()


def _too_late(endpoint: Endpoint, deadline: Deadline) -> McpTimeout:
    return McpTimeout(f"{endpoint.label} did not answer in {deadline.timeout_s:g} s.")


def _forget(future: asyncio.Future) -> None:
    """Retrieve what a future nobody may wait for any more ended with (a request abandoned to
    its cancellation, a handshake its callers gave up on), which the loop would otherwise log
    as an error nobody read."""
    if not future.cancelled():
        future.exception()


def _refused(error: BaseException | None) -> EgressRefused | None:
    """The refused connection (`config.egress`) that `error` is or holds, if any."""
    if isinstance(error, EgressRefused):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if refused := _refused(inner):
                return refused
    return None


def _describe(error: BaseException) -> str:
    """A short reason without secrets: the exception types, innermost first, or what the
    platform itself said of an answer it stopped reading."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, _AnswerTooLarge | _AnswerTooDeep | _AnswerMissing | _AnswerUnreadable):
        return str(error)
    if isinstance(error, McpError) and error.error.code == mcp_types.CONNECTION_CLOSED:
        # A stdio server that exited (or never started): its own stderr says why.
        return "it closed the connection"
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    return type(error).__name__


@dataclass(frozen=True)
class ToolListing:
    """The tools a server lists: their definitions by remote name, and the names it lists
    more than once with different definitions (with how many times each), which are not
    among the definitions: which of them the server runs is not known."""

    definitions: dict[str, dict[str, Any]]
    ambiguous: dict[str, int]


async def _every_page(
    endpoint: Endpoint, what: str, list_page: Callable[..., Awaitable[Page]]
) -> list[Page]:
    """Every page of a listing of `what`, following its next page's cursor. A listing of more
    than LIST_PAGES_MAX pages, or whose cursor comes round again (it would never end), is
    refused: the pages read are not all the server lists, and must not be taken for all."""
    pages: list[Page] = []
    cursors: set[str] = set()
    cursor = None
    while True:
        page = await list_page(cursor=cursor)
        pages.append(page)
        cursor = page.nextCursor
        if not cursor:
            return pages
        if len(pages) == LIST_PAGES_MAX:
            problem = f"more than {LIST_PAGES_MAX} pages of {what}"
        elif cursor in cursors:
            problem = f"{what} with a next page's cursor it had given before"
        else:
            cursors.add(cursor)
            continue
        raise McpAnswerInvalid(
            f"{endpoint.label} listed {problem}; the listing was not taken as complete, and "
            "nothing was changed."
        )


class McpConnections:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid: int | None = None
        self._connections: dict[str, _Connection] = {}
        self._retired: set[_Connection] = set()
        self._closing: set[asyncio.Task] = set()
        self._definitions: dict[str, tuple[float, str, ToolListing]] = {}

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="mcp-connections", daemon=True
                ).start()
                self._loop, self._pid = loop, os.getpid()
                self._connections, self._retired = {}, set()
                self._closing, self._definitions = set(), {}
            return self._loop

    def _run(
        self,
        endpoint: Endpoint,
        operation: Callable[[ClientSession], Awaitable[T]],
        *,
        timeout_s: float,
        deadline: Deadline | None = None,
    ) -> T:
        """`operation` on the endpoint's session, answered within `timeout_s` once the session
        is open (within the server's timeout); all of it, opening included, before `deadline`.

        The caller is told the operation's own outcome (its answer, or the error naming the
        server and what ended it), which comes within `_longest_s`, the session opened again
        included. Only an operation the event loop has not ended LOOP_GRACE_S after that (the
        loop stalled) is cancelled, and the caller is told that the platform stopped waiting
        for it (an McpTimeout that says so, not the server's timeout). A call thus takes at
        most SESSION_ATTEMPTS * (connect_timeout_s + timeout_s + ANSWER_GRACE_S) +
        LOOP_GRACE_S seconds, and with a deadline no longer than LOOP_GRACE_S past it."""
        if deadline is not None and not deadline.left():
            raise _too_late(endpoint, deadline)
        wait_s = self._longest_s(endpoint, timeout_s, deadline) + LOOP_GRACE_S
        future = asyncio.run_coroutine_threadsafe(
            self._on_session(endpoint, operation, timeout_s, deadline), self._running_loop()
        )
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError as error:
            future.cancel()
            # The server's timeouts end an operation within `_longest_s`: this wait lapsed on
            # the platform's side, and must not read as the server's timeout.
            request_timeout_s = deadline.timeout_s if deadline is not None else timeout_s
            raise McpTimeout(
                f"{endpoint.label}: the platform stopped waiting for the request after "
                f"{wait_s:.1f} s (its timeout is {request_timeout_s:g} s): its outcome was not "
                "handed back in time, and whether the server ran it is not known."
            ) from error

    @staticmethod
    def _longest_s(endpoint: Endpoint, timeout_s: float, deadline: Deadline | None) -> float:
        """How long `_on_session` may take, every wait it makes included: for each of its
        SESSION_ATTEMPTS, a handshake (within the server's timeout, `_session`) and the
        request (within `timeout_s` and ANSWER_GRACE_S, `_request`); and each of those waits
        ends by `deadline`, if any."""
        longest_s = SESSION_ATTEMPTS * (endpoint.connect_timeout_s + timeout_s + ANSWER_GRACE_S)
        if deadline is not None:
            longest_s = min(longest_s, deadline.left())
        return longest_s

    async def _session(
        self, endpoint: Endpoint, deadline: Deadline | None
    ) -> tuple[ClientSession, _Connection]:
        connection = self._connections.get(endpoint.key)
        if connection is not None and (
            connection.broken or connection.fingerprint != endpoint.fingerprint
        ):
            self._discard(connection)
            connection = None
        if connection is None:
            connection = _Connection(endpoint)
            self._connections[endpoint.key] = connection
        wait_s = endpoint.connect_timeout_s
        if deadline is not None and deadline.left() < wait_s:
            wait_s = deadline.left()
        else:
            deadline = None  # the server's timeout comes first
        try:
            session = await asyncio.wait_for(asyncio.shield(connection.ready), wait_s)
        except TimeoutError as error:
            self._discard(connection)
            if deadline is not None:
                raise _too_late(endpoint, deadline) from error
            raise McpUnavailable(
                f"{endpoint.label} did not complete the handshake in "
                f"{endpoint.connect_timeout_s:g} s."
            ) from error
        except McpUnavailable:
            self._discard(connection)
            raise
        return session, connection

    def _timed_out(self, connection: _Connection, timeout_s: float) -> McpTimeout:
        """Over HTTP the SDK goes on reading the answer of a request nobody waits for any
        more, holding a place in the client's connection pool: the connection is retired,
        and closed (which ends that read) once the requests still waiting on it have ended;
        new requests open another. Over stdio a late answer is only dropped."""
        if connection.endpoint.transport != McpServer.Transport.STDIO:
            connection.retired = True
            self._retired.add(connection)
            if self._connections.get(connection.endpoint.key) is connection:
                del self._connections[connection.endpoint.key]
        return McpTimeout(f"{connection.endpoint.label} did not answer in {timeout_s:g} s.")

    def _discard(self, connection: _Connection) -> None:
        """Close a connection; `close_all` still waits for it to finish closing (its server
        process to exit)."""
        self._retired.discard(connection)
        connection.close()
        if not connection.task.done():
            self._closing.add(connection.task)
            connection.task.add_done_callback(self._closing.discard)
        if self._connections.get(connection.endpoint.key) is connection:
            del self._connections[connection.endpoint.key]

    async def _on_session(
        self,
        endpoint: Endpoint,
        operation: Callable[[ClientSession], Awaitable[T]],
        timeout_s: float,
        deadline: Deadline | None,
    ) -> T:
        """`operation` on the endpoint's session. A session the server no longer knows is
        opened again for the same request (the server did not run it), up to
        SESSION_ATTEMPTS sessions in all."""
        attempt = 1
        while True:
            try:
                return await self._on_one_session(endpoint, operation, timeout_s, deadline)
            except _SessionTerminated as error:
                if attempt >= SESSION_ATTEMPTS:
                    raise McpUnavailable(f"{endpoint.label} ended the session.") from error
                attempt += 1

    async def _on_one_session(
        self,
        endpoint: Endpoint,
        operation: Callable[[ClientSession], Awaitable[T]],
        timeout_s: float,
        deadline: Deadline | None,
    ) -> T:
        """`operation` on the endpoint's session, counted among its connection's requests."""
        session, connection = await self._session(endpoint, deadline)
        connection.in_flight += 1
        try:
            return await self._request(connection, session, operation, timeout_s, deadline)
        finally:
            connection.in_flight -= 1
            if connection.retired and not connection.in_flight:
                self._discard(connection)

    async def _request(
        self,
        connection: _Connection,
        session: ClientSession,
        operation: Callable[[ClientSession], Awaitable[T]],
        timeout_s: float,
        deadline: Deadline | None,
    ) -> T:
        """`operation` raced against the connection: a transport that failed (an HTTP error
        status, an answer that could not be read) fails the request at once instead of
        leaving it waiting for an answer that will not come."""
        endpoint = connection.endpoint
        wait_s = timeout_s + ANSWER_GRACE_S
        if deadline is not None and deadline.left() < wait_s:
            wait_s, timeout_s = deadline.left(), deadline.timeout_s
        request = asyncio.ensure_future(operation(session))
        try:
            done, _ = await asyncio.wait(
                {request, connection.task}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            # Whatever ended the wait (the connection failing, the timeout, or this coroutine
            # cancelled because its caller stopped waiting) ends the request with it.
            if not request.done():
                request.cancel()
                request.add_done_callback(_forget)
        if request not in done:
            if connection.task not in done:
                raise self._timed_out(connection, timeout_s)
            self._discard(connection)
            if refused := _refused(connection.error):
                raise McpRefused(f"{endpoint.label}: {refused}")
            if isinstance(connection.error, _AnswerTooLarge | _AnswerTooDeep):
                raise McpAnswerInvalid(f"{endpoint.label} answered {connection.error}.")
            if isinstance(connection.error, _AnswerMissing | _AnswerUnreadable):
                raise McpUnavailable(f"{endpoint.label}: {connection.error}.")
            reason = _describe(connection.error) if connection.error else "closed"
            raise McpUnavailable(f"{endpoint.label}: the connection broke ({reason}).")
        try:
            return request.result()
        except McpError as error:
            code = error.error.code
            if code == httpx.codes.REQUEST_TIMEOUT:
                raise self._timed_out(connection, timeout_s) from error
            if code in (mcp_types.CONNECTION_CLOSED, SESSION_TERMINATED):
                self._discard(connection)
                if code == SESSION_TERMINATED:
                    raise _SessionTerminated from error
                if isinstance(connection.error, _AnswerTooLarge | _AnswerTooDeep):
                    raise McpAnswerInvalid(
                        f"{endpoint.label} answered {connection.error}."
                    ) from error
                raise McpUnavailable(f"{endpoint.label} closed the connection.") from error
            raise McpRemoteError(f"{endpoint.label}: {error.error.message}") from error
        except pydantic.ValidationError as error:
            # A JSON-RPC answer whose result is not the protocol's for the request: the
            # error's text quotes what the server sent (`from None`: nor is it chained to a
            # traceback).
            raise McpAnswerInvalid(
                f"{endpoint.label} answered with a {error.title} the protocol does not allow."
            ) from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError) as error:
            self._discard(connection)
            raise McpUnavailable(f"{endpoint.label}: the connection broke.") from error

    # --- what callers use -----------------------------------------------------------------

    def tools(self, endpoint: Endpoint, *, deadline: Deadline | None = None) -> ToolListing:
        """Every tool the server lists (all pages), within the server's timeout (and before
        the `deadline` of the call that asks, if any)."""

        async def walk(session: ClientSession) -> ToolListing:
            pages = await _every_page(endpoint, "tools", session.list_tools)
            listed = [(tool.name, definition_of(tool)) for page in pages for tool in page.tools]
            ambiguous = listed_ambiguously(listed)
            return ToolListing(
                {name: definition for name, definition in listed if name not in ambiguous},
                ambiguous,
            )

        listing = self._run(endpoint, walk, timeout_s=endpoint.connect_timeout_s, deadline=deadline)
        with self._lock:
            self._definitions[endpoint.key] = (time.monotonic(), endpoint.fingerprint, listing)
        return listing

    def tools_cached(
        self, endpoint: Endpoint, *, max_age_s: float, deadline: Deadline | None = None
    ) -> ToolListing:
        """The server's tool listing, listed again (before `deadline`) when the copy is
        older than `max_age_s`."""
        with self._lock:
            cached = self._definitions.get(endpoint.key)
        if (
            cached
            and cached[1] == endpoint.fingerprint
            and time.monotonic() - cached[0] < max_age_s
        ):
            return cached[2]
        return self.tools(endpoint, deadline=deadline)

    def _listing(self, endpoint: Endpoint, capability: str, method: str) -> list[Any]:
        async def walk(session: ClientSession) -> list[Any]:
            capabilities = session.get_server_capabilities()
            if capabilities is None or getattr(capabilities, capability) is None:
                return []
            pages = await _every_page(endpoint, capability, getattr(session, method))
            return [item for page in pages for item in getattr(page, capability)]

        return self._run(endpoint, walk, timeout_s=endpoint.connect_timeout_s)

    def prompts(self, endpoint: Endpoint) -> list[mcp_types.Prompt]:
        return self._listing(endpoint, "prompts", "list_prompts")

    def resources(self, endpoint: Endpoint) -> list[mcp_types.Resource]:
        return self._listing(endpoint, "resources", "list_resources")

    def call_tool(
        self,
        endpoint: Endpoint,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, Any],
        deadline: Deadline,
    ) -> mcp_types.CallToolResult:
        """`tools/call`, all of it (the session opened, if it must be) before `deadline`: the
        call's, which also bounded what was done for it before."""

        async def call(session: ClientSession) -> mcp_types.CallToolResult:
            read_timeout = timedelta(seconds=deadline.left())
            try:
                return await session.call_tool(
                    name, arguments, read_timeout_seconds=read_timeout, meta=meta
                )
            except RuntimeError as error:
                # The SDK's check of the answer against the tool's output schema: the
                # server answered what it said it would not.
                raise McpAnswerInvalid(f"{endpoint.label}: {error}") from error

        return self._run(endpoint, call, timeout_s=deadline.timeout_s, deadline=deadline)

    def read_resource(
        self, endpoint: Endpoint, uri: str, *, meta: dict[str, Any], timeout_s: float
    ) -> mcp_types.ReadResourceResult:
        """`resources/read`, with who is asking in `_meta`, as `call_tool` sends it (the SDK's
        own `read_resource` sends none)."""

        async def read(session: ClientSession) -> mcp_types.ReadResourceResult:
            params = mcp_types.ReadResourceRequestParams(
                uri=uri, _meta=mcp_types.RequestParams.Meta(**meta)
            )
            return await session.send_request(
                mcp_types.ClientRequest(mcp_types.ReadResourceRequest(params=params)),
                mcp_types.ReadResourceResult,
            )

        return self._run(endpoint, read, timeout_s=timeout_s)

    def close_all(self) -> None:
        """Close every session of this process (tests, shutdown)."""
        with self._lock:
            loop = self._loop if self._pid == os.getpid() else None
            self._definitions = {}
        if loop is None:
            return

        async def close() -> None:
            for connection in [*self._connections.values(), *self._retired]:
                self._discard(connection)
            if self._closing:
                await asyncio.wait(list(self._closing), timeout=CLOSE_TIMEOUT_S)

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(CLOSE_TIMEOUT_S + 1)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("MCP sessions did not close in %s s.", CLOSE_TIMEOUT_S)


connections = McpConnections()
atexit.register(connections.close_all)
