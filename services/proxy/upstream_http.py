"""A lean HTTP/1.1 client for the proxy's upstream requests: keep-alive pool, streaming body, silence timeout.

Why not aiohttp's client: per request it costs the proxy about as much CPU as everything else
together (request object, tracing hooks, a writer task, a StreamReader, timers); this client does
one ``transport.write`` per request and parses the answer in ``data_received``.

Theory of operation.

* **Pool.** Idle connections are kept per ``(host, port)`` and reused last-in first-out; one that
  the engine closed (``connection_lost``) or that sat idle longer than ``idle_ttl_s`` (below
  the usual engine keep-alive, e.g. uvicorn's 5 s) is never reused. A connection returns to the
  pool only after its response was received whole and it may be kept (HTTP/1.1 without
  ``Connection: close``). A request is never re-sent by this client: a failure is the caller's
  to handle (the forwarder retries on another node before the first byte).
* **Parsing.** Status line and headers, then the body by ``Content-Length``, by chunked
  transfer coding (de-chunked; extensions and trailers skipped), or until the connection closes.
  1xx answers are skipped; 204/304 have no body. Anything malformed is ``UpstreamProtocolError``.
* **Streaming.** Body pieces queue in the response as they arrive; ``readany`` hands them out
  (b"" at the end), ``read`` the whole rest. Reading from the engine pauses while more than
  ``HIGH_WATER`` bytes wait (a slow client), so memory stays bounded.
* **Timeouts.** Connecting is bounded by ``connect_timeout_s``; every wait for bytes (the head,
  the next body piece) by ``read_timeout_s`` of silence, not the total length.
* **Closing.** ``close()`` releases a finished connection to the pool and aborts an unfinished
  one, which is how an engine learns that the client went away.

Only ``http://`` upstreams are handled here; the forwarder uses aiohttp for anything else.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 4096
_NO_BODY_STATUS = frozenset({204, 304})
_NOTED = frozenset({b"content-length", b"transfer-encoding", b"connection", b"content-type"})


class UpstreamError(Exception):
    """Any failure of an upstream exchange."""


class UpstreamConnectError(UpstreamError):
    """The TCP connection to the engine could not be made."""


class UpstreamDisconnected(UpstreamError):
    """The engine closed the connection before the answer was complete."""


class UpstreamProtocolError(UpstreamError):
    """The engine's answer is not valid HTTP/1.x."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """No byte from the engine for ``read_timeout_s`` (or no connection within ``connect_timeout_s``)."""


# parser states
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class UpstreamResponse:
    """One engine answer: status and headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_closed",
        "_complete",
        "_conn",
        "_error",
        "_greedy",
        "_waiter",
        "content_type",
        "headers",
        "keep_alive",
        "reason",
        "status",
    )

    def __init__(self, conn: _Connection, status: int, reason: str, headers: list[tuple[bytes, bytes]],
                 content_type: str, keep_alive: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_type = content_type
        self.keep_alive = keep_alive
        self._conn: _Connection | None = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._greedy = False

    # -- fed by the connection ----------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._greedy and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._complete and self._error is None:
            self._error = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the forwarder ----------------------------------------------------------------

    async def readany(self) -> bytes:
        """The next piece of the body (everything buffered), b"" once it ended; raises on failure."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._take(len(data))
        return data

    @property
    def at_eof(self) -> bool:
        """The whole body arrived and was read."""
        return self._complete and not self._chunks

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        self._greedy = True  # read() wants it all: no backpressure
        if self._conn is not None:
            self._conn.resume()
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._take(len(data))
        return data

    def _take(self, size: int) -> None:
        self._buffered -= size
        if self._buffered < LOW_WATER and self._conn is not None:
            self._conn.resume()

    async def _wait(self) -> None:
        conn = self._conn
        if conn is None:
            raise UpstreamDisconnected("response already closed")
        loop = conn.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(conn.read_timeout_s, _expire, waiter, conn.read_timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        """Release the connection (answer complete and reusable) or abort it (anything else)."""
        if self._closed:
            return
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response_closed(self._complete and self.keep_alive)


def _expire(waiter: asyncio.Future[None], seconds: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout(f"no data from the engine for {seconds:g} s"))


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine: writes requests, parses their answers."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.read_timeout_s = pool.read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._buf = bytearray()
        self._state = _DONE
        self._remaining = 0
        self._head_only = False
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self.response: UpstreamResponse | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self._state == _UNTIL_CLOSE and self.response is not None:
            self._state = _DONE
            self.response.keep_alive = False
            self.response._finish()
            return
        error = UpstreamDisconnected(f"engine closed the connection{f': {exc}' if exc else ''}")
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(error)
        elif self.response is not None and self._state != _DONE:
            self.response._fail(error)

    def data_received(self, data: bytes) -> None:
        if self._state == _DONE:  # bytes nobody asked for: this connection cannot be trusted
            if self.transport is not None:
                self.transport.abort()
            return
        if self._state == _LENGTH and not self._buf:  # the common case: body bytes, no copy
            take = data if len(data) <= self._remaining else data[:self._remaining]
            self._remaining -= len(take)
            assert self.response is not None
            if take:
                self.response._feed(take)
            if self._remaining == 0:
                self._end_body()
                if len(take) < len(data):
                    self.data_received(data[len(take):])
            return
        self._buf += data
        try:
            self._parse()
        except UpstreamProtocolError as exc:
            self._protocol_error(exc)

    # -- requests -----------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, head_only: bool) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._state, self._head_only, self.response = _HEAD, head_only, None
        self._buf.clear()
        waiter = self._head_waiter = self.loop.create_future()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return waiter

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def response_closed(self, reusable: bool) -> None:
        self.response = None
        if reusable and not self.closed and self._state == _DONE:
            self.resume()
            self.pool.release(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self._state = _DONE
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    # -- parsing ------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        pos = 0
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD_BYTES:
                        raise UpstreamProtocolError("response head too large")
                    break
                head = bytes(buf[pos:end])
                pos = end + 4
                self._on_head(head)
            elif state == _LENGTH:
                take = min(self._remaining, len(buf) - pos)
                if take:
                    self._deliver(bytes(buf[pos:pos + take]))
                    pos += take
                    self._remaining -= take
                if self._remaining == 0:
                    self._end_body()
                    continue
                break
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_CHUNK_LINE:
                        raise UpstreamProtocolError("chunk size line too long")
                    break
                line = bytes(buf[pos:end]).split(b";", 1)[0].strip()
                pos = end + 2
                try:
                    size = int(line, 16)
                except ValueError:
                    raise UpstreamProtocolError(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise UpstreamProtocolError("negative chunk size")
                self._remaining = size
                self._state = _CHUNK_DATA if size else _TRAILER
            elif state == _CHUNK_DATA:
                take = min(self._remaining, len(buf) - pos)
                if take:
                    self._deliver(bytes(buf[pos:pos + take]))
                    pos += take
                    self._remaining -= take
                if self._remaining:
                    break
                self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD_BYTES:
                        raise UpstreamProtocolError("trailer too large")
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    self._end_body()
            elif state == _UNTIL_CLOSE:
                if len(buf) > pos:
                    self._deliver(bytes(buf[pos:]))
                pos = len(buf)
                break
            else:  # _DONE with bytes left: the engine sent more than one answer
                if len(buf) > pos:
                    raise UpstreamProtocolError("data after the end of the response")
                break
        del buf[:pos]

    def _on_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise UpstreamProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # interim answer (100 Continue, 103 Early Hints): the real one follows
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        content_type = ""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise UpstreamProtocolError(f"bad header line {line[:80]!r}")
            value = value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower not in _NOTED:
                continue
            if lower == b"content-length":
                if not value.isdigit() or (length is not None and length != int(value)):
                    raise UpstreamProtocolError(f"bad content-length {value[:40]!r}")
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif lower == b"connection":
                tokens = value.lower()
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
            else:
                content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        response = UpstreamResponse(self, status, reason, headers, content_type, keep_alive)
        self.response = response
        if self._head_only or status in _NO_BODY_STATUS:
            self._state = _DONE
            response._complete = True
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH if length else _DONE
            response._complete = length == 0
        else:
            self._state = _UNTIL_CLOSE
            response.keep_alive = False
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _deliver(self, data: bytes) -> None:
        if self.response is not None:
            self.response._feed(data)

    def _end_body(self) -> None:
        self._state = _DONE
        if self.response is not None:
            self.response._finish()

    def _protocol_error(self, exc: UpstreamProtocolError) -> None:
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(exc)
        elif self.response is not None:
            self.response._fail(exc)
        self.abort()


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, idle_ttl_s: float = 4.0,
                 max_idle_per_host: int = 256) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_ttl_s = idle_ttl_s
        self.max_idle_per_host = max_idle_per_host
        self.idle: dict[tuple[str, int], deque[_Connection]] = {}
        self.connections_made = 0
        self.closing = False

    async def request(self, host: str, port: int, head: bytes, body: bytes,
                      head_only: bool = False) -> UpstreamResponse:
        """Send one request (``head`` is the complete request head) and wait for the answer's head."""
        conn = self._idle_connection((host, port)) or await self._connect(host, port)
        waiter = conn.send(head, body, head_only)
        timer = self.loop.call_later(self.read_timeout_s, _expire, waiter, self.read_timeout_s)
        try:
            return await waiter
        except BaseException:
            conn.abort()
            raise
        finally:
            timer.cancel()

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        idle = self.idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if not conn.closed and transport is not None and not transport.is_closing() \
                    and now - conn.idle_since < self.idle_ttl_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        key = (host, port)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(lambda: _Connection(self, key), host, port)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {host}:{port} timed out after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        self.connections_made += 1
        return conn

    def release(self, conn: _Connection) -> None:
        if self.closing:
            conn.abort()
            return
        idle = self.idle.setdefault(conn.key, deque())
        if len(idle) >= self.max_idle_per_host:
            idle.popleft().abort()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        self.closing = True
        for idle in self.idle.values():
            for conn in idle:
                conn.abort()
        self.idle.clear()


def request_head(method: str, path: str, host_header: str, headers: Iterable[tuple[Any, Any]], extra: bytes,
                 body_length: int) -> bytes:
    """``METHOD path HTTP/1.1`` + Host + ``headers`` (already filtered) + ``extra`` + Content-Length."""
    out = [f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")]
    for name, value in headers:
        out.append(name if isinstance(name, bytes) else name.encode("latin-1"))
        out.append(b": ")
        out.append(value if isinstance(value, bytes) else value.encode("latin-1"))
        out.append(b"\r\n")
    out.append(extra)
    out.append(b"Content-Length: %d\r\n\r\n" % body_length)
    return b"".join(out)
