"""How the model SDKs reach a provider: an HTTP client of our own under each SDK (both build
on `httpx2`).

A model config's base URL may be a tenant's own server, so what goes there and what comes
back is held to what the HTTP tool adapter holds a service to:
- only the headers a provider call needs leave: the SDKs also add what the process
  environment names (OPENAI_ORG_ID, OPENAI_PROJECT_ID, OPENAI_CUSTOM_HEADERS,
  ANTHROPIC_CUSTOM_HEADERS), which is the platform's, never a tenant server's;
- no redirect is followed (the conversation goes to the configured URL only), and the
  connection is made only where `config.egress` allows (or through the environment's proxy);
- no compressed answer is asked for or taken (it would be inflated before its size is known);
- an answer whose charset names a codec that decodes no text (rot13, base64, zlib: Python
  has them all) is read as UTF-8: the SDKs read an error answer's text, which such a codec
  fails with an exception no error handling expects;
- an answer is read within the call's timeout as a whole (the client times each read, so a
  server that sends a byte now and then would hold the call for ever) and up to
  MODEL_RESPONSE_MAX_BYTES; at the deadline the client is closed under a read of the
  headers, which then fails.
"""

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
from django.conf import settings

from config.egress import (
    EgressRefused,
    HTTPTransport2,
    text_encoding,
    unasked_encoding,
    unasked_encoding_named,
)

# Headers a provider call sends (the SDKs' telemetry headers are x-stainless-*).
_SENT_HEADERS = frozenset(
    {
        "accept",
        "accept-encoding",
        "anthropic-beta",
        "anthropic-version",
        "authorization",
        "connection",
        "content-length",
        "content-type",
        "host",
        "user-agent",
        "x-api-key",
    }
)
_SENT_PREFIX = "x-stainless-"


class AnswerRefused(Exception):
    """An answer the client does not take (too large, or compressed), or a provider it does not
    call (`config.egress`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _BoundedBody(httpx2.SyncByteStream):
    def __init__(
        self,
        stream: httpx2.SyncByteStream,
        *,
        deadline: float,
        max_bytes: int,
        done: Callable[[], None],
    ) -> None:
        self._stream = stream
        self._deadline = deadline
        self._max_bytes = max_bytes
        self._done = done

    def __iter__(self) -> Iterator[bytes]:
        size = 0
        for chunk in self._stream:
            size += len(chunk)
            if size > self._max_bytes:
                raise AnswerRefused(f"answered more than {self._max_bytes} bytes")
            if time.monotonic() > self._deadline:
                raise httpx2.ReadTimeout("The answer did not end within the timeout.")
            yield chunk

    def close(self) -> None:
        self._done()
        self._stream.close()


def _sent(name: str) -> bool:
    name = name.lower()
    return name in _SENT_HEADERS or name.startswith(_SENT_PREFIX)


class _Client(httpx2.Client):
    """Closing the client (at the end of its call, or at the deadline) ends its watchdogs."""

    def __init__(self, *, timeout_s: float) -> None:
        self.watchdogs: list[threading.Timer] = []
        self._timeout_s = timeout_s
        super().__init__(
            timeout=timeout_s,
            follow_redirects=False,
            transport=HTTPTransport2(),
            event_hooks={"request": [self._sending], "response": [self._answered]},
        )

    def send(self, request: httpx2.Request, **kwargs: Any) -> httpx2.Response:
        try:
            return super().send(request, **kwargs)
        except EgressRefused as refused:
            raise AnswerRefused(f"was not called: {refused}") from None

    def _sending(self, request: httpx2.Request) -> None:
        for name in [name for name in request.headers if not _sent(name)]:
            del request.headers[name]
        request.headers["Accept-Encoding"] = "identity"
        request.extensions["deadline"] = time.monotonic() + self._timeout_s
        watchdog = threading.Timer(self._timeout_s, self.close)
        watchdog.daemon = True
        self.watchdogs.append(watchdog)
        watchdog.start()

    def _answered(self, response: httpx2.Response) -> None:
        watchdog = self.watchdogs[-1]
        encoding = unasked_encoding(response.headers)
        if encoding is not None:
            watchdog.cancel()
            response.close()
            raise AnswerRefused(f"answered in {unasked_encoding_named(encoding)}")
        response.encoding = text_encoding(response.encoding)
        response.stream = _BoundedBody(
            response.stream,
            deadline=response.request.extensions["deadline"],
            max_bytes=settings.MODEL_RESPONSE_MAX_BYTES,
            done=watchdog.cancel,
        )

    def close(self) -> None:
        for watchdog in self.watchdogs:
            watchdog.cancel()
            if watchdog is not threading.current_thread():
                watchdog.join()
        super().close()


def http_client(timeout_s: float) -> httpx2.Client:
    """The client of one model call (closed with its SDK client)."""
    return _Client(timeout_s=timeout_s)
