"""Test helper: an in-process ``Stack`` (services/up.py) on simulated engines, up to the collector.

``async with simulated_stack(data_dir, sims, speed=S) as stack:`` starts what every end-to-end
test on simulated engines starts from, in the order ``laswrr up`` does: 127.0.0.1 allowed as an
upstream, NATS, the core (scheduler and recorder), one ``laswrr sim-engine`` per ``(node id, chip,
capacity)`` (``models``: node id -> the model it serves; default the simulator's), their nodes
file, the nodes registered (their weights published) and the collector sampling them. The test
starts what it needs on top (a proxy, the dashboard); the stack is stopped on leaving the block.
``stack_options`` go to ``Stack``; its proxy port is 0 (a free one), never a fixed one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from laswrr.services.up import SIM_MODEL, SimSpec, Stack


@contextlib.asynccontextmanager
async def simulated_stack(data_dir: Path, sims: Sequence[SimSpec], *, speed: float, npu_smi: bool = False,
                          models: Mapping[str, str] | None = None, **stack_options: Any) -> AsyncIterator[Stack]:
    stack = Stack(data_dir, proxy_port=0, **stack_options)
    try:
        stack.allow_hosts([], sims=True)
        await stack.start_nats()
        await stack.start_core()
        started = await asyncio.gather(*(
            stack.start_sim_engines([sim], speed=speed, npu_smi=npu_smi, model=(models or {}).get(sim[0], SIM_MODEL))
            for sim in sims))
        nodes = [node for group in started for node in group]
        stack.write_nodes_file(nodes)
        await stack.register(nodes)
        await stack.start_collector()
        yield stack
    finally:
        await stack.stop()
