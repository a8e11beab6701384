"""Flow control in a pool whose engines serve different model ids, on real processes (docs/proxy.md,
"Flow control", "Mixed model ids").

The stack (``services.up.Stack``: nats-server, scheduler, recorder, collector, a proxy with
``--flow-control``) routes for two simulated engines in pool ``default``: ``alpha`` serving
``sim-alpha`` with 2 slots and ``beta`` serving ``sim-beta`` with 4. With alpha's two slots taken,
a request for ``sim-alpha`` is held (never a 503, though beta is free and routable) and goes to
alpha when a slot there frees; meanwhile requests for ``sim-beta`` and for the pool's name are
not held behind it (they go to beta at once), and ``/metrics`` shows the held one's band.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.model_listing import nodes_once_models_listed
from tests.sim_stack import simulated_stack

pytestmark = pytest.mark.timeout(240)  # a whole stack, started and stopped, on a shared machine

CHAT = "/v1/chat/completions"


def chat(model: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "hello"}],
            "sim": {"output_tokens": tokens}}


async def ask(session: aiohttp.ClientSession, url: str, model: str, tokens: int,
              headers: dict[str, str] | None = None) -> tuple[int, str | None, float]:
    """(status, node, seconds) of one request, its whole answer read."""
    started = time.monotonic()
    async with session.post(url + CHAT, json=chat(model, tokens), headers=headers or {}) as response:
        await response.read()
        return response.status, response.headers.get("x-laswrr-node"), time.monotonic() - started


async def queue_depth(session: aiohttp.ClientSession, url: str, band: str) -> float:
    async with session.get(url + "/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(f'laswrr_proxy_queue_depth{{band="{band}",pool="default"}}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def sim_running(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/sim/state") as response:
        return int((await response.json())["running"])


async def full(session: aiohttp.ClientSession, url: str, slots: int) -> bool:
    return await sim_running(session, url) == slots


async def test_a_model_only_full_nodes_serve_is_held_not_refused(tmp_path: Path,
                                                                 eventually: Callable[..., Awaitable[Any]]) -> None:
    async with simulated_stack(tmp_path / "data", [("alpha", "910B", 2), ("beta", "910B", 4)], speed=1.0,
                               models={"alpha": "sim-alpha", "beta": "sim-beta"}) as stack:
        alpha_url = stack.nodes[0].url
        proxy = await stack.start_proxy(extra_args=("--flow-control",))
        nodes = await nodes_once_models_listed(stack.nats_url)
        assert {n["node"]: (n["models"], n.get("concurrency_limit", 0)) for n in nodes} == {
            "alpha": (["sim-alpha"], 2), "beta": (["sim-beta"], 4)}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            blockers = [asyncio.create_task(ask(session, proxy, "sim-alpha", 400)) for _ in range(2)]
            await eventually(lambda: full(session, alpha_url, 2), what="alpha running both blockers")
            held = asyncio.create_task(ask(session, proxy, "sim-alpha", 4, {"x-laswrr-priority": "interactive"}))

            async def held_now() -> bool:
                assert not held.done(), await held  # answered at once: refused while alpha is full
                return await queue_depth(session, proxy, "interactive") == 1

            await eventually(held_now, what="the sim-alpha request held")
            others = await asyncio.gather(*(ask(session, proxy, model, 4, {"x-laswrr-priority": "interactive"})
                                            for model in ("sim-beta", "sim-beta", "default", "sim-beta")))
            assert [(status, node) for status, node, _ in others] == [(200, "beta")] * 4  # not behind alpha's
            assert not held.done() and not any(b.done() for b in blockers)  # they went while it waits
            status, node, waited = await held
            assert (status, node) == (200, "alpha")
            assert [(s, n) for s, n, _ in await asyncio.gather(*blockers)] == [(200, "alpha")] * 2
            assert waited > max(seconds for _, _, seconds in others)
            assert await queue_depth(session, proxy, "interactive") == 0
