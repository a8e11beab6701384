"""The seam between the proxy and its engines: what an engine transport must do, and the URL rule.

Everything the proxy sends to an engine goes through one ``EngineTransport``: the forwarded
requests and their streams (``services.proxy.upstream``) and the ``/v1/models`` listings
(``services.proxy.models``, through ``list_models`` below). The one implementation is
``services.proxy.engine_client.EnginePool``; ``tests/proxy/test_engine_transport.py`` is the
contract any implementation must pass (a real simulated engine, and real HTTP servers that
answer chunked and length-framed, keep connections alive, hang up mid-body or stall).

The contract.

* ``request(method, base, path_qs, headers, body)`` sends one request to the engine whose node
  URL is ``base`` and returns an ``EngineReply`` once the status line and the headers are in.
  The request target is ``engine_path(base, path_qs)``; the request carries ``headers`` as
  given, plus ``Host`` and ``Content-Length`` (nothing of the transport's own: no
  ``User-Agent``, ``Accept`` or ``Accept-Encoding``, no cookies, no redirects followed), and
  the body is passed byte for byte, as is the answer (no decompression).
* Failures raise one of ``TRANSPORT_ERRORS``: a connection refused or reset, an engine that
  hangs up before or while answering, a malformed answer, or no byte for the transport's read
  timeout (``asyncio.TimeoutError``); a node URL that is not http(s) or a header value with a
  newline raise ``ValueError`` before anything is sent.
* ``EngineReply.close()`` is always called by the caller. A connection whose answer was read to
  its end, and that neither side asked to close, may be kept for the next request to the same
  engine (keep-alive); any other is closed, which aborts the engine's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import aiohttp

# What a transport raises for an engine that fails (module header); the forwarder retries on them.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class Target(NamedTuple):
    """Where a node's base URL points: the connection's key and the request target's prefix."""

    host: str
    port: int
    tls: bool
    host_header: str
    prefix: str  # the base URL's path without a trailing "/" or "/v1"


def parse_target(base: str) -> Target:
    """The one rule for node URLs: a node URL may end in ``/v1`` (the OpenAI base) or not; the
    client's path is taken from the server root either way (``/v1/...`` once, ``/tokenize`` at
    the root), under whatever path the URL has before that (a gateway's ``/engine-a``)."""
    base = base.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    parts = urlsplit(base)
    tls = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {base!r}")
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    default = 443 if tls else 80
    return Target(host, port, tls, shown if port == default else f"{shown}:{port}", parts.path.rstrip("/"))


def engine_path(base: str, path_qs: str) -> str:
    """The request target sent to the node at ``base`` for the client's ``path_qs``."""
    return parse_target(base).prefix + path_qs


def engine_url(base: str, path_qs: str) -> str:
    """The whole URL of that request (for people: logs, messages, tests)."""
    target = parse_target(base)
    return f"{'https' if target.tls else 'http'}://{target.host_header}{target.prefix}{path_qs}"


class BodyStream(Protocol):
    """An answer's body as it arrives."""

    async def read(self) -> bytes: ...  # the rest, to its end

    async def readany(self) -> bytes: ...  # what has come, waiting for some; b"" at the end

    def read_nowait(self) -> bytes: ...  # what has come, without waiting (b"" when nothing has)

    def at_eof(self) -> bool: ...


class EngineReply(Protocol):
    """An engine's answer, once its head is in."""

    status: int
    headers: Mapping[str, str]  # as the engine sent them (a multi-dict: repeated names kept)
    content_type: str  # lower case, without parameters; "application/octet-stream" when absent
    content: BodyStream

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class EngineTransport(Protocol):
    """Talking to engines (module header)."""

    async def request(self, method: str, base: str, path_qs: str, headers: Mapping[str, str],
                      body: bytes) -> EngineReply: ...

    async def close(self) -> None: ...


async def list_models(transport: EngineTransport, base: str, timeout_s: float,
                      headers: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The model entries the node at ``base`` lists on its ``GET /v1/models`` (each a dict with a
    string ``id``), within ``timeout_s`` in all; ``[]`` when it fails, answers anything but 200,
    or answers something that is not an OpenAI model list."""
    with contextlib.suppress(*TRANSPORT_ERRORS, ValueError):
        async with asyncio.timeout(timeout_s):
            reply = await transport.request("GET", base, "/v1/models", headers or {}, b"")
            try:
                body = await reply.read()
            finally:
                reply.close()
        if reply.status != 200:
            return []
        document = json.loads(body)
        data = document.get("data") if isinstance(document, dict) else None
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []
    return []
