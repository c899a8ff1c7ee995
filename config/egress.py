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
resolve fails the call as unreachable. An MCP call may go over a session whose connections
were checked when they were opened: `egress_refusal` checks its server's URL again before
each call.

These clients take no proxy from the environment (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY): a
proxy would resolve and reach the host itself, out of this check's sight.
"""

import ipaddress
import socket
from collections.abc import Iterable
from functools import cache
from types import ModuleType
from urllib.parse import urlsplit

import httpcore
import httpcore2
import httpx
import httpx2
from anyio import to_thread
from django.conf import settings

# The connection pool's limits: httpx's own defaults.
POOL_LIMITS = {"max_connections": 100, "max_keepalive_connections": 20, "keepalive_expiry": 5.0}


class EgressRefused(Exception):
    """A connection the platform does not make: nothing was sent."""


@cache
def _denied(networks: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(network) for network in networks)


def allowed_addresses(host: str, port: int | None) -> list[str]:
    """The addresses `host` resolves to, in the resolver's order, to connect to: none if any of
    them is denied (`EgressRefused`). A name that does not resolve raises `OSError`."""
    denied = _denied(tuple(settings.EGRESS_DENIED_NETWORKS))
    addresses: list[str] = []
    for *_, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        literal = str(address[0])
        ip = ipaddress.ip_address(literal.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in network for network in denied):
            raise EgressRefused(f"{host} is at {ip}, an address the platform does not call.")
        if literal not in addresses:
            addresses.append(literal)
    return addresses


def egress_refusal(url: str) -> str | None:
    """Why a call to `url` may not be made, or None, before any connection: for a call that
    may go over a connection opened earlier (an MCP session), and so without a new check."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    if not host:
        return None
    try:
        allowed_addresses(host, None)
    except EgressRefused as refused:
        return str(refused)
    except (OSError, UnicodeError):
        return None
    return None


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
        try:
            addresses = allowed_addresses(host, port)
        except OSError as error:
            raise self._core.ConnectError(str(error)) from error
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
        try:
            addresses = await to_thread.run_sync(allowed_addresses, host, port)
        except OSError as error:
            raise httpcore.ConnectError(str(error)) from error
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


# httpx builds its connection pool without a way to name a network backend: each transport
# below builds its own, with the SSL context httpx would have used.


class HTTPTransport(httpx.HTTPTransport):
    """httpx's transport, connecting through the check."""

    def __init__(self) -> None:
        ssl_context = httpx.create_ssl_context()
        super().__init__(verify=ssl_context)
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            **POOL_LIMITS,
            network_backend=_Backend(httpcore),
        )


class AsyncHTTPTransport(httpx.AsyncHTTPTransport):
    """httpx's asynchronous transport, connecting through the check."""

    def __init__(self) -> None:
        ssl_context = httpx.create_ssl_context()
        super().__init__(verify=ssl_context)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            **POOL_LIMITS,
            network_backend=_AsyncBackend(),
        )


class HTTPTransport2(httpx2.HTTPTransport):
    """httpx2's transport (under the model SDKs), connecting through the check."""

    def __init__(self) -> None:
        ssl_context = httpx2.create_ssl_context()
        super().__init__(verify=ssl_context)
        self._pool = httpcore2.ConnectionPool(
            ssl_context=ssl_context,
            **POOL_LIMITS,
            network_backend=_Backend(httpcore2),
        )
