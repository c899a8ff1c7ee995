"""Where the platform's outbound calls may not go. An HTTP tool's URL, a model config's base URL
and an MCP server's URL may be set by a tenant's publisher; none of them may reach the
addresses of EGRESS_DENIED_NETWORKS (by default the link-local networks, where a cloud serves
a machine's instance metadata and credentials), whatever name points there. The name is
resolved just before the call, and every address it resolves to is checked; a name that does
not resolve is left to the call, which then fails as unreachable."""

import ipaddress
import socket
from functools import cache
from urllib.parse import urlsplit

from django.conf import settings


@cache
def _denied(networks: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(network) for network in networks)


def egress_refusal(url: str) -> str | None:
    """Why a call to `url` may not be made, or None."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    if not host:
        return None
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    denied = _denied(tuple(settings.EGRESS_DENIED_NETWORKS))
    for *_, address in found:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in network for network in denied):
            return f"{host} is at {ip}, an address the platform does not call."
    return None
