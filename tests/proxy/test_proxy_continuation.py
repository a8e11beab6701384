"""Streams that survive their engine: real sim-engine processes killed by PID mid-stream, a real
nats-server, a proxy in this process routing on the real scheduler core's snapshots.

Each engine of a test is steered by its admin fault ``stall_stream`` (send ``cut_after`` tokens,
then hold the connection open), so the break comes after exactly K tokens; the test then kills
the engine's process by its PID (or lets the proxy's stall timeout fire). The next node is
registered only once the stream is on the doomed one, so every hop is deterministic. The text
the client must see is what an engine gives for the same request unbroken (every engine has the
same seed, so the same words).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.services.proxy.app import RunningProxy
from laswrr.services.sim_engine.cli import LISTEN_PREFIX

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-910B"
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
MESSAGES = [{"role": "user", "content": "tell me a long story about NPUs"}]
PROMPT = "Once upon a time, on an Ascend NPU,"


@dataclass
class EngineProcess:
    node: str
    process: asyncio.subprocess.Process
    url: str

    async def admin(self, http: aiohttp.ClientSession, **changes: Any) -> None:
        async with http.post(self.url + "/admin", json=changes) as resp:
            assert resp.status == 200, await resp.text()

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)  # by its own PID: the engine dies mid-stream
        await self.process.wait()


StartEngine = Callable[[str], Awaitable[EngineProcess]]


@pytest.fixture
async def engine_processes() -> AsyncIterator[StartEngine]:
    started: list[EngineProcess] = []

    async def _start(node: str) -> EngineProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "laswrr.services.sim_engine.cli", "sim-engine", "--port", "0", "--chip", "910B",
            "--capacity", "4", "--speed", "10", "--node-id", node, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode().strip()
        assert line.startswith(LISTEN_PREFIX), line
        engine = EngineProcess(node, process, line.removeprefix(LISTEN_PREFIX))
        started.append(engine)
        return engine

    yield _start
    for engine in started:
        if engine.process.returncode is None:
            engine.process.kill()
            await engine.process.wait()


def request_body(kind: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if kind == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = PROMPT
    return body


async def unbroken(http: aiohttp.ClientSession, engine: EngineProcess, kind: str, max_tokens: int) -> dict[str, Any]:
    """The engine's non-streamed answer to the same request: the text and usage to expect."""
    body = dict(request_body(kind, max_tokens), stream=False)
    body.pop("stream_options")
    async with http.post(engine.url + ROUTES[kind], json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()  # type: ignore[no-any-return]


def text_of(kind: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if kind == "chat" else choice["text"]  # type: ignore[no-any-return]


@dataclass
class Seen:
    """What a raw SSE client read: every data event (decoded), and the raw [DONE] count."""

    events: list[dict[str, Any]]
    done: int
    raw: bytes

    def text(self, kind: str) -> str:
        parts = []
        for event in self.events:
            for choice in event.get("choices") or ():
                parts.append(choice.get("text") or "" if kind == "completion"
                             else (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if "error" in e]


async def stream_through(http: aiohttp.ClientSession, proxy: RunningProxy, kind: str, body: dict[str, Any],
                         tokens_seen: asyncio.Queue[int]) -> Seen:
    """Read a stream through the proxy, reporting the content tokens seen so far."""
    raw, events, tokens = b"", [], 0
    async with http.post(proxy.url + ROUTES[kind], json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            raw += line
            payload = line.strip().removeprefix(b"data:").strip()
            if not payload or payload == b"[DONE]":
                continue
            event = json.loads(payload)
            events.append(event)
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                tokens += 1
                tokens_seen.put_nowait(tokens)
    return Seen(events, raw.count(b"data: [DONE]"), raw)


async def until_tokens(queue: asyncio.Queue[int], k: int) -> None:
    while await asyncio.wait_for(queue.get(), 20) < k:
        pass


async def make_routable(core: CoreDriver, proxy: RunningProxy, engine: EngineProcess) -> None:
    """Register ``engine`` and tick until the proxy's snapshot lets it take requests."""
    await wait_seq(proxy, "default", await core.register(engine.node, engine.url, capacity=4))
    targets = proxy.state.router.table.route("default").first.targets
    for _ in range(100):
        if engine.node in targets:
            return
        await wait_seq(proxy, "default", await core.tick())
        targets = proxy.state.router.table.route("default").first.targets
    raise AssertionError(f"{engine.node} never became routable")


async def finished_events(tap: EventTap, count: int) -> list[tuple[str, dict[str, Any]]]:
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) >= count, timeout=10, what=f"{count} finished events")
    return tap.of(sj.REQ_FINISHED)


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_engine_killed_after_k_tokens_the_stream_completes_on_another_node(
        kind: str, engine_processes: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession, tap: EventTap) -> None:
    max_tokens, k = 40, 7
    doomed, rescuer = await engine_processes("doomed"), await engine_processes("rescuer")
    expected = await unbroken(http, rescuer, kind, max_tokens)
    await doomed.admin(http, fail="stall_stream", cut_after=k)
    proxy = await start_proxy()
    await make_routable(core, proxy, doomed)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream_through(http, proxy, kind, request_body(kind, max_tokens), tokens))
    await until_tokens(tokens, k)
    await make_routable(core, proxy, rescuer)
    await doomed.kill()
    seen = await reading

    assert seen.errors == [] and seen.done == 1 and seen.raw.rstrip().endswith(b"data: [DONE]")
    assert seen.text(kind) == text_of(kind, expected)  # no duplicated and no missing text
    assert len(seen.text(kind).split()) == max_tokens
    assert {e["id"] for e in seen.events} == {seen.events[0]["id"]}
    assert {e["created"] for e in seen.events} == {seen.events[0]["created"]}
    usage = seen.events[-1]["usage"]
    assert usage == {"prompt_tokens": expected["usage"]["prompt_tokens"], "completion_tokens": max_tokens,
                     "total_tokens": expected["usage"]["prompt_tokens"] + max_tokens}
    if kind == "chat":
        assert sum("role" in (c.get("delta") or {}) for e in seen.events for c in e["choices"]) == 1

    broken, continued = await finished_events(tap, 2)
    assert broken[0] == sj.req_finished("doomed") and continued[0] == sj.req_finished("rescuer")
    assert broken[1]["outcome"] == "continued" and broken[1]["completion_tokens"] == k
    assert broken[1]["next_attempt"] == continued[1]["request_id"] == broken[1]["request_id"] + ".1"
    assert continued[1]["outcome"] == "completed" and continued[1]["completion_tokens"] == max_tokens - k


async def test_the_openai_client_sees_one_uninterrupted_completion(
        engine_processes: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession) -> None:
    max_tokens, k = 30, 5
    doomed, rescuer = await engine_processes("doomed"), await engine_processes("rescuer")
    expected = await unbroken(http, rescuer, "chat", max_tokens)
    await doomed.admin(http, fail="stall_stream", cut_after=k)
    proxy = await start_proxy()
    await make_routable(core, proxy, doomed)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                      stream=True, stream_options={"include_usage": True})
        chunks, text = [], ""
        async for chunk in stream:
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if len(text.split()) == k:
                    await make_routable(core, proxy, rescuer)
                    await doomed.kill()
    finally:
        await client.close()
    assert text == expected["choices"][0]["message"]["content"]
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens
    assert chunks[-1].usage.prompt_tokens == expected["usage"]["prompt_tokens"]


async def test_a_stall_beyond_the_timeout_is_a_break(engine_processes: StartEngine, core: CoreDriver,
                                                     start_proxy: StartProxy, http: aiohttp.ClientSession,
                                                     tap: EventTap) -> None:
    stalled, rescuer = await engine_processes("stalled"), await engine_processes("rescuer")
    expected = await unbroken(http, rescuer, "completion", 25)
    await stalled.admin(http, fail="stall_stream", cut_after=4)
    proxy = await start_proxy(stall_timeout_s=0.5)
    await make_routable(core, proxy, stalled)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream_through(http, proxy, "completion", request_body("completion", 25), tokens))
    await until_tokens(tokens, 4)
    await make_routable(core, proxy, rescuer)
    seen = await reading  # the stalled engine is alive: only the stall timeout ends its attempt
    assert seen.text("completion") == text_of("completion", expected) and seen.done == 1
    broken, _ = await finished_events(tap, 2)
    assert broken[1]["outcome"] == "continued" and broken[1]["error"].startswith("stalled: no byte for 0.5 s")


async def test_two_engines_dying_in_turn_with_continue_limit_2(
        engine_processes: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession, tap: EventTap) -> None:
    max_tokens = 36
    first, second, third = [await engine_processes(n) for n in ("first", "second", "third")]
    expected = await unbroken(http, third, "chat", max_tokens)
    await first.admin(http, fail="stall_stream", cut_after=6)
    await second.admin(http, fail="stall_stream", cut_after=10)  # 10 tokens of its continuation
    proxy = await start_proxy(continue_limit=2)
    await make_routable(core, proxy, first)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream_through(http, proxy, "chat", request_body("chat", max_tokens), tokens))
    await until_tokens(tokens, 6)
    await make_routable(core, proxy, second)
    await first.kill()
    await until_tokens(tokens, 16)
    await make_routable(core, proxy, third)
    await second.kill()
    seen = await reading
    assert seen.errors == [] and seen.done == 1
    assert seen.text("chat") == expected["choices"][0]["message"]["content"]
    assert seen.events[-1]["usage"]["completion_tokens"] == max_tokens
    finished = await finished_events(tap, 3)
    assert [(s, d["outcome"], d["completion_tokens"]) for s, d in finished] == [
        (sj.req_finished("first"), "continued", 6), (sj.req_finished("second"), "continued", 10),
        (sj.req_finished("third"), "completed", 20)]
    assert [d.get("next_attempt") for _, d in finished] == [finished[1][1]["request_id"], finished[2][1]["request_id"],
                                                           None]


async def test_continue_limit_reached_ends_with_the_error_event(
        engine_processes: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession, tap: EventTap) -> None:
    first, second, third = [await engine_processes(n) for n in ("first", "second", "third")]
    await first.admin(http, fail="stall_stream", cut_after=3)
    await second.admin(http, fail="stall_stream", cut_after=3)
    proxy = await start_proxy()  # --continue-limit 1, the default
    await make_routable(core, proxy, first)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream_through(http, proxy, "chat", request_body("chat", 30), tokens))
    await until_tokens(tokens, 3)
    await make_routable(core, proxy, second)
    await make_routable(core, proxy, third)  # routable, but the one continuation allowed is spent
    await first.kill()
    await until_tokens(tokens, 6)
    await second.kill()
    seen = await reading
    assert seen.done == 0 and len(seen.errors) == 1 and "second" in seen.errors[0]["message"]
    assert "(not continued: --continue-limit 1 reached)" in seen.errors[0]["message"]
    assert len(seen.text("chat").split()) == 6
    finished = await finished_events(tap, 2)
    assert [d["outcome"] for _, d in finished] == ["continued", "upstream_error"]


@pytest.mark.parametrize("extra, why", [
    ({"seed": 7}, "seed given"),
    ({"logprobs": True}, "logprobs requested"),
    ({"response_format": {"type": "json_object"}}, "structured output"),
])
async def test_not_continuable_requests_get_the_error_event(
        extra: dict[str, Any], why: str, engine_processes: StartEngine, core: CoreDriver,
        start_proxy: StartProxy, http: aiohttp.ClientSession, tap: EventTap) -> None:
    await not_continued(engine_processes, core, await start_proxy(), http, tap, extra, why)


async def test_continue_limit_0_restores_the_error_event(engine_processes: StartEngine, core: CoreDriver,
                                                         start_proxy: StartProxy, http: aiohttp.ClientSession,
                                                         tap: EventTap) -> None:
    await not_continued(engine_processes, core, await start_proxy(continue_limit=0), http, tap, {},
                        "--continue-limit is 0")


async def not_continued(engine_processes: StartEngine, core: CoreDriver, proxy: RunningProxy,
                        http: aiohttp.ClientSession, tap: EventTap, extra: dict[str, Any], why: str) -> None:
    doomed, bystander = await engine_processes("doomed"), await engine_processes("bystander")
    await doomed.admin(http, fail="stall_stream", cut_after=4)
    await make_routable(core, proxy, doomed)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream_through(http, proxy, "chat", request_body("chat", 30, **extra), tokens))
    await until_tokens(tokens, 4)
    await make_routable(core, proxy, bystander)  # a node to continue on is there, and is not used
    await doomed.kill()
    seen = await reading
    assert seen.done == 0 and len(seen.errors) == 1
    assert "doomed failed mid-stream" in seen.errors[0]["message"] and why in seen.errors[0]["message"]
    assert len(seen.text("chat").split()) == 4
    [(subject, finished)] = await finished_events(tap, 1)
    assert subject == sj.req_finished("doomed") and finished["outcome"] == "upstream_error"
    assert finished.get("next_attempt") is None


async def test_an_engine_refusing_the_continuation_options_ends_the_stream_with_the_error(
        engine_processes: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession, tap: EventTap) -> None:
    """Like an engine whose chat API has no continue_final_message: a 400 ends the stream."""
    from aiohttp import web

    received: list[dict[str, Any]] = []

    async def refuse(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"error": {"message": "unknown field continue_final_message"}}, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    refuser = EngineProcess("refuser", None, f"http://127.0.0.1:{runner.addresses[0][1]}")  # type: ignore[arg-type]
    doomed = await engine_processes("doomed")
    try:
        await doomed.admin(http, fail="stall_stream", cut_after=3)
        proxy = await start_proxy()
        await make_routable(core, proxy, doomed)
        tokens: asyncio.Queue[int] = asyncio.Queue()
        reading = asyncio.create_task(stream_through(http, proxy, "chat", request_body("chat", 20), tokens))
        await until_tokens(tokens, 3)
        await make_routable(core, proxy, refuser)
        await doomed.kill()
        seen = await reading
    finally:
        await runner.cleanup()
    assert [r["continue_final_message"] for r in received] == [True]
    assert received[0]["add_generation_prompt"] is False and received[0]["max_tokens"] == 17
    assert received[0]["messages"][-1]["role"] == "assistant"
    assert len(received[0]["messages"][-1]["content"].split()) == 3
    assert seen.done == 0 and len(seen.errors) == 1 and "HTTP 400" in seen.errors[0]["message"]
    finished = await finished_events(tap, 2)
    assert [(s, d["outcome"]) for s, d in finished] == [(sj.req_finished("doomed"), "continued"),
                                                        (sj.req_finished("refuser"), "upstream_error")]
