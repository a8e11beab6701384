"""The proxy with the real scheduler service: events in, in-flight counted, a drain completes
only when the proxy's streams have finished, and never cuts them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from proxy_support import StartProxy, wait_for
from laswrr.schemas import subjects as sj
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

CHAT = "/v1/chat/completions"


async def test_drain_through_the_scheduler_service(engines, nc: Any, start_proxy: StartProxy,
                                                   http: aiohttp.ClientSession) -> None:
    js = nc.jetstream()
    service = SchedulerService(nc, SchedulerOptions(tick_ms=100, replica_id="sched-test", checkpoint_every=0))
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    phases: list[tuple[str, str]] = []

    async def on_phase(msg: Any) -> None:
        data = json.loads(msg.data)
        phases.append((data["node"], data["to"]))

    sub = await nc.subscribe(sj.OUT_PHASE + ".>", cb=on_phase)
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        a, b = await engines("a"), await engines("b")
        for node, engine in (("a", a), ("b", b)):
            await js.publish(sj.admin_node(node), json.dumps({"url": engine.url, "capacity": 4}).encode())
        proxy = await start_proxy(policy="rr")
        await wait_for(lambda: len(proxy.state.router.table.candidates("default")) == 2, what="both nodes routable")

        body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": 15, "delay": 0.05}}
        responses = [await http.post(proxy.url + CHAT, json=body) for _ in range(4)]
        await wait_for(lambda: service.scheduler.state.nodes["a"].inflight == 2, what="scheduler counts a's streams")
        await js.publish(sj.admin_drain("a"), b"{}")
        await wait_for(lambda: ("a", "draining") in phases, what="a draining")
        await wait_for(lambda: "a" not in proxy.state.router.table.route("default").first.targets, what="proxy sees the drain")
        assert ("a", "drained") not in phases  # two streams still run on a

        async with http.post(proxy.url + CHAT, json=dict(body, test={"chunks": 1})) as late:
            assert late.headers["x-laswrr-node"] == "b"
        for resp in responses:
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        await wait_for(lambda: ("a", "drained") in phases, what="a drained once its streams finished")
        assert service.scheduler.state.nodes["a"].inflight == 0
        assert len(a.received) == 2
    finally:
        await sub.unsubscribe()
        stop.set()
        await asyncio.wait_for(runner, 10)
