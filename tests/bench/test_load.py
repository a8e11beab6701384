"""The load generator against a real simulated engine over HTTP (no proxy needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from laswrr.bench.load import run_load
from laswrr.bench.workload import RequestSpec
from laswrr.services.sim_engine.app import start_server
from laswrr.services.sim_engine.config import SimConfig


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free loopback port, its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()

FAST = SimConfig(chip="910B", capacity=4, port=0, speed=20.0, node_id="node-a")


async def test_outcomes_completed_cancelled_and_timings() -> None:
    server = await start_server(FAST)
    try:
        workload = [RequestSpec(0, 0.0, 50, 20, None), RequestSpec(1, 0.05, 50, 400, 0.2),
                    RequestSpec(2, 0.1, 50, 10, None)]
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        run = await run_load(server.url, workload, loop.time(), on_done=lambda r: seen.append(r.index))
    finally:
        await server.close()
    done, cancelled, short = run.results
    assert [r.outcome for r in run.results] == ["completed", "client_cancelled", "completed"]
    assert sorted(seen) == [0, 1, 2]
    assert done.node == "node-a" and done.tokens >= 20 and done.status == 200
    assert done.ttft_s is not None and done.e2e_s is not None and 0 < done.ttft_s < done.e2e_s
    assert 0.2 <= cancelled.end_s - cancelled.start_s < 0.5 and cancelled.e2e_s is None
    assert short.start_s >= 0.1  # open loop: sent at its offset


async def test_cut_stream_is_interrupted_and_refusal_is_error() -> None:
    server = await start_server(FAST)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/admin", json={"fail": "cut_stream", "cut_after": 3}) as r:
                assert r.status == 200
            loop = asyncio.get_running_loop()
            cut = await run_load(server.url, [RequestSpec(0, 0.0, 10, 50, None)], loop.time())
            async with http.post(f"{server.url}/admin", json={"fail": "http500"}) as r:
                assert r.status == 200
            failed = await run_load(server.url, [RequestSpec(0, 0.0, 10, 50, None)], loop.time())
    finally:
        await server.close()
    assert cut.results[0].outcome == "interrupted" and cut.results[0].ttft_s is not None
    assert failed.results[0].outcome == "error" and failed.results[0].status == 500
    assert "fail=http500" in failed.results[0].error


async def test_an_error_event_after_the_first_token_is_an_interruption() -> None:
    """What a proxy without continuation sends when an engine dies mid-stream: a cut the client sees."""

    async def cut_with_error(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if request.match_info.get("after") == "token":
            await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi "}}]}\n\n')
        await response.write(b'data: {"error": {"message": "upstream node n4 failed mid-stream", "code": 502}}\n\n')
        return response

    app = web.Application()
    app.router.add_post("/{after}/v1/chat/completions", cut_with_error)
    app.router.add_post("/v1/chat/completions", cut_with_error)
    async with serving(app) as base:
        loop = asyncio.get_running_loop()
        before = await run_load(base, [RequestSpec(0, 0.0, 10, 5, None)], loop.time())
        after = await run_load(f"{base}/token", [RequestSpec(0, 0.0, 10, 5, None)], loop.time())
    assert before.results[0].outcome == "error"
    assert after.results[0].outcome == "interrupted" and "mid-stream" in after.results[0].error


async def test_usage_asks_for_the_engines_usage_chunk_and_reads_its_cached_tokens() -> None:
    """With ``usage`` the body asks for vLLM's usage chunk; its cached prompt tokens (and the
    proxy's request id) are recorded, and the chunk is not counted as a token of the answer."""

    bodies: list[dict[str, object]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-laswrr-request-id": "p-7",
                                               "x-laswrr-node": "n1"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi "}}]}\n\n')
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "there"}}]}\n\n')
        if (body.get("stream_options") or {}).get("include_usage"):
            details = ', "prompt_tokens_details": {"cached_tokens": 512}' if request.path == "/v1/chat/completions" \
                else ""
            await response.write(b'data: {"choices": [], "usage": {"prompt_tokens": 700, "completion_tokens": 2'
                                 + details.encode() + b'}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/none/v1/chat/completions", answer)
    async with serving(app) as base:
        loop = asyncio.get_running_loop()
        spec = [RequestSpec(0, 0.0, 10, 5, None)]
        plain = await run_load(base, spec, loop.time())
        usage = await run_load(base, spec, loop.time(), usage=True)
        none_cached = await run_load(base + "/none", spec, loop.time(), usage=True)
    assert "stream_options" not in bodies[0] and bodies[1]["stream_options"] == {"include_usage": True}
    assert plain.results[0].cached_tokens is None and plain.results[0].request_id == "p-7"
    got = usage.results[0]
    assert got.outcome == "completed" and got.tokens == 2 and got.node == "n1"
    assert (got.cached_tokens, got.prompt_tokens, got.request_id) == (512, 700, "p-7")
    # vLLM leaves the details out when it found nothing cached
    assert none_cached.results[0].cached_tokens == 0 and none_cached.results[0].tokens == 2
