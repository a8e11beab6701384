"""The collector against real HTTP engines (sim-engine, tiny junk apps), a real nats-server, real
npu-smi subprocesses; samples read back from LB_EVENTS and decoded with the wire codec."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from nats.aio.client import Client
from nats.js import JetStreamContext

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector, NpuSmiError, run_npu_smi
from laswrr.collectors.npu_smi import render_info
from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, decode_event, encode
from laswrr.schemas.events import ClockTicked, EngineSampled, Event, HealthProbed, NodeRegistered, NpuChip, NpuSampled
from laswrr.collectors.poller import Collector, Settings
from laswrr.services.nats_server import free_port
from laswrr.services.sim_engine.app import RunningServer
from laswrr.services.up import sim_npu_smi_command
from laswrr.services.sim_engine.config import SimConfig
from laswrr.services.children import exited

# Generous timeouts: engines run in the test's own event loop and CI machines are shared.
# keepalive_s=0: every sample published (the tests count them); test_unchanged_samples_... has the keep-alive
FAST = Settings(interval_s=0.2, timeout_s=1.0, npu_interval_s=0.5, npu_timeout_s=10.0, stats_interval_s=60.0,
                keepalive_s=0.0)
SIM = SimConfig(chip="910B", capacity=4, port=0, speed=1.0)
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- fixtures and helpers


@dataclass(frozen=True)
class Sample:
    seq: int
    subject: str
    node: str
    event: Event
    ts_ns: int  # JetStream time


@pytest.fixture
def sim_config() -> SimConfig:
    return SIM


@pytest.fixture
async def tiny_apps() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def _start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield _start
    for runner in runners:
        await runner.cleanup()


def node(node_id: str, url: str, **extra: object) -> Node:
    return Node(id=node_id, url=url, metrics_url=f"{url}/metrics", health_url=f"{url}/health",
                **extra)  # type: ignore[arg-type]


def sim_npu_smi(url: str) -> str:
    return f"{sys.executable} -m laswrr sim-npu-smi --url {url}"


class Running:
    """A collector task on a real NATS connection, stopped (and awaited) by ``stop()``."""

    def __init__(self, nodes: list[Node], js: JetStreamContext, settings: Settings = FAST) -> None:
        self.collector = Collector(nodes, js, settings)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.collector.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(self._task, 5)


@dataclass
class EventLog:
    """LB_EVENTS read back message by message (cached: each poll fetches only new ones)."""

    js: JetStreamContext
    samples: list[Sample] = field(default_factory=list)
    raw: dict[int, bytes] = field(default_factory=dict)

    async def read(self) -> list[Sample]:
        info = await self.js.stream_info(sj.EVENTS_STREAM)
        start = self.samples[-1].seq + 1 if self.samples else max(1, info.state.first_seq)
        for seq in range(start, info.state.last_seq + 1):
            msg = await self.js.get_msg(sj.EVENTS_STREAM, seq)
            assert msg.subject is not None and msg.data is not None and msg.time is not None
            key, event = decode_event(msg.subject, msg.data)
            self.samples.append(Sample(seq, msg.subject, key or "", event, int(msg.time.timestamp() * 1e9)))
            self.raw[seq] = msg.data
        return list(self.samples)

    async def wait_for(self, check: Callable[[list[Sample]], bool], timeout: float = 15.0) -> list[Sample]:
        deadline = time.monotonic() + timeout
        while True:
            samples = await self.read()
            if check(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s; last events: {samples[-5:]}")
            await asyncio.sleep(0.1)


def of(samples: list[Sample], kind: type[Event], node_id: str) -> list[Event]:
    return [s.event for s in samples if isinstance(s.event, kind) and s.node == node_id]


async def stream_completion(session: aiohttp.ClientSession, url: str, max_tokens: int) -> None:
    body = {"prompt": "hello " * 50, "max_tokens": max_tokens, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for _ in response.content:
            pass


# --------------------------------------------------------------------------- tests


async def test_engine_health_and_npu_samples_land_in_lb_events_and_reflect_load(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]]) -> None:
    busy = await start_engine(chip="910B", capacity=4)  # slow: requests stay in flight
    quick = await start_engine(chip="910C", capacity=8, speed=20.0)  # fast: requests finish -> latency deltas
    js = nc.jetstream()
    running = Running([node("busy", busy.url, npu_smi=sim_npu_smi(busy.url)),
                       node("quick", quick.url, npu_smi=sim_npu_smi(quick.url))], js)
    try:
        idle = await EventLog(js).wait_for(lambda s: bool(of(s, NpuSampled, "busy")) and bool(of(s, EngineSampled, "busy")))
        first = of(idle, EngineSampled, "busy")[0]
        assert isinstance(first, EngineSampled) and (first.running, first.waiting, first.engine) == (0, 0, "vllm")
        assert all(isinstance(h, HealthProbed) and h.ok and h.latency_ms is not None for h in of(idle, HealthProbed, "busy"))
        before = time.time_ns()
        async with aiohttp.ClientSession() as session:
            load = [asyncio.create_task(stream_completion(session, busy.url, 400)) for _ in range(6)]
            load += [asyncio.create_task(stream_completion(session, quick.url, 4)) for _ in range(3)]

            def loaded(s: list[Sample]) -> bool:
                eng = [e for e in of(s, EngineSampled, "busy") if isinstance(e, EngineSampled) and (e.ts_ns or 0) > before]
                npu = [e for e in of(s, NpuSampled, "busy") if isinstance(e, NpuSampled) and (e.ts_ns or 0) > before]
                timed = [e for e in of(s, EngineSampled, "quick") if isinstance(e, EngineSampled) and e.ttft_ms]
                return (any((e.running, e.waiting) == (4, 2) and e.kv_cache_usage > 0 for e in eng)
                        and any((e.chips[0].aicore_util or 0) > 0 for e in npu) and bool(timed))

            samples = await EventLog(js).wait_for(loaded)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    finally:
        await running.stop()
    quick_timed = [e for e in of(samples, EngineSampled, "quick") if isinstance(e, EngineSampled) and e.ttft_ms]
    assert quick_timed[0].e2e_ms is not None and quick_timed[0].e2e_ms >= quick_timed[0].ttft_ms  # type: ignore[operator]
    (chips,) = {tuple(e.chips) for e in of(samples, NpuSampled, "quick")[:1] if isinstance(e, NpuSampled)}
    assert [(c.npu_id, c.chip_id, c.name) for c in chips] == [(0, 0, "Ascend910"), (0, 1, "Ascend910")]  # 910C: 2 dies
    for sample in samples:  # producer time stamped, and close to the stream's own time
        assert sample.event.ts_ns is not None and abs(sample.event.ts_ns - sample.ts_ns) < 2e9  # type: ignore[attr-defined]
    stats = running.collector.stats
    assert stats.total("scrapes", outcome="ok") >= 4 and stats.total("publish_errors") == 0
    assert stats.total("npu_smi_runs", outcome="ok") >= 2


async def test_unreachable_node_and_5xx_health_give_failing_samples_while_others_keep_going(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]],
        tiny_apps: Callable[[web.Application], Awaitable[str]]) -> None:
    good = await start_engine(speed=20.0)
    async def junk(_: web.Request) -> web.Response:
        return web.Response(text="<html>fine, thanks</html>\n")

    async def overloaded(_: web.Request) -> web.Response:
        return web.Response(status=503, text="engine overloaded")

    app = web.Application()
    app.router.add_get("/metrics", junk)
    app.router.add_get("/health", overloaded)
    sick = await tiny_apps(app)
    dead = f"http://127.0.0.1:{free_port()}"
    js = nc.jetstream()
    running = Running([node("good", good.url), node("sick", sick), node("dead", dead)], js)
    samples = await EventLog(js).wait_for(lambda s: len(of(s, HealthProbed, "dead")) >= 3 and len(of(s, HealthProbed, "sick")) >= 3)
    await running.stop()
    for probe in of(samples, HealthProbed, "dead"):
        assert isinstance(probe, HealthProbed) and not probe.ok and probe.error is not None
        assert probe.error.startswith("unreachable:") and probe.latency_ms is None
    for probe in of(samples, HealthProbed, "sick"):
        assert isinstance(probe, HealthProbed) and not probe.ok and probe.error == "HTTP 503: engine overloaded"
        assert probe.latency_ms is not None
    assert len(of(samples, EngineSampled, "good")) >= 3 and all(
        isinstance(p, HealthProbed) and p.ok for p in of(samples, HealthProbed, "good"))
    assert of(samples, EngineSampled, "sick") == [] and of(samples, EngineSampled, "dead") == []
    stats = running.collector.stats
    assert stats.total("scrapes", node="sick", outcome="garbage") >= 3
    assert stats.total("scrapes", node="dead", outcome="unreachable") >= 3
    assert stats.total("scrapes", node="sick", outcome="ok") == 0
    body = stats.render().decode()
    assert 'laswrr_collector_scrapes_total{node="sick",outcome="garbage"}' in body


async def test_a_slow_node_never_delays_the_others(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]],
        tiny_apps: Callable[[web.Application], Awaitable[str]]) -> None:
    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", hang)
    app.router.add_get("/health", hang)
    slow = await tiny_apps(app)
    fast = [await start_engine(speed=20.0) for _ in range(3)]
    js = nc.jetstream()
    settings = replace(FAST, interval_s=0.2, timeout_s=1.0)
    started = time.monotonic()
    running = Running([node("slow", slow)] + [node(f"f{i}", e.url) for i, e in enumerate(fast)], js, settings)
    stats = running.collector.stats
    samples = await EventLog(js).wait_for(  # ~1.6 s of 200 ms ticks, and a second of "slow" timing out
        lambda s: all(len(of(s, EngineSampled, f"f{i}")) >= 8 for i in range(3)) and bool(of(s, HealthProbed, "slow"))
        and stats.total("scrapes", node="slow", outcome="timeout") >= 1 and stats.total("late_ticks", loop="slow") >= 4,
        timeout=30)
    await running.stop()
    elapsed_s = time.monotonic() - started
    for i in range(3):
        stamps = [e.ts_ns for e in of(samples, EngineSampled, f"f{i}") if isinstance(e, EngineSampled)]
        gaps_ms = [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:]) if a and b]
        assert len(stamps) >= 8, stamps
        assert max(gaps_ms) < 700, gaps_ms  # never held up by the 1000 ms timeouts of "slow"
    slow_health = of(samples, HealthProbed, "slow")
    assert len(slow_health) <= elapsed_s / 1.0 + 1, (slow_health, elapsed_s)  # a probe per ~1 s round, not per tick
    assert all(isinstance(h, HealthProbed) and h.error == "timeout after 1000 ms" for h in slow_health)


def _table_command(tmp_path: Path, chips: list[NpuChip]) -> str:
    table = tmp_path / "npu-smi.txt"
    table.write_text(render_info(chips))
    return f"{sys.executable} -c \"import sys; sys.stdout.write(open(sys.argv[1]).read())\" {table}"


async def test_shared_npu_smi_runs_once_per_interval_and_splits_chips(nc: Client, tmp_path: Path,
                                                                      start_engine: Callable[..., Awaitable[RunningServer]]) -> None:
    engine = await start_engine(speed=20.0)
    chips = [NpuChip(npu_id=n, chip_id=c, name="Ascend910", health="OK", aicore_util=0.1 * (n + 1),
                     hbm_used_mb=1000, hbm_total_mb=65536, memory_used_mb=0, memory_total_mb=0)
             for n in range(3) for c in range(2)]
    command = _table_command(tmp_path, chips)
    js = nc.jetstream()
    nodes = [node("left", engine.url, npu_smi=command, selector=ChipSelector(npu_ids=(0, 1))),
             node("right", engine.url, npu_smi=command, selector=ChipSelector(chips=((2, 1),))),
             node("ghost", engine.url, npu_smi=command, selector=ChipSelector(npu_ids=(7,)))]
    running = Running(nodes, js)
    samples = await EventLog(js).wait_for(lambda s: len(of(s, NpuSampled, "right")) >= 2)
    await running.stop()
    left, right = of(samples, NpuSampled, "left")[0], of(samples, NpuSampled, "right")[0]
    assert isinstance(left, NpuSampled) and isinstance(right, NpuSampled)
    assert [(c.npu_id, c.chip_id) for c in left.chips] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c.npu_id, c.chip_id, c.aicore_util) for c in right.chips] == [(2, 1, pytest.approx(0.3))]
    assert of(samples, NpuSampled, "ghost") == []
    stats = running.collector.stats
    runs = stats.total("npu_smi_runs")
    assert runs == stats.total("npu_smi_runs", outcome="ok") and runs >= 2
    assert stats.total("published", kind="npu") == 2 * runs  # one command run feeds both nodes
    assert stats.total("npu_missing", node="ghost") == runs


@pytest.mark.parametrize(("command", "kind"), [
    ([sys.executable, "-c", "import sys; sys.stderr.write('dcmi error -8005'); sys.exit(3)"], "exit_status"),
    ([sys.executable, "-c", "print('Hello, I am not npu-smi')"], "garbage"),
    ([sys.executable, "-c", "import time; time.sleep(30)"], "timeout"),
    (["/nonexistent/npu-smi", "info"], "not_runnable"),
])
async def test_npu_smi_failures_are_typed(command: list[str], kind: str) -> None:
    started = time.monotonic()
    with pytest.raises(NpuSmiError) as caught:
        await run_npu_smi(command, timeout_s=1.0)
    assert caught.value.kind == kind and "\n" not in str(caught.value)
    assert time.monotonic() - started < 3.0
    if kind == "exit_status":
        assert str(caught.value) == "exit status 3: dcmi error -8005"


async def test_a_hanging_npu_smi_wrapper_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """npu-smi behind a wrapper (a shell script, ``ssh host npu-smi``) that hangs: after the
    timeout the wrapper and its child are both gone, and the run is reported as a timeout."""
    pid_file = tmp_path / "child.pid"
    command = ["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"]
    started = time.monotonic()
    with pytest.raises(NpuSmiError) as caught:
        await run_npu_smi(command, timeout_s=0.5)
    assert caught.value.kind == "timeout" and time.monotonic() - started < 3.0
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while not exited(child):
        assert time.monotonic() < deadline, "the wrapper's child outlived the timeout"
        await asyncio.sleep(0.02)


async def test_failing_npu_smi_is_counted_and_engine_samples_continue(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]],
        eventually: Callable[..., Awaitable[Any]]) -> None:
    engine = await start_engine(speed=20.0)
    js = nc.jetstream()
    failing = f"{sys.executable} -c 'import sys; sys.stderr.write(\"dcmi error\"); sys.exit(3)'"
    running = Running([node("n", engine.url, npu_smi=failing)], js, replace(FAST, npu_interval_s=0.2))
    stats = running.collector.stats
    await eventually(lambda: stats.total("npu_smi_runs") >= 2, timeout=15, what="two npu-smi runs")
    engine_before = stats.total("published", kind="engine")
    await eventually(lambda: stats.total("published", kind="engine") >= engine_before + 2, timeout=15,
                     what="two more engine samples")
    await running.stop()
    assert stats.total("npu_smi_runs", outcome="exit_status") == stats.total("npu_smi_runs") >= 2
    assert stats.total("published", kind="engine") >= engine_before + 2  # the engine loop kept going
    assert of(await EventLog(js).read(), NpuSampled, "n") == []


async def test_unchanged_samples_wait_for_the_keepalive_and_say_how_long_they_stand(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]], eventually: Any) -> None:
    """An idle engine: its samples and passed probes say the same each round, so after the first
    one only a keep-alive goes out (a passed probe's every 60 s); each engine sample stands for the
    keep-alive and two rounds."""
    engine = await start_engine(speed=20.0)
    js = nc.jetstream()
    running = Running([node("n", engine.url)], js, replace(FAST, keepalive_s=1.5, idle_interval_s=0.0))
    stats = running.collector.stats
    await eventually(lambda: stats.total("scrapes") >= 20, timeout=30, what="20 rounds of 0.2 s: >= 4 s")
    await running.stop()
    rounds = stats.total("scrapes")
    samples = await EventLog(js).read()
    engine_samples, probes = of(samples, EngineSampled, "n"), of(samples, HealthProbed, "n")
    assert rounds >= 20
    # one per keep-alive (rounds x 0.2 s / 1.5 s, plus the first), never one per round
    assert 2 <= len(engine_samples) <= rounds * 0.2 / 1.5 + 2 < rounds / 2, (len(engine_samples), rounds)
    assert len(probes) == 1 and stats.total("unchanged", kind="health") == rounds - 1, (len(probes), rounds)
    assert stats.total("unchanged", kind="engine") == rounds - len(engine_samples)
    assert {e.max_age_ms for e in engine_samples if isinstance(e, EngineSampled)} == {1500 + 400}


async def test_an_idle_node_is_polled_every_idle_interval(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]], eventually: Any) -> None:
    engine = await start_engine(speed=20.0)
    running = Running([node("n", engine.url)], nc.jetstream(), replace(FAST, keepalive_s=10.0, idle_interval_s=1.0))
    stats = running.collector.stats
    await eventually(lambda: stats.total("unchanged", kind="engine") >= 1, timeout=30, what="an unchanged sample")
    before, started = stats.total("scrapes"), time.monotonic()  # idle from here
    await asyncio.sleep(3.0)  # a window of idle rounds: the behaviour under test is timed
    scrapes, elapsed = stats.total("scrapes") - before, time.monotonic() - started
    await running.stop()
    assert 1 <= scrapes <= elapsed / 1.0 + 1 < elapsed / 0.2 / 2, (scrapes, elapsed)  # not one per 0.2 s


async def test_an_idle_node_backs_off_and_polls_at_its_interval_again_from_its_first_change(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]], eventually: Any) -> None:
    """Unchanged rounds double the step to the idle interval (0.2, 0.4, 0.8, 1.6, 2 s); the
    first round that sees the engine busy (its running count changed) goes back to 0.2 s."""
    engine = await start_engine(capacity=4)  # speed 1: a request stays in flight for seconds
    running = Running([node("n", engine.url)], nc.jetstream(), replace(FAST, keepalive_s=10.0, idle_interval_s=2.0))
    stats = running.collector.stats
    ticks = await eventually(lambda: running.collector._node_ticks.get("n"), what="the node's loop")
    await eventually(lambda: ticks.step_s == 2.0, timeout=20, what="the backoff to the idle interval")
    before, started = stats.total("scrapes"), time.monotonic()
    await asyncio.sleep(4.5)  # a window of idle rounds: the behaviour under test is timed
    idle_scrapes, idle_s = stats.total("scrapes") - before, time.monotonic() - started
    async with aiohttp.ClientSession() as session:
        load = asyncio.create_task(stream_completion(session, engine.url, 2000))
        changed = time.monotonic()
        await eventually(lambda: ticks.step_s == 0.2, timeout=10, what="the normal interval at the first change")
        back_after_s = time.monotonic() - changed
        before, started = stats.total("scrapes"), time.monotonic()
        await asyncio.sleep(2.0)  # a window of busy rounds
        busy_scrapes, busy_s = stats.total("scrapes") - before, time.monotonic() - started
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    await running.stop()
    assert idle_scrapes <= idle_s / 2.0 + 1, (idle_scrapes, idle_s)  # one per 2 s, not per 0.2 s
    assert back_after_s <= 2.0 + 1.0, back_after_s  # the next idle round saw the change
    assert busy_scrapes >= busy_s / 0.2 / 2, (busy_scrapes, busy_s)  # every 0.2 s again (half, on a busy machine)


async def test_a_request_in_a_snapshot_polls_an_idle_node_at_once(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]], eventually: Any) -> None:
    """A node backed off to a 30 s idle interval is polled as soon as a snapshot counts a
    request on it (``set_busy``, fed by the LB_WEIGHTS watch), and every interval while it has one;
    its npu-smi host too."""
    engine = await start_engine(speed=20.0)
    nodes = [node("n", engine.url, npu_smi=sim_npu_smi_command(engine.url))]  # curl when installed: quick
    running = Running(nodes, nc.jetstream(), replace(FAST, keepalive_s=60.0, idle_interval_s=30.0))
    collector, stats = running.collector, running.collector.stats
    ticks = await eventually(lambda: collector._node_ticks.get("n"), what="the node's loop")
    npu_ticks = await eventually(lambda: collector._npu_ticks.get(nodes[0].npu_smi or ""), what="the npu-smi loop")
    await eventually(lambda: ticks.step_s >= 3.2 and npu_ticks.step_s >= 2.0, timeout=30, what="a backoff")
    scrapes, npu_runs = stats.total("scrapes"), stats.total("npu_smi_runs")
    collector.set_busy({"n"})
    await eventually(lambda: stats.total("scrapes") >= scrapes + 3, timeout=3,
                     what="polls at the normal interval right after the request")
    await eventually(lambda: stats.total("npu_smi_runs") > npu_runs, timeout=10, what="an npu-smi run right after it")
    assert ticks.step_s == 0.2
    await running.stop()


async def test_samples_reach_the_scheduler_core(nc: Client, start_engine: Callable[..., Awaitable[RunningServer]]) -> None:
    engine = await start_engine(chip="910B", capacity=4)
    js = nc.jetstream()
    await js.publish(sj.admin_node("a"), encode(NodeRegistered(url=engine.url, capacity=4, chip="910B")))
    running = Running([node("a", engine.url, npu_smi=sim_npu_smi(engine.url))], js)
    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(stream_completion(session, engine.url, 400)) for _ in range(3)]

        def busy(s: list[Sample]) -> bool:
            return (any(isinstance(e, EngineSampled) and e.running == 3 for e in of(s, EngineSampled, "a"))
                    and any(isinstance(e, NpuSampled) and (e.chips[0].aicore_util or 0) > 0 for e in of(s, NpuSampled, "a")))

        events = EventLog(js)
        samples = await events.wait_for(busy)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    await running.stop()
    core = Scheduler()
    for sample in samples:
        rejected = [o for o in core.apply(Envelope(sample.seq, sample.ts_ns, sample.subject, events.raw[sample.seq]))
                    if o.subject == sj.OUT_REJECTED]
        assert rejected == []
    last = samples[-1]
    core.apply(Envelope(last.seq + 1, last.ts_ns, sj.CLOCK_TICK, encode(ClockTicked(tick=1))))
    (view,) = core.snapshot("default").nodes
    assert view.node == "a" and not view.load.stale and view.load.sample_age_ms is not None
    assert view.load.kv > 0 and view.load.npu > 0 and view.load.running > 0 and view.load.load > 0
    assert view.target_weight < 4


async def test_cli_runs_publishes_serves_counters_and_stops_on_sigterm(
        nats_url: str, nc: Client, start_engine: Callable[..., Awaitable[RunningServer]], tmp_path: Path) -> None:
    engine = await start_engine(speed=20.0)
    nodes_toml = tmp_path / "nodes.toml"
    nodes_toml.write_text(f'[[node]]\nid = "n1"\nurl = "{engine.url}"\npool = "default"\nchip = "910B"\n'
                          f'capacity = 4\nnpu_smi = "{sim_npu_smi(engine.url)}"\n')
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "collector", "--nats-url", nats_url, "--nodes", str(nodes_toml),
        "--interval-ms", "100", "--npu-interval-ms", "300", "--metrics-port", str(port), "--keepalive-ms", "0",
        cwd=REPO, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        js = nc.jetstream()
        await EventLog(js).wait_for(lambda s: bool(of(s, NpuSampled, "n1")) and len(of(s, EngineSampled, "n1")) >= 3)
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
        assert 'laswrr_collector_scrapes_total{node="n1",outcome="ok"}' in text
        assert 'laswrr_collector_published_total{kind="npu"}' in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert "collector stopped: scrapes {'ok':" in log and "Traceback" not in log


async def test_cli_rejects_a_bad_nodes_file_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "nodes.toml"
    bad.write_text('[[node]]\nid = "n 1"\nurl = "http://x:1"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "collector", "--nats-url", "nats://127.0.0.1:1", "--nodes", str(bad),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 2 and out == b""
    assert err.decode().count("\n") == 1 and "invalid node id 'n 1'" in err.decode()


# --------------------------------------------------------------------------- Ascend sources


ASCEND = REPO / "tests" / "fixtures" / "ascend"


async def test_mindie_status_and_simulated_exporter_of_a_mindie_engine(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]]) -> None:
    """A MindIE-flavoured sim engine: its /v1/status folds free slots and blocks into the engine
    samples (a silent slot loss shows in the next one), its simulated npu-exporter gives the chips,
    and a Critical NPU reaches the samples with its fault code once the exporter refreshes."""
    engine = await start_engine(chip="910C", capacity=6, flavour="mindie", exporter_update_s=1.0, npu_id=3)
    js = nc.jetstream()
    settings = replace(FAST, exporter_interval_s=1.0)
    mindie = node("m1", engine.url, engine="mindie", status_url=f"{engine.url}/v1/status",
                  npu_exporter=f"{engine.url}/sim/npu-exporter", chips_per_npu=2, selector=ChipSelector(npu_ids=(3,)))
    running = Running([mindie], js, settings)
    log = EventLog(js)
    try:
        first = await log.wait_for(lambda s: bool(of(s, NpuSampled, "m1")) and bool(of(s, EngineSampled, "m1")))
        sample = of(first, EngineSampled, "m1")[-1]
        assert isinstance(sample, EngineSampled) and sample.engine == "mindie"
        assert (sample.free_slots, sample.running) == (6, 0) and sample.total_blocks and sample.free_blocks == sample.total_blocks
        npu = of(first, NpuSampled, "m1")[-1]
        assert isinstance(npu, NpuSampled) and [(c.npu_id, c.chip_id, c.health) for c in npu.chips] == \
            [(3, 0, "OK"), (3, 1, "OK")]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{engine.url}/admin", json={"capacity": 2, "health": "Critical"}) as response:
                assert response.status == 200
            changed = time.time_ns()
        def lost(s: list[Sample]) -> bool:
            return any(isinstance(e, EngineSampled) and (e.ts_ns or 0) > changed and e.free_slots == 2
                       for e in of(s, EngineSampled, "m1"))
        samples = await log.wait_for(lost, timeout=5.0)
        slots_at = min(e.ts_ns or 0 for e in of(samples, EngineSampled, "m1")
                       if isinstance(e, EngineSampled) and (e.ts_ns or 0) > changed and e.free_slots == 2)
        assert slots_at - changed < 1.5e9  # the next status poll (0.2 s here), not queue evidence
        def critical(s: list[Sample]) -> bool:
            return any(isinstance(e, NpuSampled) and e.chips[0].health == "Critical" for e in of(s, NpuSampled, "m1"))
        samples = await log.wait_for(critical, timeout=6.0)
    finally:
        await running.stop()
    bad = next(e for e in of(samples, NpuSampled, "m1") if isinstance(e, NpuSampled) and e.chips[0].health == "Critical")
    assert bad.chips[0].fault == "fault 80E18402 SeparateNPU"
    stats = running.collector.stats
    assert stats.total("status_polls", outcome="ok") >= 3 and stats.total("publish_errors") == 0


async def test_one_exporter_scrape_per_host_serves_every_node_on_it_and_status_alone_makes_a_sample(
        nc: Client, tiny_apps: Callable[[web.Application], Awaitable[str]],
        eventually: Callable[..., Awaitable[Any]]) -> None:
    """Two nodes on one npu-exporter (chips by pod labels, one by npu_ids): one scrape per
    exporter interval for both. A MindIE whose /metrics is off (monitor mode) is sampled from
    /v1/status and /metrics-json; a status that is not RoleReady gives no sample."""
    hits = {"exporter": 0}
    template = (ASCEND / "npu-exporter_910B3-8chip_pods_fault.txt").read_text()

    async def exporter(_: web.Request) -> web.Response:
        hits["exporter"] += 1
        return web.Response(text=template.replace(" 1764680000000", f" {int(time.time() * 1000)}"))

    status = {"body": (ASCEND / "mindie-status-v1_single-node.json").read_text()}

    async def v1_status(_: web.Request) -> web.Response:
        return web.Response(text=status["body"], content_type="application/json")

    async def metrics_json(_: web.Request) -> web.Response:
        return web.Response(text=(ASCEND / "mindie-metrics-json.json").read_text(), content_type="application/json")

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", exporter)
    host = await tiny_apps(app)
    engine_app = web.Application()
    engine_app.router.add_get("/v1/status", v1_status)
    engine_app.router.add_get("/metrics-json", metrics_json)
    engine_app.router.add_get("/health", ok)
    engine = await tiny_apps(engine_app)
    js = nc.jetstream()
    settings = replace(FAST, exporter_interval_s=1.0)
    nodes = [node("a", engine, npu_exporter=f"{host}/metrics", pod=("default", "mindie-a-0"),
                  status_url=f"{engine}/v1/status", engine="mindie"),
             node("b", engine, npu_exporter=f"{host}/metrics", pod=("", "mindie-b-0")),
             node("six", engine, npu_exporter=f"{host}/metrics", selector=ChipSelector(npu_ids=(6,)))]
    running = Running(nodes, js, settings)
    started = time.monotonic()
    log = EventLog(js)
    try:
        samples = await log.wait_for(lambda s: all(len(of(s, NpuSampled, n)) >= 2 for n in ("a", "b", "six"))
                                     and bool(of(s, EngineSampled, "a")))
        elapsed = time.monotonic() - started
        assert hits["exporter"] <= elapsed / 1.0 + 1  # one scrape per interval, for all three nodes
        status["body"] = (ASCEND / "mindie-status-v1_switching_flex.json").read_text()
        stats = running.collector.stats
        await eventually(lambda: stats.total("status_polls", outcome="not_ready") >= 1, what="a not-ready status")
        switched = len(of(await log.read(), EngineSampled, "a"))
        polled = stats.total("status_polls", outcome="not_ready")
        await eventually(lambda: stats.total("status_polls", outcome="not_ready") >= polled + 2,
                         what="two more not-ready polls")  # rounds in which no sample may go out
        after = len(of(await log.read(), EngineSampled, "a"))
    finally:
        await running.stop()
    chips = {n: [(c.npu_id, c.health) for c in e.chips] for n in ("a", "b", "six")
             for e in of(samples, NpuSampled, n)[-1:] if isinstance(e, NpuSampled)}
    assert chips == {"a": [(0, "OK"), (1, "OK")], "b": [(2, "OK"), (3, "OK")], "six": [(6, "Critical")]}
    sample = of(samples, EngineSampled, "a")[0]
    assert isinstance(sample, EngineSampled)
    assert (sample.running, sample.waiting, sample.free_slots, sample.free_blocks, sample.total_blocks) == \
        (50, 0, 150, 2310, 4096)
    assert sample.kv_cache_usage == round(1 - 2310 / 4096, 6) and sample.ttft_ms == 412.0
    assert after == switched  # not ready: no sample
    stats = running.collector.stats
    assert stats.total("status_polls", outcome="not_ready") >= 1 and stats.total("scrapes", outcome="http_error") >= 1


async def test_model_ids_are_published_when_they_change_and_a_bad_listing_publishes_nothing(
        nc: Client, start_engine: Callable[..., Awaitable[RunningServer]],
        tiny_apps: Callable[[web.Application], Awaitable[str]], eventually: Callable[..., Awaitable[Any]]) -> None:
    from laswrr.schemas.events import ModelsListed

    sim = await start_engine(chip="910B", capacity=4)
    served = ["base-model"]

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in served]})

    async def junk(request: web.Request) -> web.Response:
        return web.Response(text="<html>not a model list</html>")

    changing, broken = web.Application(), web.Application()
    changing.router.add_get("/v1/models", models)
    broken.router.add_get("/v1/models", junk)
    changing_url, broken_url = await tiny_apps(changing), await tiny_apps(broken)
    js = nc.jetstream()
    settings = replace(FAST, models_interval_s=0.2, models_refresh_s=60.0)
    running = Running([node("sim", sim.url), node("lora", changing_url + "/v1"), node("junk", broken_url)], js, settings)
    try:
        log = EventLog(js)
        await log.wait_for(lambda s: bool(of(s, ModelsListed, "sim")) and bool(of(s, ModelsListed, "lora")))
        stats = running.collector.stats

        async def listings(node_id: str, more: int) -> None:
            """``more`` listings of ``node_id`` after now (each unchanged publishes nothing)."""
            now = stats.total("model_listings", node=node_id, outcome="ok")
            await eventually(lambda: stats.total("model_listings", node=node_id, outcome="ok") >= now + more,
                             what=f"{more} more listings of {node_id}")

        await listings("lora", 5)  # five more listings each: unchanged, so nothing more is published
        served.append("lora-adapter-1")
        await log.wait_for(lambda s: len(of(s, ModelsListed, "lora")) == 2)
        await listings("lora", 3)  # and the new list, listed again, not published again
        await listings("sim", 5)
        samples = await log.read()
    finally:
        await running.stop()
    assert [e.models for e in of(samples, ModelsListed, "sim")] == [["sim-910B"]]  # type: ignore[attr-defined]
    assert [e.models for e in of(samples, ModelsListed, "lora")] == [  # type: ignore[attr-defined]
        ["base-model"], ["base-model", "lora-adapter-1"]]  # the node URL's /v1 taken once
    assert of(samples, ModelsListed, "junk") == []
    stats = running.collector.stats
    assert stats.total("model_listings", node="junk", outcome="garbage") >= 3
    assert stats.total("model_listings", node="sim", outcome="ok") >= 5


async def test_exporter_samples_carry_their_refresh_and_the_core_believes_them_until_the_next(
        nats_url: str, nc: Client, tiny_apps: Callable[[web.Application], Awaitable[str]], tmp_path: Path) -> None:
    """The real `laswrr collector` process, at its default 5 s exporter interval, scraping a real
    HTTP server that serves the npu-exporter fixture as the exporter's cache does (the cache time
    refreshed every 5 s): each sample says it stands for 10 s (two refreshes), and the core, fed
    the samples as recorded (JetStream times) with 100 ms ticks between, keeps the node's npu
    signal at the chips' utilisation through every gap, where without the field (a log recorded
    before it) the signal drifts toward unknown after 3 s of each gap."""
    template = (ASCEND / "npu-exporter_910B3-8chip_pods_fault.txt").read_text()

    async def exporter(_: web.Request) -> web.Response:
        cached_ms = int(time.time() // 5 * 5 * 1000)  # the exporter's cache, refreshed every 5 s
        return web.Response(text=template.replace(" 1764680000000", f" {cached_ms}"))

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", exporter)
    app.router.add_get("/health", ok)
    host = await tiny_apps(app)
    nodes_toml = tmp_path / "nodes.toml"
    nodes_toml.write_text(f'[[node]]\nid = "a"\nurl = "{host}"\npool = "default"\nchip = "910B3"\ncapacity = 10\n'
                          f'npu_exporter = "{host}/metrics"\npod = "default/mindie-a-0"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "collector", "--nats-url", nats_url, "--nodes", str(nodes_toml),
        "--keepalive-ms", "0",  # every refresh published (the fixture's chips do not change)
        cwd=REPO, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        log = EventLog(nc.jetstream())
        samples = await log.wait_for(lambda s: len(of(s, NpuSampled, "a")) >= 3, timeout=30.0)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    npu = [s for s in samples if isinstance(s.event, NpuSampled) and s.node == "a"][:3]
    assert [s.event.max_age_ms for s in npu] == [10_000] * 3  # type: ignore[attr-defined]
    gaps = [(b.ts_ns - a.ts_ns) / 1e9 for a, b in zip(npu, npu[1:])]
    assert all(4.0 < gap < 6.5 for gap in gaps), gaps  # one scrape per exporter refresh

    def npu_signal(strip: bool) -> list[float]:
        core = Scheduler()
        seq = 1
        core.apply(Envelope(seq, npu[0].ts_ns - 1, sj.admin_node("a"),
                            encode(NodeRegistered(url=host, capacity=10, chip="910B3"))))
        signal_at: list[float] = []
        tick = 0
        for sample, until in zip(npu, [s.ts_ns for s in npu[1:]] + [npu[-1].ts_ns + 5 * 10**9]):
            raw = log.raw[sample.seq]
            if strip:
                raw = encode(msgspec.structs.replace(sample.event, max_age_ms=None))  # type: ignore[type-var]
            seq += 1
            assert [o.subject for o in core.apply(Envelope(seq, sample.ts_ns, sample.subject, raw))
                    if o.subject == sj.OUT_REJECTED] == []
            at = sample.ts_ns
            while (at := at + 100_000_000) < until:
                seq, tick = seq + 1, tick + 1
                core.apply(Envelope(seq, at, sj.CLOCK_TICK, encode(ClockTicked(tick=tick))))
                (view,) = core.snapshot("default").nodes
                signal_at.append(view.load.npu)
        return signal_at

    believed, drifting = npu_signal(strip=False), npu_signal(strip=True)
    assert set(believed) == {0.405}  # chips 0 and 1 of pod default/mindie-a-0: 41 % and 40 %
    assert min(drifting) == 0.405 and max(drifting) > 0.405 + 0.02  # toward unknown (0.5) in every gap
