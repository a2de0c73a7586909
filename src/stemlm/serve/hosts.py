"""Which Host headers a local server answers (the playground and the OpenAI-compatible API share the rule).

Both servers listen on loopback by default and have no login, so a page on another site must not reach them
through a DNS name it re-points at 127.0.0.1 (DNS rebinding): a request whose Host header is not a loopback
name, the bound address or an --allow-host name gets 400. Names are compared normalised (`normal_host`): case
folded, an IPv6 literal by its address ("[0:0::1]" is "[::1]"), and an IPv4-mapped IPv6 literal as the IPv4
address it maps to, so "[::ffff:127.0.0.1]" is loopback and "[::ffff:203.0.113.9]" is 203.0.113.9.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def trusted_hosts(host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:
    """Host header names the server answers: loopback, the address it is bound to, and `extra` (--allow-host).

    A wildcard bind (0.0.0.0, ::) adds no name: pass --allow-host.
    """
    names = list(LOOPBACK_NAMES)
    if host not in ("0.0.0.0", "::", ""):
        names.append(f"[{host}]" if ":" in host else host)
    return names + [name for name in extra if name not in names]


def host_name(header: str) -> str:
    """The name part of a Host header value, without the port ("[::1]:8000" -> "[::1]", "a:80" -> "a")."""
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def normal_host(name: str) -> str:
    """A host name in the one spelling compared: lower case; IPv6 literals canonical, IPv4-mapped ones as IPv4."""
    name = name.strip().lower().rstrip(".")
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        address = ipaddress.ip_address(bare.split("%", 1)[0])  # a zone (fe80::1%eth0) does not change the host
    except ValueError:
        return name
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return f"[{address.compressed}]"
    return str(address)


def host_allowed(header: str, allowed: Sequence[str]) -> bool:
    """Whether a Host header value (port and all) names one of `allowed` (names as `trusted_hosts` gives)."""
    if not header:
        return False
    return normal_host(host_name(header)) in {normal_host(host_name(name)) for name in allowed}
