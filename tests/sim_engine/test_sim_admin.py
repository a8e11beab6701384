"""Admin-injected faults and run-time knobs of the sim-engine, over real HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from laswrr.services.sim_engine.app import RunningServer

StartEngine = Callable[..., Awaitable[RunningServer]]
MakeClient = Callable[[RunningServer], openai.AsyncOpenAI]


async def admin(http: aiohttp.ClientSession, server: RunningServer, **changes: Any) -> dict[str, Any]:
    async with http.post(f"{server.url}/admin", json=changes) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def state(http: aiohttp.ClientSession, server: RunningServer) -> dict[str, Any]:
    async with http.get(f"{server.url}/sim/state") as r:
        return await r.json()


async def wait_state(http: aiohttp.ClientSession, server: RunningServer, pred: Callable[[dict[str, Any]], bool],
                     timeout: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = await state(http, server)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"state never matched: {st}")
        await asyncio.sleep(0.02)


def completion(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens, "stream": stream}


async def test_get_admin_reports_state(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{engine.url}/admin") as r:
        st = await r.json()
    assert st | {"speed": 0} == {"node_id": "node-a", "chip": "910B", "model": "sim-910B", "capacity": 4,
                                 "slowdown": 1.0, "speed": 0, "fail": "none", "health": "OK", "cut_after": 2, "fault_code": ""}


async def test_http500_fault_and_health(make_client: MakeClient, engine: RunningServer, http: aiohttp.ClientSession) -> None:
    await admin(http, engine, fail="http500")
    async with http.post(f"{engine.url}/v1/completions", json=completion(3)) as r:
        assert r.status == 500
        assert (await r.json())["error"]["code"] == "sim_http500"
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 503
    oai = make_client(engine)
    with pytest.raises(openai.InternalServerError):
        await oai.completions.create(model="sim-910B", prompt="x", max_tokens=2)
    await admin(http, engine, fail="none")
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 200


async def test_cut_stream_ends_without_done_and_frees_slot(make_client: MakeClient, engine: RunningServer,
                                                           http: aiohttp.ClientSession) -> None:
    await admin(http, engine, fail="cut_stream", cut_after=3)
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{engine.url}/v1/completions", json=completion(50, stream=True)) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
    assert got.count(b"data: ") == 3 and b"[DONE]" not in got
    await wait_state(http, engine, lambda s: s["running"] == 0)
    oai = make_client(engine)
    with pytest.raises(openai.APIConnectionError):  # non-streamed: connection dropped, no body
        await oai.completions.create(model="sim-910B", prompt="x", max_tokens=10)
    await admin(http, engine, fail="none")
    resp = await oai.completions.create(model="sim-910B", prompt="x", max_tokens=10)
    assert resp.usage is not None and resp.usage.completion_tokens == 10


async def test_refuse_drops_connections_but_admin_works(engine: RunningServer,
                                                        http: aiohttp.ClientSession) -> None:
    await admin(http, engine, fail="refuse")
    for path in ("/health", "/metrics"):
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(engine.url + path) as r:
                await r.read()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.post(f"{engine.url}/v1/completions", json=completion(2)) as r:
            await r.read()
    st = await state(http, engine)
    assert st["engine_up"] is False and st["npu"]["hbm_used_mb"] < 5000  # HBM back to the idle floor
    await admin(http, engine, fail="none")
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 200


async def test_capacity_change_at_run_time(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    assert (await admin(http, engine, capacity=1))["capacity"] == 1
    tasks = [asyncio.create_task(http.post(f"{engine.url}/v1/completions", json=completion(30)))
             for _ in range(3)]
    st = await wait_state(http, engine, lambda s: s["running"] + s["waiting"] == 3)
    assert (st["running"], st["waiting"], st["capacity"]) == (1, 2, 1)
    await admin(http, engine, capacity=3)
    await wait_state(http, engine, lambda s: s["running"] == 2 or s["running"] == 3)
    for resp in await asyncio.gather(*tasks):
        assert resp.status == 200
        resp.release()


async def test_capacity_cut_lets_running_requests_finish(make_client: MakeClient, engine: RunningServer,
                                                         http: aiohttp.ClientSession) -> None:
    oai = make_client(engine)
    tasks = [asyncio.create_task(oai.completions.create(model="sim-910B", prompt="x", max_tokens=40))
             for _ in range(4)]
    await wait_state(http, engine, lambda s: s["running"] == 4)
    await admin(http, engine, capacity=1)
    results = await asyncio.gather(*tasks)
    assert all(r.usage is not None and r.usage.completion_tokens == 40 for r in results)


async def test_client_disconnect_frees_the_slot(start_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    server = await start_engine(capacity=1)
    r = await http.post(f"{server.url}/v1/completions", json=completion(100_000, stream=True))
    await r.content.readuntil(b"\n\n")
    queued = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=completion(5)))
    await wait_state(http, server, lambda s: (s["running"], s["waiting"]) == (1, 1))
    r.close()  # drop the connection mid-stream
    done = await asyncio.wait_for(queued, 3.0)
    assert done.status == 200
    done.release()
    st = await wait_state(http, server, lambda s: s["running"] == 0 and s["waiting"] == 0)
    assert st["kv_tokens_used"] == 0


async def test_waiting_client_disconnect_leaves_queue(start_engine: StartEngine,
                                                      http: aiohttp.ClientSession) -> None:
    server = await start_engine(capacity=1)
    hog = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=completion(100_000)))
    waiter = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=completion(5)))
    await wait_state(http, server, lambda s: (s["running"], s["waiting"]) == (1, 1))
    waiter.cancel()
    await wait_state(http, server, lambda s: s["waiting"] == 0)
    hog.cancel()
    await wait_state(http, server, lambda s: s["running"] == 0)
    await asyncio.gather(hog, waiter, return_exceptions=True)


async def test_slowdown_multiplies_step_times(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    async def timed() -> float:
        t0 = time.monotonic()
        async with http.post(f"{engine.url}/v1/completions", json=completion(40)) as r:
            await r.read()
        return time.monotonic() - t0

    base = await timed()
    await admin(http, engine, slowdown=4.0)
    assert await timed() > 2.0 * base


async def test_health_state_reaches_health_endpoint(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    await admin(http, engine, health="Warning")
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 200
    await admin(http, engine, health="Critical")
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 503
    assert (await state(http, engine))["health"] == "Critical"
