"""Which Host headers a local server answers (the playground and the OpenAI-compatible API share the rule).

Both servers listen on loopback by default and have no login, so a page on another site must not reach them
through a DNS name it re-points at 127.0.0.1 (DNS rebinding): a request whose Host header is not a loopback
name, the bound address or an --allow-host name gets 400.
"""

from __future__ import annotations

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
