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
* Every NPU sample says how long it stands for, ``max_age_ms`` = ``MAX_AGE_PERIODS`` (2) of its
  source's polling periods (npu-smi 2 s -> 4 s, npu-exporter 5 s -> 10 s): the scheduler ages it
  only after that, so a 5 s exporter sample does not drift toward unknown before the next one.
* One task per DISTINCT ``npu_exporter`` URL (one host's MindCluster npu-exporter): every
  ``exporter_interval_s`` (5 s, npu-exporter's own refresh; never below 1 s) it scrapes the
  exporter once for all the nodes on that host and publishes each node's chips (by
  ``npu_ids``/``chips`` through ``chips_per_npu``, or by pod labels), their health set from the
  health gauge and the fault codes (collectors/faultcodes.toml). Exporter hosts follow the node
  set at runtime (a registration may name one). A chip older than three refreshes is missing.
* A node with ``status_url`` (MindIE) has its status polled with each engine scrape; the
  published EngineSampled carries ``free_slots``/``free_blocks``/``total_blocks`` (and, when
  ``/metrics`` cannot be read, is built from the status and ``/metrics-json`` alone). A status
  that is not RoleReady or does not parse leaves those fields out (counted, warned).
* Published (producer ``ts_ns`` = this host's wall clock when the answer arrived):
  ``lb.metrics.engine.<node>`` EngineSampled (histogram deltas against this node's previous
  good scrape), ``lb.health.<node>`` HealthProbed (an unreachable node or a non-2xx health
  answer is ``ok: false`` with the error, never a crash), ``lb.metrics.npu.<node>`` NpuSampled.
* Every ``models_interval_s`` (5 s) per node, ``GET /v1/models`` (the node URL's, by the
  engine transport's ``/v1`` rule): ``lb.metrics.models.<node>`` ModelsListed when the ids
  changed, when the node was (re-)registered, and every ``models_refresh_s`` (60 s) unchanged;
  the proxies route model ids on them (docs/wire.md, "Model ids"). A failed listing
  publishes nothing: the last list stands.
* An engine sample, an NPU sample or a passed health probe that says what the node's last published
  one of its kind said (but for its time, and a probe's latency) is not published again before
  ``keepalive_s`` (10 s; 0: every one is), a passed probe before ``probe_keepalive_s`` (60 s:
  the core does nothing with a passed probe after a passed one, and nothing ages a probe), so an
  idle pool's log does not grow by samples; a failed probe is always published (the scheduler
  counts them). So that the scheduler does not age a sample it is not sent again, each sample's
  ``max_age_ms`` says it stands for the keep-alive plus two of its longest polling periods
  (``stands_for_ms``).
* Idle backoff. A node whose last engine sample and probe were both unchanged, and on which its
  pool's latest weight snapshot counts no request in flight, is idle: each such round doubles
  the time to its next one, up to ``idle_interval_s`` (4 s; 0.5, 1, 2, 4 s), and the first
  round that changes something goes back to ``interval_s``. A snapshot that counts a request on
  an idle node (the collector follows LB_WEIGHTS for the node set already) polls it at once and
  at ``interval_s`` from then on, so traffic starting is seen as fast as before. An npu-smi host
  backs off the same way (``npu_interval_s`` up to ``idle_interval_s``) while every node it
  prints is unchanged and has nothing in flight. An idle 16-node pool costs the collector an
  eighth of the scrapes and half of the npu-smi runs; a model listing is due every
  ``models_interval_s`` but made only in a round, so an idle node's comes every 8 s.
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
import msgspec
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from laswrr.collectors.engine import list_model_ids, models_url, probe_health, scrape_metrics
from laswrr.collectors.errors import ParseError
from laswrr.collectors.exporter import (
    MIN_EXPORTER_INTERVAL_S, Polled, load_fault_table, metrics_json_url, poll_metrics_json, poll_status, scrape_exporter)
from laswrr.collectors.faultcodes import FaultTable
from laswrr.collectors.mindie import MetricsJson, MindieStatus, with_status
from laswrr.collectors.nodes import Node
from laswrr.collectors.npu_exporter import ExporterScrape, select_exporter_chips, to_npu_chip
from laswrr.collectors.npu import NpuSmiError, run_npu_smi, select_chips, split_command
from laswrr.collectors.prometheus import EngineMetrics, engine_sample
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.events import EngineSampled, Event, HealthProbed, ModelsListed, NpuSampled

log = logging.getLogger("laswrr.collector")
Labels = tuple[tuple[str, str], ...]
# An NPU sample stands for this many of its source's polling periods (NpuSampled.max_age_ms): the
# scheduler does not age it before the next one is due, with one period to spare for a slow scrape.
MAX_AGE_PERIODS = 2


def max_age_ms(period_s: float) -> int:
    """``NpuSampled.max_age_ms`` of a source polled every ``period_s``: ``MAX_AGE_PERIODS`` periods."""
    return max(1, round(MAX_AGE_PERIODS * period_s * 1000))


def stands_for_ms(period_s: float, keepalive_s: float) -> int:
    """``max_age_ms`` of a sample polled every ``period_s`` and repeated unchanged every ``keepalive_s``."""
    return max_age_ms(period_s) + round(keepalive_s * 1000)


def sample_content(event: Event) -> bytes:
    """What makes two samples the same: all but the time (and a health probe's latency)."""
    if isinstance(event, HealthProbed):
        return encode(msgspec.structs.replace(event, ts_ns=None, latency_ms=None))
    return encode(msgspec.structs.replace(event, ts_ns=None))  # type: ignore[call-arg]


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
    exporter_interval_s: float = 5.0
    exporter_timeout_s: float = 2.0
    fault_table: FaultTable | None = None  # None: collectors/faultcodes.toml
    models_interval_s: float = 5.0  # GET /v1/models per node (a change is published at once)
    models_refresh_s: float = 60.0  # an unchanged list is published again this often (a fresh scheduler learns it)
    keepalive_s: float = 10.0  # an unchanged engine/NPU sample is published again this often; 0: always
    probe_keepalive_s: float = 60.0  # a passed probe like the last one is published again this often (0: keepalive_s)
    idle_interval_s: float = 4.0  # longest polling period of an idle node and npu-smi host (<= interval_s: off)


# --------------------------------------------------------------------------- counters and logs


_HELP = {
    "scrapes": "engine /metrics scrapes by outcome (ok, truncated, garbage, http_error, timeout, unreachable)",
    "health_probes": "health probes by result",
    "npu_smi_runs": "npu-smi command runs by outcome",
    "npu_missing": "npu-smi runs whose table lacked the chips of this node",
    "exporter_scrapes": "npu-exporter scrapes by outcome",
    "exporter_missing": "npu-exporter scrapes without fresh chips of this node",
    "model_listings": "engine /v1/models listings by outcome (ok, garbage, http_error, timeout, unreachable)",
    "status_polls": "MindIE status polls by outcome (ok, not_ready, garbage, http_error, timeout, unreachable)",
    "published": "samples published to LB_EVENTS by kind",
    "unchanged": "samples not published because they said what the last one said (within --keepalive-ms) by kind",
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
            ("exporter_scrapes", "outcome"), ("status_polls", "outcome"), ("model_listings", "outcome"),
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
        if node.npu_smi is not None and node.npu_exporter is None:
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
        self._models_sent: dict[str, tuple[list[str], float]] = {}  # node -> (ids published, monotonic time)
        self._engine_kind: dict[str, str] = {}
        self._sent: dict[str, tuple[bytes, float]] = {}  # subject -> (sample_content, monotonic time published)
        self._unchanged: set[str] = set()  # subjects whose last sample said what the one before said
        self._busy: set[str] = set()  # nodes with requests in flight in their pool's latest snapshot
        self._node_ticks: dict[str, AsyncTicks] = {}  # node -> its loop's pacing
        self._npu_ticks: dict[str, AsyncTicks] = {}  # npu-smi command -> its loop's pacing
        self._start_nodes = list(nodes)  # npu-smi hosts come from the start-up list only
        self._npu_commands: dict[str, list[str]] = {}  # node -> the npu-smi command lines that print its chips
        for host in npu_hosts(nodes):
            for member in host.nodes:
                self._npu_commands.setdefault(member.id, []).append(host.command)
        self._node_tasks: dict[str, asyncio.Task[None]] = {}
        self._exporter_tasks: dict[str, asyncio.Task[None]] = {}
        self._running: tuple[aiohttp.ClientSession, asyncio.Event] | None = None
        self.fault_table = settings.fault_table or load_fault_table()

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
            self._sync_exporters()
            try:
                await stop.wait()
            finally:
                self._running = None
                tasks += self._node_tasks.values()
                tasks += self._exporter_tasks.values()
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
        self._models_sent.pop(node_id, None)  # a (re-)registered node's ids are published again
        for subject in (sj.metrics_engine(node_id), sj.metrics_npu(node_id), sj.health(node_id)):
            self._sent.pop(subject, None)  # and its samples
            self._unchanged.discard(subject)
        if node is None:
            self.nodes.pop(node_id, None)
        else:
            self.nodes[node_id] = node
            if self._running is not None:
                self._start_node(node, 0.0)
        if self._running is not None:
            self._sync_exporters()

    def set_busy(self, busy: set[str]) -> None:
        """The nodes the latest snapshots count requests in flight on: a node (and its npu-smi
        host) that just got one is polled at once, and at the normal interval while it has one."""
        for node_id in busy - self._busy:
            if node_id in self._node_ticks:
                self._node_ticks[node_id].wake()
            for command in self._npu_commands.get(node_id, ()):
                if command in self._npu_ticks:
                    self._npu_ticks[command].wake()
        self._busy = set(busy)

    def _sync_exporters(self) -> None:
        """One loop per npu-exporter URL some polled node names (started or stopped as the node set changes)."""
        assert self._running is not None
        session, stop = self._running
        wanted = sorted({n.npu_exporter for n in self.nodes.values() if n.npu_exporter})
        for url in [u for u in self._exporter_tasks if u not in wanted]:
            self._exporter_tasks.pop(url).cancel()
        for i, url in enumerate(wanted):
            if url not in self._exporter_tasks:
                self._exporter_tasks[url] = asyncio.create_task(
                    self._exporter_loop(url, session, stop, i / len(wanted)), name=f"exporter-{url}")

    def _start_node(self, node: Node, phase: float) -> None:
        assert self._running is not None
        session, stop = self._running
        self._node_tasks[node.id] = asyncio.create_task(self._node_loop(node, session, stop, phase),
                                                        name=f"node-{node.id}")

    # -- pacing ---------------------------------------------------------------------------

    # Loops start staggered (``phase`` = fraction of a period): N nodes, or N simulated hosts'
    # npu-smi processes, spread their work over the period instead of all waking at once.

    def _ticks(self, period_s: float, stop: asyncio.Event, late_key: str, phase: float = 0.0,
               idle: Callable[[], bool] | None = None) -> "AsyncTicks":
        return AsyncTicks(period_s, stop, lambda: self.stats.inc("late_ticks", loop=late_key), phase * period_s,
                          idle_s=self.settings.idle_interval_s if idle is not None else 0.0, idle=idle)

    async def _node_loop(self, node: Node, session: aiohttp.ClientSession, stop: asyncio.Event,
                         phase: float) -> None:
        loop = asyncio.get_running_loop()
        list_at = 0.0
        quiet = {sj.metrics_engine(node.id), sj.health(node.id)}
        ticks = self._ticks(self.settings.interval_s, stop, node.id, phase,
                            idle=lambda: quiet <= self._unchanged and node.id not in self._busy)
        self._node_ticks[node.id] = ticks
        try:
            async for _ in ticks:
                jobs = [self._engine_once(node, session), self._health_once(node, session)]
                if loop.time() >= list_at:
                    list_at = loop.time() + self.settings.models_interval_s
                    jobs.append(self._models_once(node, session))
                await asyncio.gather(*jobs)
        finally:
            if self._node_ticks.get(node.id) is ticks:  # not yet replaced by a new loop (update)
                del self._node_ticks[node.id]

    async def _npu_loop(self, host: NpuHost, stop: asyncio.Event, phase: float) -> None:
        def idle() -> bool:
            return all(sj.metrics_npu(n.id) in self._unchanged and n.id not in self._busy
                       for n in host.nodes if n.id in self.nodes)

        ticks = self._ticks(self.settings.npu_interval_s, stop, f"npu-smi {host.command}", phase, idle=idle)
        self._npu_ticks[host.command] = ticks
        async for _ in ticks:
            await self._npu_once(host)

    async def _exporter_loop(self, url: str, session: aiohttp.ClientSession, stop: asyncio.Event,
                             phase: float) -> None:
        period = max(self.settings.exporter_interval_s, MIN_EXPORTER_INTERVAL_S)
        async for _ in self._ticks(period, stop, f"npu-exporter {url}", phase):
            await self._exporter_once(url, session, period)

    async def _stats_loop(self, stop: asyncio.Event) -> None:
        async for _ in self._ticks(self.settings.stats_interval_s, stop, "stats"):
            if self.stats.counts:
                log.info("collector totals: %s", self.stats.summary())

    # -- one round ------------------------------------------------------------------------

    async def _engine_once(self, node: Node, session: aiohttp.ClientSession) -> None:
        timeout = self.settings.timeout_s
        if node.status_url:
            scrape, polled = await asyncio.gather(scrape_metrics(session, node.metrics_url, timeout, node.engine),
                                                  poll_status(session, node.status_url, timeout))
        else:
            scrape, polled = await scrape_metrics(session, node.metrics_url, timeout, node.engine), None
        ts_ns = self.clock_ns()
        key = f"{node.id}:metrics"
        sample = None
        if scrape.metrics is None:
            self.stats.inc("scrapes", node=node.id, outcome=scrape.outcome)
            self.warn.warning(key, f"node {node.id}: scrape {node.metrics_url} failed: {scrape.error}")
        else:
            try:
                sample = engine_sample(self._prev.get(node.id), scrape.metrics, ts_ns=ts_ns)
            except ParseError as exc:
                self.stats.inc("scrapes", node=node.id, outcome="garbage")
                self.warn.warning(key, f"node {node.id}: scrape {node.metrics_url} failed: {exc}")
            else:
                self.stats.inc("scrapes", node=node.id, outcome="truncated" if scrape.metrics.truncated else "ok")
                self.warn.resolved(key, f"node {node.id}: metrics scrape ok again")
                self._note_engine(node, scrape.metrics.engine)
                self._prev[node.id] = scrape.metrics
        if polled is not None:
            sample = await self._with_status(node, session, sample, polled, ts_ns)
        if sample is None:
            self._unchanged.discard(sj.metrics_engine(node.id))  # no sample: not idle, polled every interval
        else:
            if self.settings.keepalive_s > 0:
                period = max(self.settings.interval_s, self.settings.idle_interval_s)  # an idle node's
                sample = msgspec.structs.replace(sample, max_age_ms=stands_for_ms(period, self.settings.keepalive_s))
            await self._publish("engine", sj.metrics_engine(node.id), sample, repeat=False)

    async def _with_status(self, node: Node, session: aiohttp.ClientSession, sample: EngineSampled | None,
                           polled: Polled, ts_ns: int) -> EngineSampled | None:
        """The sample with the MindIE status folded in (collectors.mindie.with_status); the sample
        unchanged when the status is missing (counted and warned)."""
        assert node.status_url is not None
        self.stats.inc("status_polls", node=node.id, outcome=polled.outcome)
        key = f"{node.id}:status"
        if polled.outcome != "ok" or not isinstance(polled.value, MindieStatus):
            self.warn.warning(key, f"node {node.id}: status {node.status_url}: {polled.error}")
            return sample
        self.warn.resolved(key, f"node {node.id}: status ok again")
        extra = None
        if sample is None:  # no /metrics: MindIE's monitor mode off, or the scrape failed
            got = await poll_metrics_json(session, metrics_json_url(node.status_url), self.settings.timeout_s)
            extra = got.value if isinstance(got.value, MetricsJson) else None
        return with_status(sample, polled.value, extra, ts_ns=ts_ns)

    def _note_engine(self, node: Node, kind: str) -> None:
        if self._engine_kind.get(node.id) != kind:
            log.info("node %s: %s metrics at %s", node.id, kind, node.metrics_url)
            self._engine_kind[node.id] = kind

    async def _models_once(self, node: Node, session: aiohttp.ClientSession) -> None:
        """The engine's model ids (``lb.metrics.models``): published when they change, and again
        every ``models_refresh_s``; a failed listing publishes nothing (the last list stands)."""
        url = models_url(node.url)
        outcome, ids, error = await list_model_ids(session, url, self.settings.timeout_s)
        self.stats.inc("model_listings", node=node.id, outcome=outcome)
        key = f"{node.id}:models"
        if ids is None:
            self.warn.warning(key, f"node {node.id}: listing {url} failed: {error}")
            return
        self.warn.resolved(key, f"node {node.id}: model listing ok again")
        now = time.monotonic()
        sent = self._models_sent.get(node.id)
        if sent is not None and sent[0] == ids and now - sent[1] < self.settings.models_refresh_s:
            return
        if sent is None or sent[0] != ids:
            log.info("node %s serves %s", node.id, ", ".join(ids) or "no model")
        if await self._publish("models", sj.metrics_models(node.id), ModelsListed(models=ids, ts_ns=self.clock_ns())):
            self._models_sent[node.id] = (ids, now)

    async def _health_once(self, node: Node, session: aiohttp.ClientSession) -> None:
        probe = await probe_health(session, node.health_url, self.settings.timeout_s, self.clock_ns)
        self.stats.inc("health_probes", node=node.id, result="ok" if probe.ok else "fail")
        key = f"{node.id}:health"
        if probe.ok:
            self.warn.resolved(key, f"node {node.id}: health ok again")
        else:
            self.warn.warning(key, f"node {node.id}: health probe {node.health_url} failed: {probe.error}")
        await self._publish("health", sj.health(node.id), probe, repeat=not probe.ok,
                            keepalive_s=self.settings.probe_keepalive_s or self.settings.keepalive_s)

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
                period = max(self.settings.npu_interval_s, self.settings.idle_interval_s)  # an idle host's
                publishes.append(self._publish("npu", sj.metrics_npu(node.id), NpuSampled(
                    chips=mine, ts_ns=ts_ns, max_age_ms=self._stands_for_ms(period)), repeat=False))
        await asyncio.gather(*publishes)

    async def _exporter_once(self, url: str, session: aiohttp.ClientSession, period_s: float) -> None:
        polled = await scrape_exporter(session, url, self.settings.exporter_timeout_s,
                                       now_s=self.clock_ns() / 1e9, max_age_s=3 * period_s)
        ts_ns = self.clock_ns()
        self.stats.inc("exporter_scrapes", exporter=url, outcome=polled.outcome)
        key = f"exporter:{url}"
        if not isinstance(polled.value, ExporterScrape):
            self.warn.warning(key, f"npu-exporter {url}: {polled.error}")
            return
        self.warn.resolved(key, f"npu-exporter {url}: ok again")
        scrape = polled.value
        publishes = []
        for node in [n for n in self.nodes.values() if n.npu_exporter == url]:
            namespace, pod = node.pod
            mine = select_exporter_chips(scrape.all_chips, node.selector.npu_ids, node.selector.chips,
                                         {"namespace": namespace, "pod_name": pod}, node.chips_per_npu)
            gone = [chip.missing for chip in mine if chip.missing is not None]
            if not mine or gone:  # one chip of the node not to be believed: the node's sample is missing
                self.stats.inc("exporter_missing", node=node.id)
                why = "; ".join(gone[:4]) or "no chip matches its npu_ids/chips/pod"
                self.warn.warning(f"{node.id}:exporter", f"node {node.id}: npu-exporter {url} has no fresh chip: {why}")
                continue
            chips = [to_npu_chip(chip, self.fault_table, node.chips_per_npu) for chip in mine]
            publishes.append(self._publish("npu", sj.metrics_npu(node.id), NpuSampled(
                chips=chips, ts_ns=ts_ns, max_age_ms=self._stands_for_ms(period_s)), repeat=False))
        await asyncio.gather(*publishes)

    def _stands_for_ms(self, period_s: float) -> int:
        return stands_for_ms(period_s, self.settings.keepalive_s)

    async def _publish(self, kind: str, subject: str, event: Event, repeat: bool = True,
                       keepalive_s: float | None = None) -> bool:
        """Publish ``event``; ``repeat=False``: not when it says what the last one on ``subject``
        said, unless ``keepalive_s`` (default the settings') has passed since (counted as ``unchanged``)."""
        content, now = b"", time.monotonic()
        if repeat or self.settings.keepalive_s <= 0:
            self._unchanged.discard(subject)  # a failed probe: the node is not idle
        else:
            content = sample_content(event)
            sent = self._sent.get(subject)
            if sent is not None and sent[0] == content:
                self._unchanged.add(subject)
                if now - sent[1] < (self.settings.keepalive_s if keepalive_s is None else keepalive_s):
                    self.stats.inc("unchanged", kind=kind)
                    return True
            else:
                self._unchanged.discard(subject)
        try:
            await self.js.publish(subject, encode(event), timeout=self.settings.publish_timeout_s,
                                  stream=sj.EVENTS_STREAM)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any NATS failure is counted, never fatal
            self.stats.inc("publish_errors", kind=kind)
            self.warn.warning(f"publish:{kind}", f"cannot publish {subject}: {type(exc).__name__}: {exc}")
            return False
        self.stats.inc("published", kind=kind)
        if content:
            self._sent[subject] = (content, now)
        return True


class AsyncTicks:
    """``async for`` over ticks every ``period_s`` (monotonic schedule) until ``stop`` is set.

    The first tick comes after ``offset_s``. A round that overruns its period skips the ticks
    it missed (calling ``on_late`` for each) instead of bursting to catch up.

    Backoff: with ``idle`` and ``idle_s`` above ``period_s``, a round after which ``idle()`` is
    true doubles the step to the next tick, up to ``idle_s``; one after which it is false sets it
    back to ``period_s``. ``wake()`` while backed off brings the next tick at once (and the step
    back to ``period_s``). While backed off, the wait ends at the tick or the wake, not at
    ``stop``: the owner cancels the loop to stop it (``Collector.run`` does).
    """

    def __init__(self, period_s: float, stop: asyncio.Event, on_late: Callable[[], None],
                 offset_s: float = 0.0, idle_s: float = 0.0, idle: Callable[[], bool] | None = None) -> None:
        self.period_s, self.stop, self.on_late, self.offset_s = period_s, stop, on_late, offset_s
        self.idle = idle if idle_s > period_s else None
        self.idle_s = idle_s
        self.step_s = period_s  # to the next tick
        self._next: float | None = None
        self._woken = asyncio.Event()

    def wake(self) -> None:
        if self.step_s > self.period_s:
            self._woken.set()

    def __aiter__(self) -> "AsyncTicks":
        return self

    async def __anext__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.time() + self.offset_s
        else:
            backoff = self.idle is not None and self.idle()
            self.step_s = min(2 * self.step_s, self.idle_s) if backoff else self.period_s
            if not backoff:
                self._woken.clear()  # woken during the round: this step is the normal one already
            self._next += self.step_s
            while self._next < loop.time():
                self._next += self.step_s
                self.on_late()
        waited = self._woken if self.step_s > self.period_s else self.stop
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waited.wait(), max(0.0, self._next - loop.time()))
        if self._woken.is_set():
            self._woken.clear()
            self._next, self.step_s = loop.time(), self.period_s
        if self.stop.is_set():
            raise StopAsyncIteration
