"""The collector follows what the scheduler applied: a real ``laswrr scheduler``, ``laswrr collector``
and ``laswrr sim-engine`` (child processes) on a real nats-server; a node registered at runtime
with ``laswrr register`` gets engine and health samples within two collector intervals, a removed
one gets none, and one the scheduler rejected is never probed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from laswrr.schemas import subjects as sj
from laswrr.services.children import ChildProcesses

INTERVAL_MS = 500  # the collector's default


@pytest.fixture
async def children(tmp_path: Path, nats_url: str) -> AsyncIterator[ChildProcesses]:
    """The scheduler (only 127.0.0.1 engines allowed) already running; a test adds the rest."""
    processes = ChildProcesses(tmp_path / "logs")
    await processes.spawn("scheduler", "scheduler", "--nats-url", nats_url, "--allow-upstream", "127.0.0.1",
                          role="scheduler")
    yield processes
    await processes.stop(("collector", "sim-engine", "scheduler"))


async def stream_times(nc: Client, subject: str) -> list[float]:
    """JetStream time (s) of every message on ``subject`` so far."""
    js = nc.jetstream()
    info = await js.stream_info(sj.EVENTS_STREAM)
    times = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        msg = await js.get_msg(sj.EVENTS_STREAM, seq)
        if msg.subject == subject and msg.time is not None:
            times.append(msg.time.timestamp())
    return times


async def first_after(nc: Client, subject: str, after: float, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        later = [t for t in await stream_times(nc, subject) if t >= after]
        if later:
            return later[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {subject} within {timeout_s} s")


def register(nats_url: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "laswrr", "register", *args, "--nats-url", nats_url, "--wait", "10"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode in (0, 1) and done.stdout.startswith(("applied: ", "rejected: ")), done.stderr
    return done.stdout


async def test_a_node_registered_at_runtime_is_polled_and_a_removed_one_is_not(
        nats_url: str, nc: Client, children: ChildProcesses, tmp_path: Path,
        eventually: Callable[..., Awaitable[Any]]) -> None:
    engine = await children.spawn("n5", "sim-engine", "--port", "0", "--chip", "910B", "--capacity", "4",
                                  "--node-id", "n5", role="sim-engine", wait_listening=True)
    empty = tmp_path / "nodes.toml"
    empty.write_text("# no start-up nodes: everything comes from registrations\n")
    await children.spawn("collector", "collector", "--nats-url", nats_url, "--nodes", str(empty),
                         "--interval-ms", str(INTERVAL_MS), role="collector")
    collector_log = tmp_path / "logs" / "collector.log"
    await eventually(lambda: collector_log.exists() and "collecting 0 node(s)" in collector_log.read_text(),
                     what="the collector following registrations")  # it logs that once subscribed
    assert await stream_times(nc, sj.metrics_engine("n5")) == []

    assert engine.url is not None
    out = await asyncio.to_thread(register, nats_url, "n5", "--url", engine.url, "--capacity", "4", "--engine", "vllm")
    assert out.startswith("applied: "), out
    (registered,) = await stream_times(nc, sj.admin_node("n5"))
    engine_at = await first_after(nc, sj.metrics_engine("n5"), registered)
    health_at = await first_after(nc, sj.health("n5"), registered)
    interval_s = INTERVAL_MS / 1000
    assert engine_at - registered <= 2 * interval_s, (engine_at - registered)
    assert health_at - registered <= 2 * interval_s, (health_at - registered)

    async def count(subject: str) -> int:
        return len(await stream_times(nc, subject))

    async def probe_after(probes: int) -> bool:
        return await count(sj.health("n5")) > probes

    probes = await count(sj.health("n5"))
    await asyncio.to_thread(register, nats_url, "n5", "--url", engine.url, "--capacity", "4",
                            "--metrics-url", "http://127.0.0.1:1/metrics")  # moved metrics: scrapes fail
    await eventually(lambda: "polling http://127.0.0.1:1/metrics" in collector_log.read_text(),
                     what="the collector following the new registration")
    # the new registration's first round: its probe goes out again (and after what the old loop sent)
    await eventually(lambda: probe_after(probes), what="a probe of the new registration")
    before = await count(sj.metrics_engine("n5"))
    await asyncio.sleep(3 * interval_s)  # a window of some rounds in which no sample may come
    assert await count(sj.metrics_engine("n5")) == before  # nothing parsed from port 1

    subprocess.run([sys.executable, "-m", "laswrr", "remove", "n5", "--nats-url", nats_url, "--wait", "10"],
                   capture_output=True, timeout=30)
    await eventually(lambda: "node n5 removed: polling stopped" in collector_log.read_text(),
                     what="the collector following the removal")
    health = await count(sj.health("n5"))
    await asyncio.sleep(4 * interval_s)  # a window of some rounds in which no probe may come
    assert await count(sj.health("n5")) == health  # polling stopped
    assert "node n5 registered: polling" in collector_log.read_text()


async def test_a_collector_started_after_registration_polls_the_registered_node(
        nats_url: str, nc: Client, children: ChildProcesses, tmp_path: Path) -> None:
    engine = await children.spawn("n6", "sim-engine", "--port", "0", "--chip", "910", "--capacity", "2",
                                  "--node-id", "n6", role="sim-engine", wait_listening=True)
    assert engine.url is not None
    await asyncio.to_thread(register, nats_url, "n6", "--url", engine.url, "--capacity", "2")
    await asyncio.to_thread(register, nats_url, "n7", "--url", "http://127.0.0.1:1", "--capacity", "2")
    subprocess.run([sys.executable, "-m", "laswrr", "remove", "n7", "--nats-url", nats_url, "--wait", "10"],
                   capture_output=True, timeout=30)
    empty = tmp_path / "nodes.toml"
    empty.write_text("")
    started = time.time()
    await children.spawn("collector", "collector", "--nats-url", nats_url, "--nodes", str(empty), role="collector")
    await first_after(nc, sj.metrics_engine("n6"), started)
    await asyncio.sleep(1.0)  # from the proof it polls: a window of rounds in which n7 would be probed
    assert await stream_times(nc, sj.health("n7")) == []  # removed before the collector started


async def test_a_registration_the_scheduler_rejected_is_never_polled(
        nats_url: str, nc: Client, children: ChildProcesses, tmp_path: Path) -> None:
    """The allow-list refuses 10.255.0.9: before, the collector probed it every interval anyway,
    each probe one more lb.health rejection, until the node was removed (and `remove` then said
    "unknown node")."""
    empty = tmp_path / "nodes.toml"
    empty.write_text("")
    await children.spawn("collector", "collector", "--nats-url", nats_url, "--nodes", str(empty),
                         "--interval-ms", str(INTERVAL_MS), role="collector")
    engine = await children.spawn("n9", "sim-engine", "--port", "0", "--chip", "910B", "--capacity", "2",
                                  "--node-id", "n9", role="sim-engine", wait_listening=True)
    assert engine.url is not None
    out = await asyncio.to_thread(register, nats_url, "n8", "--url", "http://10.255.0.9:8000", "--capacity", "4")
    assert out.startswith("rejected: ") and "10.255.0.9" in out, out
    out = await asyncio.to_thread(register, nats_url, "n9", "--url", engine.url, "--capacity", "2")
    assert out.startswith("applied: "), out
    (registered,) = await stream_times(nc, sj.admin_node("n9"))
    await first_after(nc, sj.health("n9"), registered)  # the applied one is polled
    await asyncio.sleep(4 * INTERVAL_MS / 1000)  # from there: a window of rounds in which n8 would be probed
    assert await stream_times(nc, sj.health("n8")) == []
    assert await stream_times(nc, sj.metrics_engine("n8")) == []
    log = (tmp_path / "logs" / "collector.log").read_text()
    assert "node n9 registered: polling" in log and "node n8" not in log
