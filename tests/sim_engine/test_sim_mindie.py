"""The sim engine's Ascend faces over real HTTP: MindIE's status and /metrics-json from its own
slots and blocks, MindIE's metric names, and the simulated npu-exporter's cache and fault codes,
each read back with the collector's own parsers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from laswrr.collectors.mindie import parse_metrics_json, parse_status
from laswrr.collectors.npu_exporter import parse_exporter
from laswrr.collectors.prometheus import parse_engine_metrics
from laswrr.services.sim_engine.app import RunningServer

StartEngine = Callable[..., Awaitable[RunningServer]]


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as response:
        return response.status, await response.text()


async def _admin(http: aiohttp.ClientSession, server: RunningServer, **changes: Any) -> int:
    async with http.post(f"{server.url}/admin", json=changes) as response:
        return response.status


async def test_mindie_status_follows_the_engines_own_slots_and_blocks(
        start_engine: StartEngine, http: aiohttp.ClientSession, eventually: Callable[..., Awaitable[Any]]) -> None:
    server = await start_engine(flavour="mindie", capacity=4, speed=1.0, kv_tokens=16_000)
    status = parse_status((await _get(http, f"{server.url}/v1/status"))[1])
    assert (status.avail_slots, status.running, status.total_npu_blocks, status.free_npu_blocks) == (4, 0, 1000, 1000)

    async def one() -> None:
        async with http.post(f"{server.url}/v1/completions", json={"prompt": "x " * 100, "max_tokens": 200}) as r:
            await r.read()

    load = [asyncio.create_task(one()) for _ in range(3)]

    async def three_running() -> Any:
        status = parse_status((await _get(http, f"{server.url}/v1/status"))[1])
        return status if status.running == 3 else None

    busy = await eventually(three_running, what="the three requests running")
    assert busy.running == 3 and busy.avail_slots == 1 and busy.free_npu_blocks is not None
    assert busy.free_npu_blocks < 1000 and busy.avail_blocks == busy.free_npu_blocks
    assert await _admin(http, server, capacity=1) == 200  # silent: only the engine knows
    lost = parse_status((await _get(http, f"{server.url}/v1/status"))[1])
    assert lost.avail_slots == 0  # 3 still running on 1 slot: no free slot at once
    v2 = parse_status((await _get(http, f"{server.url}/v2/status"))[1])
    assert v2.max_avail_blocks == v2.avail_blocks
    metrics = parse_engine_metrics((await _get(http, f"{server.url}/metrics"))[1])
    assert metrics.engine == "mindie" and metrics.running == 3
    for task in load:
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    assert parse_metrics_json((await _get(http, f"{server.url}/metrics-json"))[1]).remain_blocks is not None


async def test_a_vllm_engine_has_no_status_but_has_an_exporter(engine: RunningServer,
                                                               http: aiohttp.ClientSession) -> None:
    assert (await _get(http, f"{engine.url}/v1/status"))[0] == 404
    scrape = parse_exporter((await _get(http, f"{engine.url}/sim/npu-exporter"))[1])
    assert [(c.id, c.pod_name, c.health_status, c.error_codes) for c in scrape.chips] == [(0, "node-a", 1, ())]


async def test_exporter_serves_its_cache_until_the_refresh(start_engine: StartEngine,
                                                           http: aiohttp.ClientSession) -> None:
    server = await start_engine(exporter_update_s=1.0, chip="910C", npu_id=2)
    first = parse_exporter((await _get(http, f"{server.url}/sim/npu-exporter"))[1])
    assert [c.id for c in first.chips] == [4, 5]  # two dies per A3 NPU
    assert await _admin(http, server, fault_code="80E18402") == 200
    cached = parse_exporter((await _get(http, f"{server.url}/sim/npu-exporter"))[1])
    assert cached.chips[0].error_codes == () and cached.chips[0].sampled_s == first.chips[0].sampled_s
    await asyncio.sleep(1.05)  # the cache outlives its 1 s update time: the refresh is time-based
    fresh = parse_exporter((await _get(http, f"{server.url}/sim/npu-exporter"))[1])
    assert fresh.chips[0].error_codes == (0x80E18402,) and fresh.chips[0].health_status == 1
    assert (await _get(http, f"{server.url}/health"))[0] == 200  # only the exporter knows
    assert await _admin(http, server, fault_code="zz") == 400
