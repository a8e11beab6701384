"""Proxy replicas on one bus share one load view: two real proxies, the real scheduler
service, real engines. A node loaded through proxy A is seen as loaded by proxy B, whose picks
avoid it; on its own counts alone B would send it every other request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from proxy_support import StartProxy, wait_for
from laswrr.schemas import subjects as sj
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

CHAT = "/v1/chat/completions"


async def test_a_node_loaded_through_one_proxy_is_avoided_by_another(
        engines, nc: Any, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    js = nc.jetstream()
    service = SchedulerService(nc, SchedulerOptions(tick_ms=100, replica_id="sched-test", checkpoint_every=0))
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    streams: list[aiohttp.ClientResponse] = []
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        a, b = await engines("a"), await engines("b")
        await js.publish(sj.admin_node("a"), json.dumps({"url": a.url, "capacity": 4}).encode())
        proxy_a = await start_proxy(proxy_id="proxy-a")
        await wait_for(lambda: "a" in proxy_a.state.router.table.candidates("default"),
                       what="proxy A routes on a")
        body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": 100, "delay": 0.05}}
        streams = [await http.post(proxy_a.url + CHAT, json=body) for _ in range(3)]  # a is the only node yet
        assert [r.headers["x-laswrr-node"] for r in streams] == ["a"] * 3
        # b joins (the pool is young: it starts active at full weight, as a does)
        await js.publish(sj.admin_node("b"), json.dumps({"url": b.url, "capacity": 4}).encode())
        proxy_b = await start_proxy(proxy_id="proxy-b")

        def b_sees_a_loaded() -> bool:
            route = proxy_b.state.router.table.route("default")
            if route is None or set(route.first.targets) != {"a", "b"}:
                return False
            views = {v.node: v for v in route.snapshot.nodes}
            return views["a"].inflight == 3 and views["a"].effective_weight == views["b"].effective_weight

        await wait_for(b_sees_a_loaded, timeout=10, what="proxy B's snapshot shows a's three streams")
        served = []
        for _ in range(4):  # one at a time: B's own count is 0 at every pick
            async with http.post(proxy_b.url + CHAT, json={"model": "m", "messages": [],
                                                           "test": {"chunks": 1}}) as response:
                assert response.status == 200
                served.append(response.headers["x-laswrr-node"])
        # pool-wide, a carries 3 and b 0: B sends b everything (on own counts, a and b would alternate)
        assert served == ["b"] * 4
    finally:
        for response in streams:
            response.close()
        stop.set()
        await asyncio.wait_for(runner, 10)
