"""The engine transport's contract (services/proxy/transport.py), run against every implementation
in ``IMPLEMENTATIONS``: a real simulated engine, and real HTTP servers on sockets that answer
length-framed and chunked, keep connections alive, hang up mid-body, stall, or refuse."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from laswrr.services.proxy.engine_client import EnginePool
from laswrr.services.proxy.transport import TRANSPORT_ERRORS, EngineReply, EngineTransport, list_models
from tests.conftest import StartEngine

MakeTransport = Callable[[float | None], EngineTransport]

# Every implementation of services.proxy.transport.EngineTransport: (name, factory(read_timeout_s)).
IMPLEMENTATIONS: list[tuple[str, MakeTransport]] = [
    ("engine_client.EnginePool", lambda read_timeout_s: EnginePool(connect_timeout_s=2.0, read_timeout_s=read_timeout_s)),
]


@pytest.fixture(params=[factory for _, factory in IMPLEMENTATIONS], ids=[name for name, _ in IMPLEMENTATIONS])
async def make_transport(request: pytest.FixtureRequest) -> AsyncIterator[MakeTransport]:
    made: list[EngineTransport] = []

    def make(read_timeout_s: float | None = 10.0) -> EngineTransport:
        made.append(request.param(read_timeout_s))
        return made[-1]

    yield make
    for transport in made:
        await transport.close()


@pytest.fixture
def transport(make_transport: MakeTransport) -> EngineTransport:
    return make_transport(10.0)


# -- a real HTTP server, scripted per path -------------------------------------------------------

SSE = [b"data: {\"n\": 0}\n\n", b"data: {\"n\": 1}\n\n", b"data: [DONE]\n\n"]
JSON = b'{"ok": true}'


@dataclass
class Seen:
    head: bytes
    body: bytes
    connection: int


@dataclass
class RawEngine:
    """asyncio server speaking HTTP/1.1 by hand, so it can misbehave exactly as told by the path."""

    server: asyncio.Server | None = None
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    ended: int = 0  # connections over, whoever ended them
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.seen.append(Seen(head, body, number))
                path = head.split(b" ")[1].decode()
                if not await self.answer(path, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self.ended += 1
            writer.close()

    async def answer(self, path: str, writer: asyncio.StreamWriter) -> bool:
        """Write the answer for ``path``; False: the connection ends here."""
        path = path.split("?")[0]
        if path.endswith("/length"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(JSON), JSON))
        elif path.endswith("/chunked"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for event in SSE:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        elif path.endswith("/close"):
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye")
            await writer.drain()
            return False
        elif path.endswith("/cut-length"):  # promises 100 bytes, sends 10, hangs up
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"partial"')
            await writer.drain()
            return False
        elif path.endswith("/cut-chunked"):  # one event, then the connection ends without the last chunk
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(SSE[0]), SSE[0]))
            await writer.drain()
            await asyncio.sleep(0.05)
            return False
        elif path.endswith("/stall-body"):  # the head and one event, then silence
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(SSE[0]), SSE[0]))
            await writer.drain()
            await asyncio.sleep(30)
            return False
        elif path.endswith("/stall-head"):
            await asyncio.sleep(30)
            return False
        elif path.endswith("/hangup"):
            return False
        elif path.endswith("/big"):
            body = b"x" * 500_000
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        elif path == "/v1/models":
            models = json.dumps({"object": "list", "data": [{"id": "m-1", "object": "model"}, {"id": 7}, "x"]})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(models), models.encode()))
        elif path == "/bad/v1/models":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\nnot json!")
        elif path == "/list/v1/models":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]")
        elif path == "/error/v1/models":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}")
        elif path == "/slow/v1/models":
            await asyncio.sleep(30)
            return False
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return True


@pytest.fixture
async def raw() -> AsyncIterator[RawEngine]:
    engine = RawEngine()
    engine.server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    yield engine
    engine.server.close()
    for task in engine.tasks:  # handlers still stalling
        task.cancel()
    await asyncio.gather(*engine.tasks, return_exceptions=True)
    await engine.server.wait_closed()


async def exchange(transport: EngineTransport, base: str, path: str, body: bytes = b"{}", method: str = "POST",
                   headers: dict[str, str] | None = None) -> tuple[EngineReply, bytes]:
    reply = await transport.request(method, base, path, headers or {"Content-Type": "application/json"}, body)
    try:
        return reply, await reply.read()
    finally:
        reply.close()


async def read_stream(reply: EngineReply) -> list[bytes]:
    chunks = []
    while chunk := await reply.content.readany():
        chunks.append(chunk)
    return chunks


async def settled(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# -- against a real simulated engine -------------------------------------------------------------


async def test_a_sim_engine_answers_requests_streams_and_its_model_list(transport: EngineTransport,
                                                                         start_engine: StartEngine) -> None:
    engine = await start_engine(model="contract-model")
    chat = {"model": "contract-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for base in (engine.url, engine.url + "/v1", engine.url + "/v1/"):  # the node URL rule: /v1 or not
        reply, body = await exchange(transport, base, "/v1/chat/completions", json.dumps(chat).encode())
        assert (reply.status, reply.content_type) == (200, "application/json")
        assert json.loads(body)["choices"][0]["message"]["content"]
    reply = await transport.request("POST", engine.url, "/v1/chat/completions", {"Content-Type": "application/json"},
                                    json.dumps({**chat, "stream": True}).encode())
    try:
        assert (reply.status, reply.content_type) == (200, "text/event-stream")
        streamed = b"".join(await read_stream(reply))
        assert reply.content.at_eof()
    finally:
        reply.close()
    assert streamed.count(b"data: ") >= 2 and streamed.endswith(b"data: [DONE]\n\n")
    assert [m["id"] for m in await list_models(transport, engine.url + "/v1", 2.0)] == ["contract-model"]
    reply, body = await exchange(transport, engine.url, "/v1/no-such-route")
    assert reply.status == 404  # an engine's own answer, whatever it is, is the reply


# -- against real HTTP servers that misbehave ------------------------------------------------------


async def test_the_request_goes_as_given_with_host_and_length(transport: EngineTransport, raw: RawEngine) -> None:
    headers = {"Content-Type": "application/json", "X-Custom": "caf\u00e9", "Authorization": "Bearer k"}
    await exchange(transport, raw.url + "/gw/v1", "/v1/length?x=1", b'{"a": 1}', headers=headers)
    seen = raw.seen[0]
    lines = seen.head.decode("utf-8").split("\r\n")
    assert lines[0] == "POST /gw/v1/length?x=1 HTTP/1.1"
    names = [line.split(":")[0].lower() for line in lines[1:] if line]
    assert sorted(names) == ["authorization", "content-length", "content-type", "host", "x-custom"]  # nothing added
    assert f"Host: 127.0.0.1:{raw.url.rsplit(':', 1)[1]}" in lines and "X-Custom: caf\u00e9" in lines
    assert "Content-Length: 8" in lines and seen.body == b'{"a": 1}'


async def test_length_framed_and_chunked_answers_share_one_keep_alive_connection(transport: EngineTransport,
                                                                                raw: RawEngine) -> None:
    for _ in range(3):
        reply, body = await exchange(transport, raw.url, "/length")
        assert (reply.status, reply.content_type, body) == (200, "application/json", JSON)
        reply, body = await exchange(transport, raw.url, "/chunked")
        assert (reply.status, reply.content_type, body) == (200, "text/event-stream", b"".join(SSE))
    reply = await transport.request("POST", raw.url, "/chunked", {}, b"")
    try:
        assert b"".join(await read_stream(reply)) == b"".join(SSE)  # read as it comes, to its end
    finally:
        reply.close()
    await exchange(transport, raw.url, "/length", method="GET", body=b"")
    assert raw.connections == 1 and len(raw.seen) == 8


async def test_a_body_not_read_to_its_end_closes_its_connection(transport: EngineTransport, raw: RawEngine) -> None:
    reply = await transport.request("POST", raw.url, "/big", {}, b"")
    assert reply.status == 200
    reply.close()  # unread: the connection cannot carry another answer; closing it aborts the engine's work
    assert await settled(lambda: raw.ended == 1)  # the engine sees its connection end
    await exchange(transport, raw.url, "/length")
    assert raw.connections == 2
    reply, body = await exchange(transport, raw.url, "/big")
    assert len(body) == 500_000
    await exchange(transport, raw.url, "/length")
    assert raw.connections == 2  # read whole: kept


async def test_connection_close_from_the_engine_is_honoured(transport: EngineTransport, raw: RawEngine) -> None:
    reply, body = await exchange(transport, raw.url, "/close")
    assert (reply.status, body, reply.content_type) == (200, b"bye", "application/octet-stream")
    await exchange(transport, raw.url, "/length")
    assert raw.connections == 2


@pytest.mark.parametrize("path", ["/cut-length", "/cut-chunked"])
async def test_a_connection_closed_mid_body_raises_and_is_not_reused(transport: EngineTransport, raw: RawEngine,
                                                                     path: str) -> None:
    reply = await transport.request("POST", raw.url, path, {}, b"")
    try:
        assert reply.status == 200
        with pytest.raises(TRANSPORT_ERRORS):
            await read_stream(reply)
    finally:
        reply.close()
    reply, body = await exchange(transport, raw.url, "/length")
    assert body == JSON and raw.connections == 2


async def test_an_engine_that_hangs_up_before_answering_raises(transport: EngineTransport, raw: RawEngine) -> None:
    with pytest.raises(TRANSPORT_ERRORS):
        await exchange(transport, raw.url, "/hangup")
    assert (await exchange(transport, raw.url, "/length"))[1] == JSON


async def test_a_stall_raises_a_timeout_after_the_read_timeout(make_transport: MakeTransport, raw: RawEngine) -> None:
    transport = make_transport(0.3)
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await exchange(transport, raw.url, "/stall-head")  # nothing at all
    reply = await transport.request("POST", raw.url, "/stall-body", {}, b"")  # the head and one event
    try:
        assert await reply.content.readany() == SSE[0]
        with pytest.raises(asyncio.TimeoutError):
            await reply.content.readany()
    finally:
        reply.close()
    assert time.monotonic() - started < 5.0
    assert issubclass(asyncio.TimeoutError, TRANSPORT_ERRORS)
    assert (await exchange(transport, raw.url, "/length"))[1] == JSON  # a new connection after the stalled ones
    assert raw.connections == 3


async def test_bad_urls_headers_and_unreachable_engines(transport: EngineTransport, raw: RawEngine) -> None:
    with pytest.raises(ValueError, match="newline"):
        await exchange(transport, raw.url, "/length", headers={"X-Evil": "a\r\nX-Injected: 1"})
    with pytest.raises(ValueError):
        await exchange(transport, "ftp://127.0.0.1:21", "/length")
    assert raw.seen == []
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(OSError):  # nothing listens there any more
        await exchange(transport, f"http://127.0.0.1:{port}", "/length")


async def test_model_lists_go_through_the_transport(transport: EngineTransport, raw: RawEngine) -> None:
    assert await list_models(transport, raw.url, 2.0) == [{"id": "m-1", "object": "model"}]  # malformed entries out
    assert raw.seen[-1].head.startswith(b"GET /v1/models HTTP/1.1\r\n")
    for base in (raw.url + "/bad", raw.url + "/list", raw.url + "/error/v1", "http://127.0.0.1:1"):
        assert await list_models(transport, base, 2.0) == []
    started = time.monotonic()
    assert await list_models(transport, raw.url + "/slow", 0.3) == []
    assert time.monotonic() - started < 2.0
    await list_models(transport, raw.url, 2.0, {"Authorization": "Bearer up"})
    assert b"Authorization: Bearer up\r\n" in raw.seen[-1].head
