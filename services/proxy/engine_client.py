"""The proxy's engine transport (``services.proxy.transport.EngineTransport``), and the one
module that uses aiohttp's non-public parts.

Why. ``aiohttp.ClientSession.request`` builds, per request, a ``ClientRequest`` (URL parsing,
header defaults, a payload object), a body-writer task, a ``ClientResponse``, timers and trace
hooks, and goes through the connector's per-host bookkeeping; on the proxy's path that was the
largest single cost after the socket writes: 851k -> 592k instructions per request in the proxy
(callgrind; docs/evidence/code-choices.md). The forwarder needs far
less: one request head it formats itself and one write, and the response's status, headers and
body stream.

What it keeps from aiohttp. The connection protocol (``aiohttp.client_proto.ResponseHandler``:
aiohttp's C response parser, the ``sock_read`` timeout restarted by every byte, flow control,
``TCP_NODELAY``) and the body as aiohttp's ``StreamReader``; parsing errors, a server that
disconnects, a read timeout raise aiohttp's own exceptions (``aiohttp.ClientError`` subclasses,
``asyncio.TimeoutError``), as from a session.

What it does. ``EnginePool.request`` takes an idle keep-alive connection to the engine (newest
first; one idle longer than ``keepalive_s`` or closed by the engine is dropped) or opens one
within ``connect_timeout_s``, writes the head and the body in one write, and returns an
``EngineResponse`` once the status line and headers are in. The request goes as it came minus
what the caller stripped, plus ``Host`` and ``Content-Length`` (no ``User-Agent`` or
``Accept`` of its own). ``EngineResponse.close()`` returns the connection to the pool when the
body was read to its end and neither side asked to close, else closes it, which aborts the
engine's work; the caller always calls it. HTTPS engines get the default TLS context.

aiohttp's private parts, all of them here (and nowhere else: tests/proxy/test_aiohttp_private.py
checks both that they still exist with the signatures and behaviour used, and that no other
module imports them; pyproject pins aiohttp's minor release because of them):

* client: ``aiohttp.client_proto.ResponseHandler`` (subclassed; ``set_response_params``,
  ``start_timeout``, ``read``, ``should_close``, ``is_connected``, ``transport``) and
  ``aiohttp.streams.StreamReader`` (the body: ``read``, ``readany``, ``read_nowait``,
  ``at_eof``, ``is_eof``);
* server (services/proxy/app.py): ``request_factory`` constructs ``web.BaseRequest`` itself, to
  give every request ``client_max_size`` without ``web.Application``, and
  ``aiohttp.http_exceptions.HttpProcessingError`` is what aiohttp's server logs when its parser
  refuses a request (``app.quiet_parser_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from multidict import CIMultiDictProxy

from laswrr.services.proxy.transport import Target, parse_target

__all__ = ["EnginePool", "EngineResponse", "EngineConnection", "HttpProcessingError", "request_factory"]

READ_BUFSIZE = 2**16  # what aiohttp's session reads at a time
MAX_LINE = MAX_FIELD = 8190  # aiohttp's limits on a status line and a header


class EngineConnection(ResponseHandler):
    """aiohttp's protocol, remembering the parser it was given: a keep-alive connection's next
    response is parsed by the same one (llhttp reads message after message), not a new one."""

    skip_payload: bool | None = None  # the parser's setting; None: no parser yet


class EngineResponse:
    """The subset of ``aiohttp.ClientResponse`` the forwarder reads."""

    __slots__ = ("status", "headers", "content", "content_type", "_pool", "_target", "_protocol", "_close")

    def __init__(self, pool: EnginePool, target: Target, protocol: EngineConnection, status: int,
                 headers: CIMultiDictProxy[str], content: StreamReader, close: bool) -> None:
        self.status, self.headers, self.content = status, headers, content
        ctype = headers.get("Content-Type")
        self.content_type = ctype.partition(";")[0].strip().lower() if ctype else "application/octet-stream"
        self._pool, self._target, self._protocol, self._close = pool, target, protocol, close

    async def read(self) -> bytes:
        return await self.content.read()

    def close(self) -> None:
        """Back to the pool after a whole body on a connection both sides keep; else closed."""
        protocol, self._protocol = self._protocol, None
        if protocol is None:
            return
        if not self._close and self.content.is_eof() and protocol.is_connected() and not protocol.should_close:
            self._pool.release(self._target, protocol)
        else:
            protocol.close()


class EnginePool:
    """Keep-alive connections to the engines, per (host, port, tls) (module header)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float | None, keepalive_s: float = 30.0) -> None:
        self.connect_timeout_s, self.read_timeout_s, self.keepalive_s = connect_timeout_s, read_timeout_s, keepalive_s
        self._idle: dict[Target, list[tuple[EngineConnection, float]]] = {}
        self._targets: dict[str, Target] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def target(self, base: str) -> Target:
        target = self._targets.get(base)
        if target is None:
            target = self._targets[base] = parse_target(base)
        return target

    async def request(self, method: str, base: str, path_qs: str, headers: Mapping[str, str],
                      body: bytes) -> EngineResponse:
        """Send one request to the node at ``base``; the response once its head is in."""
        target = self.target(base)
        lines = [f"{method} {target.prefix}{path_qs} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError(f"newline in header {name!r}")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        protocol = self._take(target)
        if protocol is None:  # (never `or`: a ResponseHandler is a queue, false while empty)
            protocol = await self._connect(target)
        try:
            skip = method == "HEAD"
            if protocol.skip_payload is not skip:
                protocol.set_response_params(skip_payload=skip, read_until_eof=True, auto_decompress=False,
                                             read_timeout=self.read_timeout_s, read_bufsize=READ_BUFSIZE,
                                             max_line_size=MAX_LINE, max_field_size=MAX_FIELD)
                protocol.skip_payload = skip
            transport = protocol.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the engine closed the connection")
            transport.write(head + body if len(body) < 16384 else head)
            if len(body) >= 16384:
                transport.write(body)
            protocol.start_timeout()
            while True:
                message, payload = await protocol.read()
                if not 100 <= message.code <= 199 or message.code == 101:
                    break
        except BaseException:
            protocol.close()
            raise
        return EngineResponse(self, target, protocol, message.code, message.headers, payload, message.should_close)

    def _take(self, target: Target) -> EngineConnection | None:
        idle = self._idle.get(target)
        if not idle:
            return None
        oldest = time.monotonic() - self.keepalive_s
        while idle:
            protocol, since = idle.pop()
            if since >= oldest and protocol.is_connected() and not protocol.should_close:
                return protocol
            protocol.close()
        return None

    async def _connect(self, target: Target) -> EngineConnection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        async with asyncio.timeout(self.connect_timeout_s):
            _, protocol = await loop.create_connection(lambda: EngineConnection(loop), target.host, target.port,
                                                       ssl=tls, server_hostname=target.host if tls else None)
        return protocol

    def release(self, target: Target, protocol: EngineConnection) -> None:
        if self._closed:
            protocol.close()
            return
        self._idle.setdefault(target, []).append((protocol, time.monotonic()))
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close connections idle longer than ``keepalive_s`` (or closed by the engine)."""
        self._sweep = None
        oldest = time.monotonic() - self.keepalive_s
        for target, idle in list(self._idle.items()):
            keep = []
            for protocol, since in idle:
                if since >= oldest and protocol.is_connected():
                    keep.append((protocol, since))
                else:
                    protocol.close()
            if keep:
                self._idle[target] = keep
            else:
                del self._idle[target]
        if self._idle:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep_idle)

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for protocol, _ in idle:
                with contextlib.suppress(Exception):
                    protocol.close()
        self._idle.clear()


# -- the server side's private part (services/proxy/app.py) -------------------------------------


def request_factory(max_body_bytes: int, closing: Callable[[], bool] | None = None) -> Any:
    """``web.Server``'s ``request_factory``: aiohttp's ``BaseRequest`` with ``client_max_size``
    = ``max_body_bytes`` (the default factory allows 1 MiB and has no setting for it); with
    ``closing``, a response prepared while ``closing()`` is true closes its connection
    (``Connection: close``, from ``_prepare_hook``, aiohttp's hook between making a response's
    head and writing it: the client's next request opens a new connection)."""
    loop = asyncio.get_running_loop()

    class Request(web.BaseRequest):
        async def _prepare_hook(self, response: web.StreamResponse) -> None:
            if closing is not None and closing():
                response.force_close()  # the connection closes after it; the head is made already:
                response.headers["Connection"] = "close"  # say so (aiohttp calls this hook after _prepare_headers)

    def make_request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        return Request(message, payload, protocol, writer, task, loop, client_max_size=max_body_bytes)

    return make_request
