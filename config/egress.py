"""Where the platform's outbound calls may not go. An HTTP tool's URL, a model config's base URL
and an MCP server's URL may be set by a tenant's publisher; none of them may reach the
addresses of EGRESS_DENIED_NETWORKS (by default the link-local networks, where a cloud serves
a machine's instance metadata and credentials), whatever name points there.

The check is made where the connection is made: the clients of those calls connect through
the transports of this module, whose network backend resolves the host name itself, refuses
(`EgressRefused`, before anything is sent) if any address it resolves to is denied, and
connects to the addresses it checked. Resolving the name once to check it and letting the
client resolve it again to connect would let a name that answers differently the second time
(DNS rebinding) through. TLS still checks the certificate against the URL's host name, which
the HTTP client hands to the TLS handshake apart from the address. A name that does not
resolve fails the call as unreachable, and one not resolved within the connection's timeout
(a name server that does not answer) as unreachable in time. An MCP call may go over a
session whose connections were checked when they were opened: `egress_refusal` checks its
server's URL again before each call.

A call the environment sends through a proxy (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, unless
NO_PROXY names its host), as httpx would, goes through it once its host's name is checked
(`egress_refusal`): the proxy resolves the name again and connects, so what it may reach is
the proxy's to limit too.
"""

import ipaddress
import os
import socket
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpcore2
import httpx
import httpx2
from anyio import to_thread
from django.conf import settings

# Threads that resolve names for calls that wait at most their connection's timeout.
RESOLVER_THREADS = 8


def _resolvers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="resolver")


_RESOLVERS = _resolvers()


def _resolvers_anew() -> None:
    """A forked process (a Celery worker child) has none of its parent's threads: it starts
    a pool of its own."""
    global _RESOLVERS
    _RESOLVERS = _resolvers()


os.register_at_fork(after_in_child=_resolvers_anew)

# The connection pool's limits: httpx's own defaults.
POOL_LIMITS = {"max_connections": 100, "max_keepalive_connections": 20, "keepalive_expiry": 5.0}


class EgressRefused(Exception):
    """A connection the platform does not make: nothing was sent."""


@cache
def _denied(networks: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(network) for network in networks)


def _resolved(host: str, port: int | None, timeout: float | None) -> list[tuple]:
    """`socket.getaddrinfo`, waited for at most `timeout` seconds (TimeoutError): the system's
    resolver may take many times a call's timeout to give up on a name server that does not
    answer, and cannot be interrupted, so it runs on a resolver thread, which it keeps until
    then."""
    if timeout is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    lookup = _RESOLVERS.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        return lookup.result(timeout)
    except TimeoutError:
        raise TimeoutError(f"{host} was not resolved within {timeout:g} s.") from None


def allowed_addresses(host: str, port: int | None, *, timeout: float | None = None) -> list[str]:
    """The addresses `host` resolves to, in the resolver's order, to connect to: none if any of
    them is denied (`EgressRefused`). A name that does not resolve raises `OSError`; one not
    resolved within `timeout` seconds, `TimeoutError`."""
    denied = _denied(tuple(settings.EGRESS_DENIED_NETWORKS))
    addresses: list[str] = []
    for *_, address in _resolved(host, port, timeout):
        literal = str(address[0])
        ip = ipaddress.ip_address(literal.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in network for network in denied):
            raise EgressRefused(f"{host} is at {ip}, an address the platform does not call.")
        if literal not in addresses:
            addresses.append(literal)
    return addresses


def egress_refusal(url: str, *, timeout: float | None = None) -> str | None:
    """Why a call to `url` may not be made, or None, before any connection: for a call that
    may go over a connection opened earlier (an MCP session), and so without a new check. A
    name not resolved (within `timeout` seconds) is left to the connection to fail."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    if not host:
        return None
    try:
        allowed_addresses(host, None, timeout=timeout)
    except EgressRefused as refused:
        return str(refused)
    except (OSError, UnicodeError):
        return None
    return None


def _checked(core: ModuleType, host: str, port: int, timeout: float | None) -> list[str]:
    """`allowed_addresses` within the connection's timeout, a name that does not resolve, or
    not in time, failing as `core` fails a connection."""
    try:
        return allowed_addresses(host, port, timeout=timeout)
    except TimeoutError as error:
        raise core.ConnectTimeout(str(error)) from error
    except OSError as error:
        raise core.ConnectError(str(error)) from error


class _Backend:
    """An httpcore network backend (of `core`: httpcore, or httpcore2 under httpx2) that
    connects only to the checked addresses of a host, trying each in turn as
    `socket.create_connection` does."""

    def __init__(self, core: ModuleType) -> None:
        self._core = core
        self._backend = core.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ):
        addresses = _checked(self._core, host, port, timeout)
        failure: Exception = self._core.ConnectError(f"{host} has no address.")
        for address in addresses:
            try:
                return self._backend.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (self._core.ConnectError, self._core.ConnectTimeout) as error:
                failure = error
        raise failure

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        return self._backend.connect_unix_socket(path, timeout, socket_options)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _AsyncBackend:
    """`_Backend` for httpcore's asynchronous connections (on asyncio or trio, through anyio);
    the name is resolved on a worker thread."""

    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ):
        addresses = await to_thread.run_sync(_checked, httpcore, host, port, timeout)
        failure: Exception = httpcore.ConnectError(f"{host} has no address.")
        for address in addresses:
            try:
                return await self._backend.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                failure = error
        raise failure

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options=None
    ):
        return await self._backend.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def environment_proxy(url: str) -> str | None:
    """The proxy the environment names for a call to `url`, if any."""
    proxies = urllib.request.getproxies_environment()
    if not proxies:
        return None
    parts = urlsplit(url)
    if urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    return proxies.get(parts.scheme) or proxies.get("all")


def _name_checked(request: Any) -> None:
    """For a call through a proxy, which resolves the name itself: refuse it now if its name
    is at a denied address."""
    timeout = request.extensions.get("timeout", {}).get("connect")
    if refusal := egress_refusal(str(request.url), timeout=timeout):
        raise EgressRefused(refusal)


# httpx builds its connection pool without a way to name a network backend: each transport
# below builds its own, with the SSL context httpx would have used, and keeps a transport of
# httpx's own per proxy the environment names.


def _transport(http: ModuleType, core: ModuleType) -> type:
    """`http`'s transport (httpx, or httpx2 under the model SDKs), connecting through the
    check or through the environment's proxy."""

    class Transport(http.HTTPTransport):
        def __init__(self) -> None:
            self._ssl_context = http.create_ssl_context()
            super().__init__(verify=self._ssl_context)
            self._pool = core.ConnectionPool(
                ssl_context=self._ssl_context, **POOL_LIMITS, network_backend=_Backend(core)
            )
            self._proxied: dict[str, http.HTTPTransport] = {}

        def handle_request(self, request: Any) -> Any:
            proxy = environment_proxy(str(request.url))
            if proxy is None:
                return super().handle_request(request)
            _name_checked(request)
            if proxy not in self._proxied:
                self._proxied[proxy] = http.HTTPTransport(verify=self._ssl_context, proxy=proxy)
            return self._proxied[proxy].handle_request(request)

        def close(self) -> None:
            for proxied in self._proxied.values():
                proxied.close()
            super().close()

    return Transport


HTTPTransport = _transport(httpx, httpcore)
HTTPTransport2 = _transport(httpx2, httpcore2)


class AsyncHTTPTransport(httpx.AsyncHTTPTransport):
    """httpx's asynchronous transport, connecting through the check or through the
    environment's proxy."""

    def __init__(self) -> None:
        self._ssl_context = httpx.create_ssl_context()
        super().__init__(verify=self._ssl_context)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=self._ssl_context, **POOL_LIMITS, network_backend=_AsyncBackend()
        )
        self._proxied: dict[str, httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        proxy = environment_proxy(str(request.url))
        if proxy is None:
            return await super().handle_async_request(request)
        await to_thread.run_sync(_name_checked, request)
        if proxy not in self._proxied:
            self._proxied[proxy] = httpx.AsyncHTTPTransport(verify=self._ssl_context, proxy=proxy)
        return await self._proxied[proxy].handle_async_request(request)

    async def aclose(self) -> None:
        for proxied in self._proxied.values():
            await proxied.aclose()
        await super().aclose()


def text_encoding(charset: str | None) -> str:
    """The encoding to read an outbound answer's text in: its `charset`, unless that names a
    codec that decodes no text (rot13, base64, zlib: Python has them all, and a server may
    name any), then UTF-8, undecodable bytes replaced as httpx reads them."""
    if charset:
        try:
            b"x".decode(charset, "replace")
        except (LookupError, UnicodeError):
            return "utf-8"
        return charset
    return "utf-8"


# The content codings of HTTP's registry, which an error message may name: any other text of
# a Content-Encoding header is the server's own, and may quote what it was sent (a key).
CONTENT_CODINGS = frozenset(
    {"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress", "aes128gcm", "exi"}
)


def unasked_encoding(headers: Mapping[str, str]) -> str | None:
    """The Content-Encoding of an answer to a request that asked for identity only, as the
    server wrote it; None for an answer in identity."""
    sent = headers.get("content-encoding", "identity").strip()
    return None if sent.lower() in ("", "identity") else sent


def unasked_encoding_named(encoding: str) -> str:
    """An answer's `encoding` that was not asked for, as a message says it: named only when
    it is a coding HTTP defines (`CONTENT_CODINGS`), for a server or gateway may echo there
    what it was sent, a credential or its own key, which stripping a known one would not find."""
    coding = encoding.lower()
    if coding in CONTENT_CODINGS:
        return f"{coding} encoding, which was not asked for"
    return "an encoding that was not asked for"
