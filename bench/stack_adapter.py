"""Start and stop the real stack for one benchmark run (one policy of one scenario).

Uses ``services.up.Stack`` piece by piece, so every part is a real child process: the embedded
nats-server, ``laswrr scheduler`` (with the scenario's ``--config`` file, if any), ``laswrr
recorder`` writing ``<run_dir>/data/events.duckdb``, one ``laswrr sim-engine`` per node (the
scenario's chips, capacities and ``--speed``; ``--node-id`` = node), registration by publishing
``lb.admin.node.<id>`` (as an operator would), ``laswrr collector`` polling every engine, and one
``laswrr proxy --policy P`` on a free port. Logs: ``<run_dir>/data/logs/<name>.log``.

No npu-smi sampling in benchmarks: the simulated npu-smi is a Python process per call, and four
of them every two seconds would take a large share of this 2-core machine from the system under
test (the NPU signal's weight in the load is 0.05). Engine metrics (running, waiting, KV use,
TTFT) and health probes are collected as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from bench.scenarios import Scenario
from services.up import Stack

log = logging.getLogger("laswrr.bench.stack")


@dataclass
class RunningStack:
    stack: Stack
    proxy_url: str
    engine_urls: dict[str, str]
    db_path: Path

    @property
    def nats_url(self) -> str:
        return self.stack.nats_url


async def start(scenario: Scenario, policy: str, run_dir: Path, config_path: Path | None) -> RunningStack:
    data_dir = run_dir / "data"
    stack = Stack(data_dir, proxy_port=0, config=str(config_path) if config_path else None)
    try:
        await stack.start_nats()
        await stack.start_core()
        sims = [(e.node, e.chip, e.capacity) for e in scenario.engines]
        nodes = [replace(spec, extra={}) for spec in await stack.start_sim_engines(sims, speed=scenario.speed)]
        await stack.register(nodes)
        stack.write_nodes_file(nodes)
        await stack.start_collector()
        proxy_url = await stack.start_proxy(port=0, extra_args=("--policy", policy), name="proxy")
    except BaseException:
        await stack.stop()
        raise
    return RunningStack(stack, proxy_url, {n.id: n.url for n in nodes}, stack.data_dir / "events.duckdb")


async def stop(running: RunningStack) -> None:
    await running.stack.stop()
