"""The proxy's HTTP/1.1 server: an asyncio protocol that reads whole requests and runs one handler each.

Why not aiohttp.web: its request/response machinery costs ~50 us of CPU per request on this
machine, about a third of everything the proxy does; this server does the same job for the
proxy's few routes in a fraction of that.

Theory of operation.

* **Requests.** A connection parses one request at a time: the head (request line and headers,
  at most ``MAX_HEAD_BYTES``), then the body by ``Content-Length`` or chunked transfer coding (at
  most ``max_body`` bytes; a larger ``Content-Length`` is refused before any body byte is read).
  Only when the whole request is in hand does the handler run, in its own task, with an
  ``HttpRequest`` and a ``Responder``. Bytes of a following (pipelined) request wait in the
  buffer; reading pauses while they pile up.
* **Refusals.** A malformed head or body is answered 400 (431 for a head too large, 501 for a
  transfer coding other than chunked, 413 for a body over the limit) and the connection is
  closed. ``Expect: 100-continue`` is answered ``100 Continue`` before the body is read.
* **Responses.** ``Responder.send`` writes a whole answer in one write (``Content-Length``; the
  head alone for ``HEAD``);
  ``start``/``write``/``end`` stream one with chunked coding (close-delimited for an HTTP/1.0
  client), each ``write`` waiting while the client's socket buffer is full (backpressure).
  A handler that returns without answering gets a 500.
* **Connections.** HTTP/1.1 is kept alive unless either side says ``Connection: close``;
  HTTP/1.0 only with ``Connection: keep-alive``. A client that goes away while its handler runs
  gets that handler cancelled (the forwarder then aborts the engine's work). ``shutdown`` stops
  accepting, closes idle connections and marks busy ones to close after their answer
  (``Connection: close``); ``abort`` drops whatever is left. A connection with no request
  running for ``keepalive_s`` (75 s, as aiohttp; idle, or stuck in a head that never ends) is
  closed. A client that half-closes (EOF) is
  treated as gone, as aiohttp does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import msgspec

log = logging.getLogger("laswrr.proxy.server")

MAX_HEAD_BYTES = 64 * 1024
MAX_PIPELINED_BYTES = 256 * 1024
KEEPALIVE_S = 75.0  # as aiohttp: a connection without a running request is closed after this long
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"expect"})
_CRLF2 = b"\r\n\r\n"
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_JSON = msgspec.json.Encoder()


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpRequest:
    """One whole request: method, target, headers as sent (bytes), body."""

    __slots__ = ("_lower", "arrived", "body", "keep_alive", "method", "raw_headers", "target", "version")

    def __init__(self, method: str, target: str, version: str, raw_headers: list[tuple[bytes, bytes]],
                 keep_alive: bool, arrived: float) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.raw_headers = raw_headers
        self.body = b""
        self.keep_alive = keep_alive
        self.arrived = arrived
        self._lower: dict[bytes, bytes] | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def path_qs(self) -> str:
        return self.target

    def header(self, name: str) -> str | None:
        """The (last) value of header ``name`` (case-insensitive), or None."""
        lower = self._lower
        if lower is None:
            lower = self._lower = {k.lower(): v for k, v in self.raw_headers}
        value = lower.get(name.lower().encode("latin-1"))
        return None if value is None else value.decode("latin-1")


Headers = Iterable[tuple[str | bytes, str | bytes]]


def _date() -> str:
    now = int(time.time())
    if _date.cache[0] != now:  # type: ignore[attr-defined]
        _date.cache = (now, formatdate(now, usegmt=True))  # type: ignore[attr-defined]
    return _date.cache[1]  # type: ignore[attr-defined,no-any-return]


_date.cache = (0, "")  # type: ignore[attr-defined]


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("latin-1")
    return line


def _head(status: int, headers: Headers, framing: bytes, close: bool) -> bytes:
    """Status line, ``headers`` (str or bytes pairs, passed through as they are), framing, end of head."""
    parts = [_status_line(status)]
    for name, value in headers:
        parts.append(name if type(name) is bytes else name.encode("latin-1"))  # type: ignore[union-attr]
        parts.append(b": ")
        parts.append(value if type(value) is bytes else value.encode("latin-1"))  # type: ignore[union-attr]
        parts.append(b"\r\n")
    parts.append(framing)
    parts.append(b"Connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(parts)


class Responder:
    """Writes the answer to one request, whole (``send``) or streamed (``start``/``write``/``end``)."""

    __slots__ = ("_head", "chunked", "conn", "finished", "request", "started", "status")

    def __init__(self, conn: HttpConnection, request: HttpRequest) -> None:
        self.conn = conn
        self.request = request
        self.started = False
        self.finished = False
        self.chunked = False
        self.status = 0
        self._head = b""  # a streamed answer's head, held back to go out with the first piece

    @property
    def closing(self) -> bool:
        return not self.request.keep_alive or self.conn.server.closing

    def send(self, status: int, body: bytes, headers: Headers = ()) -> None:
        """The whole answer in one write; ConnectionResetError if the client is gone."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        close = self.closing
        head = _head(status, headers, b"Content-Length: %d\r\n" % len(body), close)
        self.conn.write(head if self.request.method == "HEAD" else head + body)
        if close:
            self.conn.close_after_response = True

    def json(self, status: int, obj: Any, headers: Headers = ()) -> None:
        self.send(status, _JSON.encode(obj),
                  [("Content-Type", "application/json; charset=utf-8"), ("Date", _date()), *headers])

    async def start(self, status: int, headers: Headers = ()) -> None:
        """Begin a streamed answer (chunked for HTTP/1.1, close-delimited for 1.0).

        The head goes out with the first ``write`` (or ``end``): one write instead of two."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        self.chunked = self.request.version == "HTTP/1.1"
        close = self.closing or not self.chunked
        self._head = _head(status, headers, b"Transfer-Encoding: chunked\r\n" if self.chunked else b"", close)
        if close:
            self.conn.close_after_response = True

    async def write(self, data: bytes, last: bool = False) -> None:
        """One piece of a streamed answer; ``last`` ends the answer in the same write."""
        if self.finished:
            raise RuntimeError("response already finished")
        self._write(data, last)
        conn = self.conn
        if conn.paused and not last:
            await conn.drain()

    async def end(self) -> None:
        if not self.finished:
            self._write(b"", True)

    def cut(self, data: bytes) -> None:
        """Best effort, never waits: ``data`` as the last piece (a stream ended by the proxy)."""
        if self.started and not self.finished:
            try:
                self._write(data, True)
            except ConnectionResetError:
                pass

    def _write(self, data: bytes, last: bool) -> None:
        frame = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") if self.chunked else data
        if last:
            self.finished = True
            if self.chunked:
                frame += b"0\r\n\r\n"
        if self._head:
            frame, self._head = self._head + frame, b""
        if frame:
            self.conn.write(frame)


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.close_after_response = False
        self.task: asyncio.Task[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._req: HttpRequest | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._remaining = 0
        self._chunked = False
        self._chunk_state = 0  # 0 size line, 1 data, 2 CRLF after data, 3 trailer
        self._reading_paused = False
        self.last_active = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        self.server.connections.add(self)
        self.last_active = self.loop.time()
        if self.server.closing:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: stop its request
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("client disconnected"))

    def eof_received(self) -> bool:
        return False  # as aiohttp: a client that stops sending is gone (its running request is cancelled)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self.task is not None:  # a pipelined request waits for the current one
            if len(self._buf) > MAX_PIPELINED_BYTES and not self._reading_paused and self.transport is not None:
                self._reading_paused = True
                self.transport.pause_reading()
            return
        self._parse()

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)

    async def drain(self) -> None:
        if not self.paused:
            return
        if self.transport is None:
            raise ConnectionResetError("client disconnected")
        self._drain = self.loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- parsing ------------------------------------------------------------------------------

    def _parse(self) -> None:
        try:
            while self.task is None and not self.closed and self._buf:
                if self._req is None:
                    end = self._buf.find(_CRLF2)
                    if end < 0 or end > MAX_HEAD_BYTES:
                        if len(self._buf) > MAX_HEAD_BYTES:
                            raise BadRequest(431, "request head too large")
                        return
                    head = bytes(self._buf[:end])
                    del self._buf[:end + 4]
                    self._start_request(head)
                    if self._req is None:
                        continue
                if not self._read_body():
                    return
                request, self._req = self._req, None
                assert request is not None
                request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body = []
                self._dispatch(request)
        except BadRequest as exc:
            self._refuse(exc.status, str(exc))

    def _start_request(self, head: bytes) -> None:
        arrived = time.perf_counter()
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[0].isalpha() or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1]:
            raise BadRequest(400, f"bad request line {lines[0][:100]!r}")
        method, target, version = (part.decode("latin-1") for part in parts)
        raw: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        keep_alive = version == "HTTP/1.1"
        expect_continue = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name:
                raise BadRequest(400, f"bad header line {line[:100]!r}")
            value = value.strip()
            raw.append((name, value))
            lower = name.lower()
            if lower in _FRAMING:
                if lower == b"content-length":
                    if not value.isdigit() or (length is not None and length != int(value)):
                        raise BadRequest(400, f"bad Content-Length {value[:40]!r}")
                    length = int(value)
                elif lower == b"transfer-encoding":
                    if value.lower() != b"chunked":
                        raise BadRequest(501, f"transfer coding {value[:40]!r} not supported (only chunked)")
                    chunked = True
                elif lower == b"connection":
                    tokens = value.lower()
                    if b"close" in tokens:
                        keep_alive = False
                    elif b"keep-alive" in tokens:
                        keep_alive = True
                elif value.lower() == b"100-continue":  # expect
                    expect_continue = True
        if chunked and length is not None:
            raise BadRequest(400, "both Content-Length and Transfer-Encoding")
        if length is not None and length > self.server.max_body:
            self._too_large(HttpRequest(method, target, version, raw, False, arrived))
            return
        self._req = HttpRequest(method, target, version, raw, keep_alive, arrived)
        self._body, self._body_size, self._chunked, self._chunk_state = [], 0, chunked, 0
        self._remaining = 0 if chunked else (length or 0)
        if expect_continue and (chunked or len(self._buf) < self._remaining):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _read_body(self) -> bool:
        """Move body bytes out of the buffer; True once the body is complete."""
        buf = self._buf
        if not self._chunked:
            take = min(self._remaining, len(buf))
            if take:
                self._body.append(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
            return self._remaining == 0
        while True:
            state = self._chunk_state
            if state == 0:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096:
                        raise BadRequest(400, "chunk size line too long")
                    return False
                size_text = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[:end + 2]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise BadRequest(400, f"bad chunk size {size_text[:40]!r}") from None
                if size < 0:
                    raise BadRequest(400, "negative chunk size")
                self._body_size += size
                if self._body_size > self.server.max_body:
                    assert self._req is not None
                    req, self._req = self._req, None
                    self._too_large(req)
                    return False
                self._remaining = size
                self._chunk_state = 1 if size else 3
            elif state == 1:
                take = min(self._remaining, len(buf))
                if take:
                    self._body.append(bytes(buf[:take]))
                    del buf[:take]
                    self._remaining -= take
                if self._remaining:
                    return False
                self._chunk_state = 2
            elif state == 2:
                if len(buf) < 2:
                    return False
                if buf[:2] != b"\r\n":
                    raise BadRequest(400, "chunk not followed by CRLF")
                del buf[:2]
                self._chunk_state = 0
            else:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise BadRequest(400, "trailer too large")
                    return False
                del buf[:end + 2]
                if end == 0:
                    return True

    # -- running a request --------------------------------------------------------------------

    def _dispatch(self, request: HttpRequest) -> None:
        responder = Responder(self, request)
        self.task = self.loop.create_task(self._run(request, responder))

    async def _run(self, request: HttpRequest, responder: Responder) -> None:
        server = self.server
        server.active += 1
        server.idle.clear()
        try:
            await server.handler(request, responder)
            if not responder.started:
                responder.json(500, _error("the handler gave no answer", "server_error", "internal_error"))
            elif not responder.finished:
                await responder.end()
        except asyncio.CancelledError:
            self.close_after_response = True
            raise
        except ConnectionResetError:
            self.close_after_response = True
        except Exception:
            log.exception("error handling %s %s", request.method, request.target)
            self.close_after_response = True
            if not responder.started:
                try:
                    responder.json(500, _error("internal error in the proxy", "server_error", "internal_error"))
                except ConnectionResetError:
                    pass
        finally:
            self.task = None
            self.last_active = self.loop.time()
            server.active -= 1
            if server.active == 0:
                server.idle.set()
            self._after_response()

    def _after_response(self) -> None:
        if self.closed:
            return
        if self.close_after_response or self.server.closing:
            self.close()
            return
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._buf:
            self._parse()

    def _too_large(self, request: HttpRequest) -> None:
        self._req = None
        self._buf.clear()
        request.keep_alive = False
        responder = Responder(self, request)
        try:
            self.server.too_large(responder)
        except ConnectionResetError:
            pass
        self.close()
        self.closed = True

    def _refuse(self, status: int, message: str) -> None:
        self._buf.clear()
        self._req = None
        body = _JSON.encode(_error(message, "invalid_request_error", "bad_request"))
        try:
            self.write(_head(status, [("Content-Type", "application/json; charset=utf-8"), ("Date", _date())],
                             b"Content-Length: %d\r\n" % len(body), True) + body)
        except ConnectionResetError:
            pass
        self.close()
        self.closed = True


def _error(message: str, err_type: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": None}}


class HttpServer:
    """Listening socket(s) + the live connections; ``handler`` answers every request."""

    def __init__(self, handler: Handler, too_large: Callable[[Responder], None], max_body: int,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.loop = asyncio.get_running_loop()
        self.keepalive_s = keepalive_s
        self._sweeper: asyncio.TimerHandle | None = None
        self.handler = handler
        self.too_large = too_large
        self.max_body = max_body
        self.connections: set[HttpConnection] = set()
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.listener: asyncio.AbstractServer | None = None

    async def listen(self, host: str, port: int, reuse_port: bool = False) -> int:
        self.listener = await self.loop.create_server(lambda: HttpConnection(self), host or None, port,
                                                      reuse_port=reuse_port or None, backlog=1024)
        self._sweeper = self.loop.call_later(self.keepalive_s / 4, self._sweep)
        sockets = self.listener.sockets or ()
        return int(sockets[0].getsockname()[1]) if sockets else port

    def _sweep(self) -> None:
        """Close connections with no request running for ``keepalive_s`` (idle, or a head that never ended)."""
        deadline = self.loop.time() - self.keepalive_s
        for conn in list(self.connections):
            if conn.task is None and conn.last_active < deadline:
                conn.close()
        if not self.closing:
            self._sweeper = self.loop.call_later(self.keepalive_s / 4, self._sweep)

    def shutdown(self) -> None:
        """Stop accepting; close idle connections now and busy ones after their answer."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.listener is not None:
            self.listener.close()
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()

    def abort(self) -> None:
        for conn in list(self.connections):
            conn.abort()
