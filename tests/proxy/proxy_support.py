"""Helpers for the proxy tests: a controllable echo engine, the real scheduler core feeding LB_WEIGHTS,
and proxies started in-process on port 0 against the test's nats-server.

EchoEngine answers the OpenAI routes like vLLM does (SSE chunks, ``[DONE]``, ``usage``) and is
steered per request by a non-standard ``"test"`` field in the body: ``chunks`` (number of SSE
content chunks), ``delay`` (seconds between chunks), ``cut_after`` (abort the connection after
that many chunks), ``status`` (answer with this status; with ``text``, a plain-text body), ``headers`` (extra response headers, with
``status``). Engine-wide ``fail`` modes:
``"http500"`` (every completion answers 500) and ``"drop"`` (close the connection without an
answer). It records every completion it received (body and headers) and every one the client cancelled.

CoreDriver runs ``scheduler.core.Scheduler`` in the test, feeding it admin events with
increasing sequence numbers and real timestamps, and puts each snapshot it emits into KV
LB_WEIGHTS exactly as the scheduler service does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, decode_event, encode, unbatch
from laswrr.services.proxy.app import RunningProxy


# -- the echo engine -----------------------------------------------------------------------------

@dataclass
class EchoEngine:
    name: str
    model: str = "echo-model"
    fail: str = "none"
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # the request headers of each completion
    runner: web.AppRunner | None = None
    url: str = ""

    def chunk(self, i: int, body: dict[str, Any]) -> bytes:
        obj = {"id": "cmpl-echo", "object": "chat.completion.chunk", "created": 1, "model": self.model,
               "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def final(self, n: int, body: dict[str, Any]) -> bytes:
        out = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-echo", "object": "chat.completion.chunk", "created": 1, "model": self.model,
                     "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}
            out += b"data: " + json.dumps(usage).encode() + b"\n\n"
        return out + b"data: [DONE]\n\n"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.fail == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        body = await request.json()
        control = body.get("test") or {}
        self.received.append(body)
        self.headers.append(dict(request.headers))
        if self.fail == "http500":
            return web.json_response({"error": {"message": f"{self.name} broken", "type": "server_error"}}, status=500)
        if "status" in control and "text" in control:  # a plain-text error, as aiohttp's own 413 or a gateway's
            return web.Response(status=control["status"], text=control["text"])
        if "status" in control:
            return web.json_response({"error": {"message": "as asked", "type": "test"}}, status=control["status"],
                                     headers=control.get("headers"))
        n = int(control.get("chunks", 3))
        if not body.get("stream"):
            content = "".join(f"t{i} " for i in range(n))
            return web.json_response({
                "id": "cmpl-echo", "object": "chat.completion", "created": 1, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}},
                headers={"x-engine": self.name})
        return await self._stream(request, body, control, n)

    async def _stream(self, request: web.Request, body: dict[str, Any], control: dict[str, Any],
                      n: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-engine": self.name,
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        delay, cut_after = float(control.get("delay", 0)), control.get("cut_after")
        try:
            for i in range(n):
                if cut_after is not None and i == cut_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                await response.write(self.chunk(i, body))
                if delay:
                    await asyncio.sleep(delay)
            await response.write(self.final(n, body))
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(str(control.get("tag", "")))
            raise
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "echo"}]})

    async def start(self) -> "EchoEngine":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()





# -- the real core feeding LB_WEIGHTS ------------------------------------------------------------

class CoreDriver:
    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.core = Scheduler()
        self.seq = 0

    async def send(self, subject: str, payload: dict[str, Any]) -> int:
        """Apply one input; put the snapshots it produced into LB_WEIGHTS; the input's seq."""
        self.seq += 1
        outputs = self.core.apply(Envelope(seq=self.seq, ts_ns=time.time_ns(), subject=subject,
                                           data=json.dumps(payload).encode()))
        for output in outputs:
            assert output.subject != sj.OUT_REJECTED, output.data
            if output.subject.startswith(sj.OUT_SNAPSHOT + "."):
                await self.kv.put(output.subject.rsplit(".", 1)[1], output.data)
        return self.seq

    async def register(self, node: str, url: str, capacity: int = 4, pool: str = "default") -> int:
        return await self.send(sj.admin_node(node), {"url": url, "capacity": capacity, "pool": pool})

    async def capacity(self, node: str, capacity: int) -> int:
        return await self.send(sj.admin_capacity(node), {"capacity": capacity})

    async def tick(self) -> int:
        return await self.send(sj.CLOCK_TICK, {"tick": self.core.state.tick + 1})





# -- proxies -------------------------------------------------------------------------------------

StartProxy = Callable[..., Awaitable[RunningProxy]]





async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_seq(proxy: RunningProxy, pool: str, seq: int) -> None:
    """Until the proxy routes on a snapshot of ``pool`` at least as new as ``seq``."""
    table = proxy.state.router.table
    await wait_for(lambda: pool in table.snapshots() and table.snapshots()[pool].as_of_seq >= seq,
                   what=f"{pool} snapshot {seq}")





class EventTap:
    """Every event on LB_EVENTS, decoded, in stream order; a proxy's ``lb.req.batch.<proxy>``
    message is unpacked (``schemas.codec.unbatch``) into its events, each under the subject it
    would have alone, and kept whole in ``batches``."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.batches: list[tuple[str, dict[str, Any]]] = []
        self.sub: Any = None

    async def start(self, js: Any) -> "EventTap":
        async def on_msg(msg: Any) -> None:
            if not msg.subject.startswith(sj.REQ_BATCH + "."):
                self.messages.append((msg.subject, json.loads(msg.data)))
                return
            self.batches.append((msg.subject, json.loads(msg.data)))
            proxy, batch = decode_event(msg.subject, msg.data)
            for item in unbatch(proxy or "", batch):  # type: ignore[arg-type]
                assert item.error is None and item.subject is not None, item.error
                self.messages.append((item.subject, json.loads(encode(item.event))))
        self.sub = await js.subscribe("lb.>", stream=sj.EVENTS_STREAM, cb=on_msg, ordered_consumer=True)
        return self

    def of(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        return [(s, d) for s, d in self.messages if s.startswith(prefix)]

    def finished(self, request_id: str) -> dict[str, Any] | None:
        for subject, data in self.of(sj.REQ_FINISHED):
            if data["request_id"] == request_id:
                return data
        return None


async def stored_batches(js: Any) -> list[tuple[int, str, dict[str, Any]]]:
    """Every ``lb.req.batch.>`` message stored in LB_EVENTS: ``(seq, Nats-Msg-Id, payload)``."""
    info = await js.stream_info(sj.EVENTS_STREAM)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(sj.EVENTS_STREAM, seq)
        if msg.subject.startswith(sj.REQ_BATCH + "."):
            found.append((seq, (msg.headers or {}).get("Nats-Msg-Id", ""), json.loads(msg.data)))
    return found


def batch_events(batches: list[tuple[int, str, dict[str, Any]]]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """The events of ``stored_batches`` in stream order: ``(kind, key, event)``."""
    return [(kind, key, event) for _, _, payload in batches for kind, key, event in payload["events"]]
