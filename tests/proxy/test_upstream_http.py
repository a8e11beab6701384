"""The proxy's own HTTP/1.1 upstream client against a scripted TCP server on port 0: framing, keep-alive,
streaming, timeouts and failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from services.natsbus import free_port
from services.proxy.upstream_http import (
    HIGH_WATER,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
    request_head,
)

Step = bytes | float | str  # bytes to write, seconds to sleep, "close", "abort", "silence" (until the client hangs up)


@dataclass
class ScriptedServer:
    """Answers each request (read by Content-Length) with the next script from ``scripts``."""

    scripts: deque[list[Step]] = field(default_factory=deque)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    port: int = 0

    async def start(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eof_seen.set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.requests.append(head + await reader.readexactly(length))
                for step in self.scripts.popleft():
                    if isinstance(step, bytes):
                        writer.write(step)
                        await writer.drain()
                    elif isinstance(step, float):
                        await asyncio.sleep(step)
                    elif step == "close":
                        writer.close()
                        return
                    elif step == "abort":
                        writer.transport.abort()
                        return
                    elif step == "silence":  # say nothing more until the client hangs up
                        with contextlib.suppress(ConnectionError):
                            await reader.read()
                        self.eof_seen.set()
                        return
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    srv = await ScriptedServer().start()
    yield srv
    await srv.stop()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=2.0)
    yield p
    p.close()


def head_for(port: int, body: bytes = b"{}") -> bytes:
    return request_head("POST", "/v1/chat/completions", f"127.0.0.1:{port}", [(b"x-test", b"1")], b"", len(body))


async def ask(pool: UpstreamPool, server: ScriptedServer, body: bytes = b"{}") -> UpstreamResponse:
    return await pool.request("127.0.0.1", server.port, head_for(server.port, body), body)


async def read_all_pieces(response: UpstreamResponse) -> list[bytes]:
    pieces = []
    while piece := await response.readany():
        pieces.append(piece)
    return pieces


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_content_length_body_in_pieces_then_keep_alive(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.extend([
        [b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nX-Engine: a\r\nContent-Len",
         0.02, b"gth: 10\r\n\r\n{\"a\":", 0.02, b" 123}"],
        [b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"],
    ])
    response = await ask(pool, server, b'{"model": "m"}')
    assert response.status == 200 and response.content_type == "application/json"
    assert (b"X-Engine", b"a") in response.headers
    assert await response.read() == b'{"a": 123}'
    response.close()
    second = await ask(pool, server)
    assert second.status == 201 and await second.read() == b"ok"
    second.close()
    assert server.connections == 1 and pool.connections_made == 1
    request = server.requests[0]
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nx-test: 1\r\n" in request and request.endswith(b'Content-Length: 14\r\n\r\n{"model": "m"}')


async def test_content_length_exact_body(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", 0.01, b"0123", 0.01, b"456789"])
    response = await ask(pool, server)
    assert await response.read() == b"0123456789"
    response.close()


async def test_chunked_stream_split_anywhere(server: ScriptedServer, pool: UpstreamPool) -> None:
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)]
    raw = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: t\r\n\r\n")
    server.scripts.append([raw[i:i + 7] for i in range(0, len(raw), 7)])
    server.scripts.append([b"HTTP/1.1 204 No Content\r\n\r\n"])
    response = await ask(pool, server)
    assert response.content_type == "text/event-stream"
    assert b"".join(await read_all_pieces(response)) == b"".join(events)
    response.close()
    again = await ask(pool, server)
    assert again.status == 204 and await again.read() == b""
    again.close()
    assert server.connections == 1


async def test_body_until_close_is_not_reused(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ", 0.02, b"part two", "close"])
    server.scripts.append([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx"])
    server.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\ny"])
    response = await ask(pool, server)
    assert await response.read() == b"part one, part two"
    response.close()
    closing = await ask(pool, server)
    assert await closing.read() == b"x" and not closing.keep_alive
    closing.close()
    last = await ask(pool, server)
    assert await last.read() == b"y"
    last.close()
    assert server.connections == 3


async def test_interim_answer_is_skipped(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 100 Continue\r\n\r\n", 0.01, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"])
    response = await ask(pool, server)
    assert response.status == 200 and await response.read() == b"hi"
    response.close()


@pytest.mark.parametrize("raw", [b"HTTP/2 200 OK\r\n\r\n", b"garbage\r\n\r\n", b"HTTP/1.1 abc OK\r\n\r\n",
                                 b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                                 b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"])
async def test_malformed_head(server: ScriptedServer, pool: UpstreamPool, raw: bytes) -> None:
    server.scripts.append([raw, "silence"])
    with pytest.raises(UpstreamProtocolError):
        await ask(pool, server)


async def test_bad_chunk_size_fails_the_body(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n", "silence"])
    response = await ask(pool, server)
    with pytest.raises(UpstreamProtocolError):
        await read_all_pieces(response)
    response.close()


async def test_engine_closes_before_answering_or_mid_body(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append(["abort"])
    with pytest.raises(UpstreamDisconnected):
        await ask(pool, server)
    server.scripts.append([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", 0.02, "close"])
    response = await ask(pool, server)
    assert await response.readany() == b"abc"
    with pytest.raises(UpstreamDisconnected):
        await response.readany()
    response.close()


async def test_silence_times_out() -> None:
    srv = await ScriptedServer().start()
    pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=0.2)
    try:
        srv.scripts.append(["silence"])
        with pytest.raises(UpstreamTimeout):
            await ask(pool, srv)
        srv.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", "silence"])
        response = await ask(pool, srv)
        with pytest.raises(UpstreamTimeout):
            await response.read()
        response.close()
    finally:
        pool.close()
        await srv.stop()


async def test_connect_refused(pool: UpstreamPool) -> None:
    port = free_port()
    with pytest.raises(UpstreamConnectError):
        await pool.request("127.0.0.1", port, head_for(port), b"{}")


async def test_close_before_the_end_aborts_the_connection(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "silence"])
    response = await ask(pool, server)
    assert await response.readany() == b"abc"
    response.close()
    await asyncio.wait_for(server.eof_seen.wait(), 2)
    assert not pool.idle.get(("127.0.0.1", server.port))


async def test_idle_connection_closed_by_the_engine_is_not_reused(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na", 0.05, "close"])
    server.scripts.append([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb"])
    first = await ask(pool, server)
    assert await first.read() == b"a"
    first.close()
    await asyncio.sleep(0.2)  # the engine closes the idle connection meanwhile
    second = await ask(pool, server)
    assert await second.read() == b"b"
    second.close()
    assert server.connections == 2


async def test_slow_reader_pauses_the_engine_and_gets_every_byte(server: ScriptedServer, pool: UpstreamPool) -> None:
    piece = b"x" * 65536
    count = 4 * HIGH_WATER // len(piece)
    raw = chunked(*([piece] * count))
    server.scripts.append([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + raw])
    response = await ask(pool, server)
    await asyncio.sleep(0.2)  # nobody reads: the connection stops reading past the high-water mark
    conn = response._conn
    assert conn is not None and conn._paused
    assert response._buffered <= HIGH_WATER + len(raw)
    total = sum(len(p) for p in await read_all_pieces(response))
    assert total == len(piece) * count
    response.close()
