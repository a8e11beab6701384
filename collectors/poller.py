"""The collector's polling engine: per-node loops, per-host npu-smi loops, counters, publishing.

Theory of operation
-------------------
* One asyncio task per node: every ``interval_s`` it scrapes ``/metrics`` and probes health
  CONCURRENTLY, each bounded by ``timeout_s``, then publishes. Nodes never wait for each
  other, so a slow or dead node delays only its own samples (its loop skips the ticks it
  overran and counts them as ``late_ticks``).
* The node set can change while running: ``update(node_id, node)`` restarts or stops one
  node's loop (the collector follows ``lb.admin.node`` / ``lb.admin.remove``,
  collectors/registrations.py); npu-smi hosts come from the start-up list only.
* One task per DISTINCT ``npu_smi`` command line (one host): every ``npu_interval_s`` it runs
  the command (subprocess, timeout, killed on expiry), parses the table and publishes each
  node's selected chips.
* Published (producer ``ts_ns`` = this host's wall clock when the answer arrived):
  ``lb.metrics.engine.<node>`` EngineSampled (histogram deltas against this node's previous
  good scrape), ``lb.health.<node>`` HealthProbed (an unreachable node or a non-2xx health
  answer is ``ok: false`` with the error, never a crash), ``lb.metrics.npu.<node>`` NpuSampled.
* A scrape that is not an engine exposition (garbage, HTML, cut before the gauges) publishes
  nothing and is counted; so are HTTP errors, timeouts, npu-smi failures and publish errors.
  Warnings are rate-limited per (node, problem); totals are logged every ``stats_interval_s``
  and in a summary at shutdown, and served as Prometheus text on ``metrics_port`` (``Stats.render``).
* Publishing uses JetStream publish with ``stream=LB_EVENTS``: samples are inputs of the
  deterministic log, and the stream's ack is the proof that one landed there; a missing stream
  or an unavailable server becomes a counted, logged publish error instead of a silent loss
  (core publish would also be captured by the stream, but loss would go unnoticed). Each
  node's loop awaits only its own acks, so this costs no other node any time. No retries: the
  next sample supersedes a lost one.
* ``Collector.run(stop)`` returns once ``stop`` is set: loops stop, running scrapes are
  cancelled, npu-smi children killed. The process shell is ``services/collector.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from laswrr.collectors.engine import probe_health, scrape_metrics
from laswrr.collectors.errors import ParseError
from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import NpuSmiError, run_npu_smi, select_chips, split_command
from laswrr.collectors.prometheus import EngineMetrics, engine_sample
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.events import Event, NpuSampled

log = logging.getLogger("laswrr.collector")
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Settings:
    interval_s: float = 0.5
    timeout_s: float = 1.0
    npu_interval_s: float = 2.0
    npu_timeout_s: float = 5.0
    publish_timeout_s: float = 2.0
    stats_interval_s: float = 60.0
    warn_every_s: float = 30.0
    metrics_port: int | None = None
    connect_timeout_s: float = 10.0


# --------------------------------------------------------------------------- counters and logs


_HELP = {
    "scrapes": "engine /metrics scrapes by outcome (ok, truncated, garbage, http_error, timeout, unreachable)",
    "health_probes": "health probes by result",
    "npu_smi_runs": "npu-smi command runs by outcome",
    "npu_missing": "npu-smi runs whose table lacked the chips of this node",
    "published": "samples published to LB_EVENTS by kind",
    "publish_errors": "samples that could not be published by kind",
    "late_ticks": "polling ticks skipped because the previous round overran its interval",
}


class Stats:
    """Counters by (metric, labels); rendered as Prometheus text and as a log summary."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, Labels]] = Counter()

    def inc(self, metric: str, **labels: str) -> None:
        self.counts[(metric, tuple(sorted(labels.items())))] += 1

    def total(self, metric: str, **match: str) -> int:
        want = set(match.items())
        return sum(n for (m, labels), n in self.counts.items() if m == metric and want <= set(labels))

    def by(self, metric: str, label: str) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (m, labels), n in self.counts.items():
            if m == metric:
                out[dict(labels).get(label, "")] += n
        return dict(sorted(out.items()))

    def collect(self) -> Iterator[Metric]:  # prometheus_client custom-collector protocol
        for metric, help_text in _HELP.items():
            series = sorted((labels, n) for (m, labels), n in self.counts.items() if m == metric)
            names = [k for k, _ in series[0][0]] if series else []
            family = CounterMetricFamily(f"laswrr_collector_{metric}", help_text, labels=names)
            for labels, n in series:
                family.add_metric([v for _, v in labels], n)
            yield family

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # type: ignore[arg-type]
        return generate_latest(registry)

    def summary(self) -> str:
        parts = [f"{metric} {self.by(metric, label)}" for metric, label in (
            ("scrapes", "outcome"), ("health_probes", "result"), ("npu_smi_runs", "outcome"),
            ("published", "kind"), ("publish_errors", "kind"), ("late_ticks", "loop"), ("npu_missing", "node"))
            if self.total(metric)]
        return "; ".join(parts) or "nothing collected"


@dataclass
class _Warned:
    at: float
    suppressed: int = 0


@dataclass
class RateLimitedLog:
    """At most one warning per key every ``every_s``; says how many were suppressed."""

    every_s: float
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, _Warned] = field(default_factory=dict)

    def warning(self, key: str, message: str) -> None:
        now, entry = self.clock(), self._last.get(key)
        if entry is not None and now - entry.at < self.every_s:
            entry.suppressed += 1
            return
        extra = f" ({entry.suppressed} more since the last report)" if entry and entry.suppressed else ""
        log.warning("%s%s", message, extra)
        self._last[key] = _Warned(at=now)

    def resolved(self, key: str, message: str) -> None:
        """Log recovery once if a warning for ``key`` was given."""
        if self._last.pop(key, None) is not None:
            log.info("%s", message)


# --------------------------------------------------------------------------- the collector


@dataclass(frozen=True)
class NpuHost:
    """One distinct npu-smi command line and the nodes whose chips it prints."""

    command: str
    argv: tuple[str, ...]
    nodes: tuple[Node, ...]


def npu_hosts(nodes: Iterable[Node]) -> list[NpuHost]:
    grouped: dict[str, list[Node]] = {}
    for node in nodes:
        if node.npu_smi is not None:
            grouped.setdefault(node.npu_smi, []).append(node)
    return [NpuHost(cmd, tuple(split_command(cmd)), tuple(members)) for cmd, members in grouped.items()]


class Collector:
    """Polls ``nodes`` and publishes their samples through ``js`` until ``stop`` is set."""

    def __init__(self, nodes: list[Node], js: JetStreamContext, settings: Settings,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.js, self.settings, self.clock_ns = js, settings, clock_ns
        self.nodes: dict[str, Node] = {node.id: node for node in nodes}  # polled now
        self.stats = Stats()
        self.warn = RateLimitedLog(settings.warn_every_s)
        self._prev: dict[str, EngineMetrics] = {}
        self._engine_kind: dict[str, str] = {}
        self._start_nodes = list(nodes)  # npu-smi hosts come from the start-up list only
        self._node_tasks: dict[str, asyncio.Task[None]] = {}
        self._running: tuple[aiohttp.ClientSession, asyncio.Event] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._running = session, stop
            hosts = npu_hosts(self._start_nodes)
            nodes = list(self.nodes.values())
            for i, node in enumerate(nodes):
                self._start_node(node, i / len(nodes))
            tasks = [asyncio.create_task(self._npu_loop(host, stop, i / len(hosts)), name=f"npu-{i}")
                     for i, host in enumerate(hosts)]
            tasks.append(asyncio.create_task(self._stats_loop(stop), name="stats"))
            try:
                await stop.wait()
            finally:
                self._running = None
                tasks += self._node_tasks.values()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def update(self, node_id: str, node: Node | None) -> None:
        """Poll ``node`` from now on (replacing how ``node_id`` was polled), or stop polling
        ``node_id`` (``node`` None): the node set followed at runtime (collectors/registrations.py)."""
        task = self._node_tasks.pop(node_id, None)
        if task is not None:
            task.cancel()
        self._prev.pop(node_id, None)  # histogram deltas start again from the next scrape
        if node is None:
            self.nodes.pop(node_id, None)
            return
        self.nodes[node_id] = node
        if self._running is not None:
            self._start_node(node, 0.0)

    def _start_node(self, node: Node, phase: float) -> None:
        assert self._running is not None
        session, stop = self._running
        self._node_tasks[node.id] = asyncio.create_task(self._node_loop(node, session, stop, phase),
                                                        name=f"node-{node.id}")

    # -- pacing ---------------------------------------------------------------------------

    # Loops start staggered (``phase`` = fraction of a period): N nodes, or N simulated hosts'
    # npu-smi processes, spread their work over the period instead of all waking at once.

    def _ticks(self, period_s: float, stop: asyncio.Event, late_key: str, phase: float = 0.0) -> "AsyncTicks":
        return AsyncTicks(period_s, stop, lambda: self.stats.inc("late_ticks", loop=late_key), phase * period_s)

    async def _node_loop(self, node: Node, session: aiohttp.ClientSession, stop: asyncio.Event,
                         phase: float) -> None:
        async for _ in self._ticks(self.settings.interval_s, stop, node.id, phase):
            await asyncio.gather(self._engine_once(node, session), self._health_once(node, session))

    async def _npu_loop(self, host: NpuHost, stop: asyncio.Event, phase: float) -> None:
        async for _ in self._ticks(self.settings.npu_interval_s, stop, f"npu-smi {host.command}", phase):
            await self._npu_once(host)

    async def _stats_loop(self, stop: asyncio.Event) -> None:
        async for _ in self._ticks(self.settings.stats_interval_s, stop, "stats"):
            if self.stats.counts:
                log.info("collector totals: %s", self.stats.summary())

    # -- one round ------------------------------------------------------------------------

    async def _engine_once(self, node: Node, session: aiohttp.ClientSession) -> None:
        scrape = await scrape_metrics(session, node.metrics_url, self.settings.timeout_s, node.engine)
        ts_ns = self.clock_ns()
        key = f"{node.id}:metrics"
        if scrape.metrics is None:
            self.stats.inc("scrapes", node=node.id, outcome=scrape.outcome)
            self.warn.warning(key, f"node {node.id}: scrape {node.metrics_url} failed: {scrape.error}")
            return
        try:
            sample = engine_sample(self._prev.get(node.id), scrape.metrics, ts_ns=ts_ns)
        except ParseError as exc:
            self.stats.inc("scrapes", node=node.id, outcome="garbage")
            self.warn.warning(key, f"node {node.id}: scrape {node.metrics_url} failed: {exc}")
            return
        self.stats.inc("scrapes", node=node.id, outcome="truncated" if scrape.metrics.truncated else "ok")
        self.warn.resolved(key, f"node {node.id}: metrics scrape ok again")
        self._note_engine(node, scrape.metrics.engine)
        self._prev[node.id] = scrape.metrics
        await self._publish("engine", sj.metrics_engine(node.id), sample)

    def _note_engine(self, node: Node, kind: str) -> None:
        if self._engine_kind.get(node.id) != kind:
            log.info("node %s: %s metrics at %s", node.id, kind, node.metrics_url)
            self._engine_kind[node.id] = kind

    async def _health_once(self, node: Node, session: aiohttp.ClientSession) -> None:
        probe = await probe_health(session, node.health_url, self.settings.timeout_s, self.clock_ns)
        self.stats.inc("health_probes", node=node.id, result="ok" if probe.ok else "fail")
        key = f"{node.id}:health"
        if probe.ok:
            self.warn.resolved(key, f"node {node.id}: health ok again")
        else:
            self.warn.warning(key, f"node {node.id}: health probe {node.health_url} failed: {probe.error}")
        await self._publish("health", sj.health(node.id), probe)

    async def _npu_once(self, host: NpuHost) -> None:
        key = f"npu-smi:{host.command}"
        try:
            chips = await run_npu_smi(host.argv, self.settings.npu_timeout_s)
        except NpuSmiError as exc:
            self.stats.inc("npu_smi_runs", command=host.command, outcome=exc.kind)
            self.warn.warning(key, f"npu-smi {host.command!r}: {exc}")
            return
        ts_ns = self.clock_ns()
        self.stats.inc("npu_smi_runs", command=host.command, outcome="ok")
        self.warn.resolved(key, f"npu-smi {host.command!r}: ok again")
        publishes = []
        for node in host.nodes:
            if node.id not in self.nodes:  # removed at runtime
                continue
            mine = select_chips(chips, node.selector)
            missing = node.selector.missing(chips)
            if missing or not mine:
                self.stats.inc("npu_missing", node=node.id)
                what = ", ".join(missing) or "any chip"
                self.warn.warning(f"{node.id}:npu", f"node {node.id}: npu-smi {host.command!r} lists no {what}")
            if mine:
                publishes.append(self._publish("npu", sj.metrics_npu(node.id), NpuSampled(chips=mine, ts_ns=ts_ns)))
        await asyncio.gather(*publishes)

    async def _publish(self, kind: str, subject: str, event: Event) -> None:
        try:
            await self.js.publish(subject, encode(event), timeout=self.settings.publish_timeout_s,
                                  stream=sj.EVENTS_STREAM)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any NATS failure is counted, never fatal
            self.stats.inc("publish_errors", kind=kind)
            self.warn.warning(f"publish:{kind}", f"cannot publish {subject}: {type(exc).__name__}: {exc}")
            return
        self.stats.inc("published", kind=kind)


class AsyncTicks:
    """``async for`` over ticks every ``period_s`` (monotonic schedule) until ``stop`` is set.

    The first tick comes after ``offset_s``. A round that overruns its period skips the ticks
    it missed (calling ``on_late`` for each) instead of bursting to catch up.
    """

    def __init__(self, period_s: float, stop: asyncio.Event, on_late: Callable[[], None],
                 offset_s: float = 0.0) -> None:
        self.period_s, self.stop, self.on_late, self.offset_s = period_s, stop, on_late, offset_s
        self._next: float | None = None

    def __aiter__(self) -> "AsyncTicks":
        return self

    async def __anext__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.time() + self.offset_s
        else:
            self._next += self.period_s
            while self._next < loop.time():
                self._next += self.period_s
                self.on_late()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), max(0.0, self._next - loop.time()))
        if self.stop.is_set():
            raise StopAsyncIteration
