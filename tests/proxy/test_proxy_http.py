"""The proxy's HTTP/1.1 server on port 0 with a test handler, driven over raw sockets: framing, pipelining,
refusals, keep-alive, streaming backpressure, client disconnects, shutdown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from proxy_support import StartProxy

from services.proxy.server import HttpRequest, HttpServer, Responder

LIMIT = 1000


class Echo:
    """Answers ``/echo`` with what it got, ``/stream`` with N chunks, ``/hang`` never, ``/boom`` by raising."""

    def __init__(self) -> None:
        self.seen: list[HttpRequest] = []
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.stream_done = asyncio.Event()

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        self.seen.append(request)
        if request.path == "/echo":
            responder.json(200, {"method": request.method, "target": request.target, "body": request.body.decode(),
                                 "x": request.header("X-Test")})
        elif request.path == "/stream":
            await responder.start(200, [("Content-Type", "text/event-stream")])
            for i in range(int(request.header("x-chunks") or 3)):
                await responder.write(b"data: %d %s\n\n" % (i, b"x" * int(request.header("x-pad") or 0)))
            await responder.end()
            self.stream_done.set()
        elif request.path == "/hang":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            responder.send(200, b"released")
        elif request.path == "/boom":
            raise RuntimeError("boom")
        # /silent: no answer at all


def too_large(responder: Responder) -> None:
    responder.json(413, {"error": {"code": "request_too_large"}})


@pytest.fixture
async def echo() -> AsyncIterator[tuple[Echo, HttpServer, int]]:
    handler = Echo()
    server = HttpServer(handler, too_large, LIMIT)
    port = await server.listen("127.0.0.1", 0)
    yield handler, server, port
    server.shutdown()
    server.abort()


async def exchange(port: int, raw: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += (await reader.readexactly(size + 2))[:-2]
            if size == 0:  # no trailers: the CRLF after "0" ends the body
                break
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return status, headers, body


def post(target: str, body: bytes, *extra: str) -> bytes:
    head = f"POST {target} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n" + "".join(f"{e}\r\n" for e in extra)
    return head.encode() + b"\r\n" + body


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


async def test_pipelined_requests_answered_in_order(echo: tuple[Echo, HttpServer, int]) -> None:
    _, _, port = echo
    reader, writer = await exchange(port, post("/echo?a=1", b"first", "X-Test: yes") + post("/echo", b"second"))
    first, second = await read_response(reader), await read_response(reader)
    assert first[0] == 200 and json.loads(first[2]) == {"method": "POST", "target": "/echo?a=1", "body": "first",
                                                         "x": "yes"}
    assert json.loads(second[2])["body"] == "second" and "connection" not in second[1]
    writer.close()


async def test_chunked_body_and_expect_continue(echo: tuple[Echo, HttpServer, int]) -> None:
    _, _, port = echo
    reader, writer = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
                                          b"Expect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nTrailer: x\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    writer.close()


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
])
async def test_malformed_requests_refused_and_closed(echo: tuple[Echo, HttpServer, int], raw: bytes,
                                                     status: int) -> None:
    handler, _, port = echo
    reader, writer = await exchange(port, raw)
    got, headers, body = await read_response(reader)
    assert got == status and headers["connection"] == "close" and "error" in json.loads(body)
    assert await closed(reader) and handler.seen == []
    writer.close()


async def test_body_over_the_limit_is_413_before_reading_it(echo: tuple[Echo, HttpServer, int]) -> None:
    handler, _, port = echo
    reader, writer = await exchange(port, b"POST /echo HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
    status, headers, _ = await read_response(reader)  # no body byte was sent
    assert status == 413 and headers["connection"] == "close" and await closed(reader)
    writer.close()
    chunk = b"x" * 600
    reader, writer = await exchange(port, b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                          + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2)
    assert (await read_response(reader))[0] == 413 and await closed(reader)
    assert handler.seen == []
    writer.close()


async def test_keep_alive_rules(echo: tuple[Echo, HttpServer, int]) -> None:
    _, _, port = echo
    writers = []
    reader, writer = await exchange(port, b"GET /echo HTTP/1.0\r\n\r\n")
    writers.append(writer)
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close" and await closed(reader)
    reader, writer = await exchange(port, b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /echo HTTP/1.1\r\n"
                                          b"Connection: close\r\n\r\n")
    writers.append(writer)
    first, second = await read_response(reader), await read_response(reader)
    assert "connection" not in first[1] and second[1]["connection"] == "close" and await closed(reader)
    reader, writer = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")  # streamed to 1.0: close-delimited
    writers.append(writer)
    status, headers, body = await read_response(reader)
    assert "transfer-encoding" not in headers and body == b"data: 0 \n\ndata: 1 \n\ndata: 2 \n\n"
    for writer in writers:
        writer.close()


async def test_streaming_waits_for_a_slow_client(echo: tuple[Echo, HttpServer, int]) -> None:
    handler, _, port = echo
    reader, writer = await exchange(port, b"GET /stream HTTP/1.1\r\nx-chunks: 400\r\nx-pad: 20000\r\n\r\n")
    await asyncio.sleep(0.3)
    assert not handler.stream_done.is_set()  # 8 MB cannot all be buffered: the handler waits on the client
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked" and body.count(b"data: ") == 400
    assert handler.stream_done.is_set()
    writer.close()


async def test_client_gone_cancels_the_handler(echo: tuple[Echo, HttpServer, int]) -> None:
    handler, server, port = echo
    _, writer = await exchange(port, b"GET /hang HTTP/1.1\r\n\r\n")
    await asyncio.sleep(0.1)
    assert server.active == 1
    writer.close()
    await asyncio.wait_for(handler.cancelled.wait(), 5)
    await asyncio.wait_for(server.idle.wait(), 5)


async def test_handler_failure_or_silence_is_500(echo: tuple[Echo, HttpServer, int]) -> None:
    _, _, port = echo
    for path in ("/boom", "/silent"):
        reader, writer = await exchange(port, f"GET {path} HTTP/1.1\r\n\r\n".encode())
        status, _, body = await read_response(reader)
        assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
        writer.close()


async def test_shutdown_closes_idle_and_finishes_busy(echo: tuple[Echo, HttpServer, int]) -> None:
    handler, server, port = echo
    idle_reader, idle_writer = await exchange(port, b"GET /echo HTTP/1.1\r\n\r\n")
    await read_response(idle_reader)
    busy_reader, busy_writer = await exchange(port, b"GET /hang HTTP/1.1\r\n\r\n")
    await asyncio.sleep(0.1)
    server.shutdown()
    assert await closed(idle_reader)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    handler.release.set()
    status, headers, body = await read_response(busy_reader)
    assert (status, body) == (200, b"released") and headers["connection"] == "close" and await closed(busy_reader)
    idle_writer.close()
    busy_writer.close()


async def test_proxy_unknown_path_and_method(start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    async with http.get(proxy.url + "/nope") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with http.get(proxy.url + "/v1/chat/completions") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
    async with http.post(proxy.url + "/healthz", json={}) as resp:
        assert resp.status == 405
    async with http.head(proxy.url + "/healthz") as resp:
        assert resp.status == 200 and int(resp.headers["Content-Length"]) > 0 and await resp.read() == b""


async def test_connections_without_a_request_are_closed_after_keepalive() -> None:
    handler = Echo()
    server = HttpServer(handler, too_large, LIMIT, keepalive_s=0.4)
    port = await server.listen("127.0.0.1", 0)
    try:
        idle_reader, idle_writer = await exchange(port, b"GET /echo HTTP/1.1\r\n\r\n")
        await read_response(idle_reader)
        stuck_reader, stuck_writer = await exchange(port, b"GET /echo HTTP/1.1\r\nX-Never: ends")
        busy_reader, busy_writer = await exchange(port, b"GET /hang HTTP/1.1\r\n\r\n")
        assert await closed(idle_reader) and await closed(stuck_reader)
        assert server.active == 1  # a running request is never cut
        handler.release.set()
        assert (await read_response(busy_reader))[2] == b"released"
        for writer in (idle_writer, stuck_writer, busy_writer):
            writer.close()
    finally:
        server.shutdown()
        server.abort()
