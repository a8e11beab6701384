"""Start and stop the real stack for one benchmark run (one policy of one scenario).

Every part is a real child process: the embedded nats-server (``services.natsbus.EmbeddedNats``),
``laswrr sim-engine`` per node (``--speed`` of the scenario, ``--node-id`` = node), ``laswrr
scheduler`` (with the scenario's ``--config`` file if any), ``laswrr recorder`` (when the command
exists) writing ``<run_dir>/data/events.duckdb``, ``laswrr collector`` polling every engine, and
one ``laswrr proxy --policy P``. Nodes are registered by publishing ``lb.admin.node.<id>``, exactly
as an operator would. Logs go to ``<run_dir>/logs/<service>.log``.

No npu-smi sampling in benchmarks: the simulated npu-smi is a Python process per call, and four
of them every two seconds would take a large share of this 2-core machine from the system under
test. Engine metrics (running, waiting, KV use, TTFT) and health are collected as usual.

Stop order: proxy (in-flight finish, events flushed), collector, scheduler, recorder (after the
last events are recorded), engines, NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bench.scenarios import Scenario
from services.natsbus import EmbeddedNats

log = logging.getLogger("laswrr.bench.stack")

START_TIMEOUT_S = 30.0
# SIGTERM, then SIGKILL after this long (the proxy lets in-flight requests finish: none are left
# when the load is over; the recorder flushes its last batch).
STOP_TIMEOUT_S = {"proxy": 30.0, "recorder": 30.0}
DEFAULT_STOP_TIMEOUT_S = 5.0


@dataclass
class RunningStack:
    nats: EmbeddedNats
    proxy_url: str
    engine_urls: dict[str, str]
    db_path: Path | None
    processes: list[tuple[str, asyncio.subprocess.Process]] = field(default_factory=list)

    @property
    def nats_url(self) -> str:
        return self.nats.url


def _laswrr(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def command_exists(name: str) -> bool:
    from services.cli import COMMAND_MODULES

    import importlib
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for module in COMMAND_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(module).register(sub)
    return name in sub.choices


async def _spawn(name: str, argv: list[str], logs: Path, read_url_prefix: str | None = None
                 ) -> tuple[asyncio.subprocess.Process, str | None]:
    log = (logs / f"{name}.log").open("ab")
    env = os.environ.copy()
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE if read_url_prefix else log, stderr=log, env=env,
        start_new_session=True)
    log.close()
    if read_url_prefix is None:
        return proc, None
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        raise RuntimeError(f"{name} printed nothing within {START_TIMEOUT_S:.0f}s (see {logs / name}.log)") from None
    text = line.decode().strip()
    if not text.startswith(read_url_prefix):
        raise RuntimeError(f"{name} did not start: {text or 'no output'} (see {logs / name}.log)")
    return proc, text[len(read_url_prefix):]


def nodes_toml(scenario: Scenario, urls: dict[str, str]) -> str:
    blocks = []
    for e in scenario.engines:
        blocks.append(f'[[node]]\nid = "{e.node}"\nurl = "{urls[e.node]}"\npool = "default"\n'
                      f'chip = "{e.chip}"\ncapacity = {e.capacity}\n')
    return "\n".join(blocks)


async def _register(nats_url: str, scenario: Scenario, urls: dict[str, str]) -> None:
    import nats

    nc = await nats.connect(nats_url, name="laswrr-bench-register")
    try:
        js = nc.jetstream()
        for e in scenario.engines:
            payload = {"url": urls[e.node], "pool": "default", "chip": e.chip, "capacity": e.capacity}
            await js.publish(f"lb.admin.node.{e.node}", msgspec.json.encode(payload))
    finally:
        await nc.drain()


async def _wait_streams(nats_url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """The scheduler creates the streams at start-up; publish only once they exist."""
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(nats_url, name="laswrr-bench-wait")
    try:
        js = nc.jetstream()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                await js.stream_info("LB_EVENTS")
                return
            except NotFoundError:
                if loop.time() > deadline:
                    raise RuntimeError("stream LB_EVENTS never appeared (scheduler not starting?)") from None
                await asyncio.sleep(0.1)
    finally:
        await nc.drain()


async def start(scenario: Scenario, policy: str, run_dir: Path, config_path: Path | None) -> RunningStack:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    nats_server = await asyncio.to_thread(EmbeddedNats(data / "nats").start)
    stack = RunningStack(nats_server, "", {}, None)
    try:
        await _start_services(stack, scenario, policy, run_dir, config_path)
    except BaseException:
        await stop(stack)
        raise
    return stack


async def _start_services(stack: RunningStack, scenario: Scenario, policy: str, run_dir: Path,
                          config_path: Path | None) -> None:
    logs, data, url = run_dir / "logs", run_dir / "data", stack.nats.url
    engines = await asyncio.gather(*(
        _spawn(f"engine-{e.node}", _laswrr("sim-engine", "--port", "0", "--chip", e.chip, "--capacity",
                                           str(e.capacity), "--speed", str(scenario.speed), "--node-id", e.node),
               logs, "sim-engine listening on ")
        for e in scenario.engines))
    for e, (proc, engine_url) in zip(scenario.engines, engines):
        stack.processes.append((f"engine-{e.node}", proc))
        stack.engine_urls[e.node] = str(engine_url)
    if command_exists("recorder"):
        proc, _ = await _spawn("recorder", _laswrr("recorder", "--nats-url", url, "--data-dir", str(data)), logs)
        stack.processes.append(("recorder", proc))
        stack.db_path = data / "events.duckdb"
    sched_args = ["scheduler", "--nats-url", url] + (["--config", str(config_path)] if config_path else [])
    proc, _ = await _spawn("scheduler", _laswrr(*sched_args), logs)
    stack.processes.append(("scheduler", proc))
    await _wait_streams(url)
    await _register(url, scenario, stack.engine_urls)
    nodes_file = run_dir / "nodes.toml"
    nodes_file.write_text(nodes_toml(scenario, stack.engine_urls))
    proc, _ = await _spawn("collector", _laswrr("collector", "--nats-url", url, "--nodes", str(nodes_file)), logs)
    stack.processes.append(("collector", proc))
    proc, proxy_url = await _spawn("proxy", _laswrr("proxy", "--nats-url", url, "--port", "0", "--host", "127.0.0.1",
                                                    "--policy", policy, "--proxy-id", f"bench-{policy}"),
                                   logs, "proxy listening on ")
    stack.processes.append(("proxy", proc))
    stack.proxy_url = str(proxy_url)


STOP_ORDER = ("proxy", "collector", "scheduler", "recorder")


async def _terminate(proc: asyncio.subprocess.Process, name: str = "") -> None:
    if proc.returncode is not None:
        return
    t = asyncio.get_running_loop().time()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S.get(name, DEFAULT_STOP_TIMEOUT_S))
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("%s ignored SIGTERM: killed", name)
    log.info("stopped %s in %.2fs (exit %s)", name, asyncio.get_running_loop().time() - t, proc.returncode)


async def stop(stack: RunningStack) -> None:
    by_name = dict(stack.processes)
    for name in STOP_ORDER:
        if name in by_name:
            await _terminate(by_name.pop(name), name)
    await asyncio.gather(*(_terminate(p, n) for n, p in by_name.items()))
    await asyncio.to_thread(stack.nats.stop)
