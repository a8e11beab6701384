"""The proxy's engine client (services/proxy/engine_client.py) against a real HTTP server:
what it sends, when it keeps a connection and when it must not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from laswrr.services.proxy.engine_client import EnginePool
from laswrr.services.proxy.transport import parse_target


class Engine:
    """An aiohttp server that records each request's head and the connection it came on."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.connections: set[int] = set()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        assert request.transport is not None
        peer = request.transport.get_extra_info("peername")[1]
        self.connections.add(peer)
        self.seen.append({"method": request.method, "path": request.path_qs, "headers": dict(request.headers),
                          "raw": request.raw_headers, "body": body, "peer": peer})
        if request.path == "/close":
            return web.Response(body=b"bye", headers={"Connection": "close"})
        if request.path == "/sse":  # chunked, as engines stream
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(b"data: %d\n\n" % i)
            await response.write_eof()
            return response
        if request.path == "/big":
            return web.Response(body=b"x" * 1_000_000, content_type="application/json")
        return web.json_response({"ok": True, "n": len(self.seen)})

    async def start(self, keepalive_timeout: float = 75.0) -> Engine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    running = await Engine().start()
    yield running
    assert running.runner is not None
    await running.runner.cleanup()


@pytest.fixture
async def pool() -> AsyncIterator[EnginePool]:
    engines = EnginePool(connect_timeout_s=2.0, read_timeout_s=10.0)
    yield engines
    await engines.close()


async def call(pool: EnginePool, base: str, path: str, body: bytes = b"{}", read: bool = True,
               headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    response = await pool.request("POST", base, path, headers or {"Content-Type": "application/json"}, body)
    try:
        data = await response.read() if read else b""
        return response.status, data, response.content_type
    finally:
        response.close()


async def test_the_request_goes_as_given_with_host_and_length(engine: Engine, pool: EnginePool) -> None:
    headers = {"Content-Type": "application/json", "X-Custom": "caf\u00e9", "Authorization": "Bearer k"}
    status, body, ctype = await call(pool, engine.url + "/v1", "/v1/chat/completions?x=1", b'{"a": 1}', headers=headers)
    assert (status, ctype) == (200, "application/json") and b'"ok": true' in body
    seen = engine.seen[0]
    assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/v1/chat/completions?x=1", b'{"a": 1}')
    port = engine.url.rsplit(":", 1)[1]
    names = [name for name, _ in seen["raw"]]
    assert names == [b"Host", b"Content-Type", b"X-Custom", b"Authorization", b"Content-Length"]
    assert dict(seen["raw"])[b"Host"] == f"127.0.0.1:{port}".encode()
    assert dict(seen["raw"])[b"X-Custom"] == "caf\u00e9".encode()  # the bytes the client sent, as they came
    assert dict(seen["raw"])[b"Content-Length"] == b"8"


async def test_a_connection_is_kept_only_after_a_whole_body(engine: Engine, pool: EnginePool) -> None:
    for _ in range(3):
        assert (await call(pool, engine.url, "/a"))[0] == 200
    assert len(engine.connections) == 1  # one keep-alive connection for all three
    await call(pool, engine.url, "/big", read=False)  # closed before its body was read: not reusable
    await call(pool, engine.url, "/a")
    assert len(engine.connections) == 2
    assert (await call(pool, engine.url, "/big"))[1] == b"x" * 1_000_000  # read whole: kept
    await call(pool, engine.url, "/a")
    assert len(engine.connections) == 2
    for _ in range(2):  # chunked and length-framed answers one after the other on the same connection
        assert await call(pool, engine.url, "/sse") == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n", "text/event-stream")
        assert (await call(pool, engine.url, "/a"))[1].startswith(b'{"ok": true')
    assert len(engine.connections) == 2


async def test_connection_close_from_the_engine_is_honoured(engine: Engine, pool: EnginePool) -> None:
    assert await call(pool, engine.url, "/close") == (200, b"bye", "application/octet-stream")
    await call(pool, engine.url, "/a")
    assert len(engine.connections) == 2


async def test_a_connection_the_engine_closed_while_idle_is_not_used() -> None:
    engine = await Engine().start(keepalive_timeout=0.2)
    engines = EnginePool(connect_timeout_s=2.0, read_timeout_s=10.0)
    try:
        await call(engines, engine.url, "/a")
        for _ in range(100):  # until the engine's keep-alive timer has closed it
            if not engines._idle or all(not p.is_connected() for p, _ in next(iter(engines._idle.values()))):
                break
            await asyncio.sleep(0.05)
        assert (await call(engines, engine.url, "/a"))[0] == 200
        assert len(engine.connections) == 2
    finally:
        await engines.close()
        assert engine.runner is not None
        await engine.runner.cleanup()


async def test_idle_connections_older_than_keepalive_are_dropped(engine: Engine) -> None:
    engines = EnginePool(connect_timeout_s=2.0, read_timeout_s=10.0, keepalive_s=0.0)
    try:
        await call(engines, engine.url, "/a")
        await call(engines, engine.url, "/a")
        assert len(engine.connections) == 2
    finally:
        await engines.close()


async def test_failures_raise_what_the_forwarder_catches(engine: Engine, pool: EnginePool) -> None:
    with pytest.raises(ValueError, match="newline"):
        await call(pool, engine.url, "/a", headers={"X-Evil": "a\r\nX-Injected: 1"})
    with pytest.raises(OSError):
        await call(pool, "http://127.0.0.1:1", "/a")  # nothing listens there
    with pytest.raises(ValueError):
        await call(pool, "ftp://127.0.0.1:21", "/a")
    assert engine.seen == []


async def test_a_silent_engine_times_out_on_read() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1000)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    engines = EnginePool(connect_timeout_s=2.0, read_timeout_s=0.3)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(asyncio.TimeoutError):
            await call(engines, f"http://127.0.0.1:{port}", "/a")
    finally:
        await engines.close()
        server.close()


async def test_an_engine_that_hangs_up_raises_a_client_error() -> None:
    async def rude(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1000)
        writer.close()

    server = await asyncio.start_server(rude, "127.0.0.1", 0)
    engines = EnginePool(connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(aiohttp.ClientError):
            await call(engines, f"http://127.0.0.1:{port}", "/a")
    finally:
        await engines.close()
        server.close()


def test_targets() -> None:
    assert parse_target("http://e:1/v1") == ("e", 1, False, "e:1", "")
    assert parse_target("http://e:1/base/v1/") == ("e", 1, False, "e:1", "/base")
    assert parse_target("https://e") == ("e", 443, True, "e", "")
    assert parse_target("http://[::1]:8000") == ("::1", 8000, False, "[::1]:8000", "")
