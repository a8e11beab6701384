"""Which upstream URLs a node may be registered with (pure: no name is resolved, nothing is opened).

A registered URL is where every proxy sends clients' prompts and headers, so the scheduler
checks each ``lb.admin.node`` against the allow-list in force (``SchedulerConfig.allow_upstream``)
before it applies it; a refused one is a recorded rejection with the reason, like any bad input.

Rules, in order:

1. The URL must parse as ``http://`` or ``https://`` with a host; user info
   (``http://user:pw@host``), a query (``?``) or a fragment (``#``) is always refused: the proxy
   appends the client's path, so none of them can mean anything but a trick.
2. An empty allow-list allows every host (the standalone scheduler warns once at start-up).
3. Otherwise the host must match one pattern: ``host`` (any port; names compare
   case-insensitively and literally, ``10.0.0.5`` or ``engine-1.lan``), ``host:port`` (that port
   only; a URL without one means 80 or 443), ``[v6]:port``, or a CIDR block (``10.0.0.0/8``,
   ``fd00::/8``) that an IP-literal host must fall in. A name is never resolved to check it
   against a CIDR block: a pure core does not look up names, and a name's address can change.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


class PatternError(ValueError):
    """An allow-list entry that is neither a host, a host:port nor a CIDR block."""


def upstream_patterns(text: str) -> tuple[str, ...]:
    """``"10.0.0.0/8, engine-1"`` -> ``("10.0.0.0/8", "engine-1")`` (the config value's form)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def check_pattern(pattern: str) -> None:
    _parse_pattern(pattern)


def _parse_pattern(pattern: str) -> tuple[str, object, int | None]:
    """("cidr", network, None) or ("host", lowercase host, port or None)."""
    text = pattern.strip()
    if not text or any(c.isspace() for c in text) or "@" in text:
        raise PatternError(f"bad upstream pattern {pattern!r}: use a host, host:port or a CIDR block")
    if "/" in text:
        try:
            return "cidr", ipaddress.ip_network(text, strict=False), None
        except ValueError:
            raise PatternError(f"bad upstream CIDR block {pattern!r}") from None
    host, port = _split_host_port(text)
    if not host:
        raise PatternError(f"bad upstream pattern {pattern!r}: no host")
    return "host", host, port


def _split_host_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise PatternError(f"bad upstream pattern {text!r}")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""  # a bare IPv6 address has several colons and no port
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise PatternError(f"bad port in upstream pattern {text!r}")
        return host.lower(), int(port_text)
    return host.lower(), None


def upstream_rejection(url: str, allowed: Sequence[str], strict: bool = True) -> str | None:
    """None when ``url`` may be registered under ``allowed``; else the reason it may not.
    ``strict=False`` (a node's ``metrics_url`` and ``health_url``, which only the collector
    polls) checks the scheme and the host but allows user info and a query."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        return f"upstream URL {url!r} does not parse: {exc}"
    if parts.scheme not in DEFAULT_PORTS or not host:
        return f"upstream URL {url!r} must be http:// or https:// with a host"
    if strict and "@" in parts.netloc:
        return f"upstream URL {url!r} carries user info: put engine credentials in the proxy's --upstream-api-key"
    if strict and ("?" in url or "#" in url):
        return f"upstream URL {url!r} has a query or a fragment"
    if not allowed:
        return None
    port = port or DEFAULT_PORTS[parts.scheme]
    if any(_matches(pattern, host.lower(), port) for pattern in allowed):
        return None
    return f"upstream host {host}:{port} is not in the allow-list ({', '.join(allowed)})"


def _matches(pattern: str, host: str, port: int) -> bool:
    kind, value, want_port = _parse_pattern(pattern)
    if kind == "cidr":
        try:
            return ipaddress.ip_address(host) in value  # type: ignore[operator]
        except ValueError:
            return False  # a name: never resolved (module header)
    return value == host and (want_port is None or want_port == port)
