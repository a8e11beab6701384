"""`laswrr collector`: poll engines and npu-smi, publish samples into the event log.

Usage: ``laswrr collector --nats-url URL --nodes nodes.toml [--interval-ms 500]
[--timeout-ms 1000] [--npu-interval-ms 2000] [--npu-timeout-ms 3000] [--metrics-port N]``.
The node keys it reads (``metrics_url``, ``health_url``, ``engine``, ``npu_smi``, ``npu_ids``,
``chips``) are documented in ``collectors/nodes.py``.

Theory of operation
-------------------
* One asyncio task per node: every ``--interval-ms`` it scrapes ``/metrics`` and probes health
  CONCURRENTLY, each bounded by ``--timeout-ms``, then publishes. Nodes never wait for each
  other, so a slow or dead node delays only its own samples (its loop skips the ticks it
  overran and counts them as ``late_ticks``).
* One task per DISTINCT ``npu_smi`` command line (one host): every ``--npu-interval-ms`` it runs
  the command (subprocess, timeout, killed on expiry), parses the table and publishes each
  node's selected chips.
* Published (producer ``ts_ns`` = this host's wall clock when the answer arrived):
  ``lb.metrics.engine.<node>`` EngineSampled (histogram deltas against this node's previous
  good scrape), ``lb.health.<node>`` HealthProbed (an unreachable node or a non-2xx health
  answer is ``ok: false`` with the error, never a crash), ``lb.metrics.npu.<node>`` NpuSampled.
* A scrape that is not an engine exposition (garbage, HTML, cut before the gauges) publishes
  nothing and is counted; so are HTTP errors, timeouts, npu-smi failures and publish errors.
  Warnings are rate-limited per (node, problem); totals are logged every ``--stats-interval-s``
  and in a summary at shutdown, and served as Prometheus text on ``--metrics-port``.
* Publishing uses JetStream publish with ``stream=LB_EVENTS``: samples are inputs of the
  deterministic log, and the stream's ack is the proof that one landed there; a missing stream
  or an unavailable server becomes a counted, logged publish error instead of a silent loss
  (core publish would also be captured by the stream, but loss would go unnoticed). Each
  node's loop awaits only its own acks, so this costs no other node any time. No retries: the
  next sample supersedes a lost one.
* SIGINT/SIGTERM: loops stop, running scrapes are cancelled and npu-smi children killed, the
  NATS connection is drained, the summary logged, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from collectors.engine import probe_health, scrape_metrics
from collectors.errors import ParseError
from collectors.nodes import CollectorNode, NodesConfigError, load_nodes
from collectors.npu import NpuSmiError, run_npu_smi, select_chips, split_command
from collectors.prometheus import EngineMetrics, engine_sample
from schemas import subjects as sj
from schemas.codec import encode_event
from schemas.events import Event, NpuSampled
from services.natsbus import connect, ensure_streams

log = logging.getLogger("laswrr.collector")
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Settings:
    interval_s: float = 0.5
    timeout_s: float = 1.0
    npu_interval_s: float = 2.0
    npu_timeout_s: float = 3.0
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
            ("published", "kind"), ("publish_errors", "kind"), ("late_ticks", "node"), ("npu_missing", "node"))
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
    nodes: tuple[CollectorNode, ...]


def npu_hosts(nodes: Iterable[CollectorNode]) -> list[NpuHost]:
    grouped: dict[str, list[CollectorNode]] = {}
    for node in nodes:
        if node.npu_smi is not None:
            grouped.setdefault(node.npu_smi, []).append(node)
    return [NpuHost(cmd, tuple(split_command(cmd)), tuple(members)) for cmd, members in grouped.items()]


class Collector:
    """Polls ``nodes`` and publishes their samples through ``js`` until ``stop`` is set."""

    def __init__(self, nodes: list[CollectorNode], js: JetStreamContext, settings: Settings,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.nodes, self.js, self.settings, self.clock_ns = nodes, js, settings, clock_ns
        self.stats = Stats()
        self.warn = RateLimitedLog(settings.warn_every_s)
        self._prev: dict[str, EngineMetrics] = {}
        self._engine_kind: dict[str, str] = {}
        self._healthy: dict[str, bool] = {}

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(self._node_loop(node, session, stop), name=f"node-{node.id}")
                     for node in self.nodes]
            tasks += [asyncio.create_task(self._npu_loop(host, stop), name=f"npu-{i}")
                      for i, host in enumerate(npu_hosts(self.nodes))]
            tasks.append(asyncio.create_task(self._stats_loop(stop), name="stats"))
            try:
                await stop.wait()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- pacing ---------------------------------------------------------------------------

    def _ticks(self, period_s: float, stop: asyncio.Event, late_key: str) -> "AsyncTicks":
        return AsyncTicks(period_s, stop, lambda: self.stats.inc("late_ticks", node=late_key))

    async def _node_loop(self, node: CollectorNode, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        async for _ in self._ticks(self.settings.interval_s, stop, node.id):
            await asyncio.gather(self._engine_once(node, session), self._health_once(node, session))

    async def _npu_loop(self, host: NpuHost, stop: asyncio.Event) -> None:
        async for _ in self._ticks(self.settings.npu_interval_s, stop, f"npu-smi {host.command}"):
            await self._npu_once(host)

    async def _stats_loop(self, stop: asyncio.Event) -> None:
        async for _ in self._ticks(self.settings.stats_interval_s, stop, "stats"):
            if self.stats.counts:
                log.info("collector totals: %s", self.stats.summary())

    # -- one round ------------------------------------------------------------------------

    async def _engine_once(self, node: CollectorNode, session: aiohttp.ClientSession) -> None:
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

    def _note_engine(self, node: CollectorNode, kind: str) -> None:
        if self._engine_kind.get(node.id) != kind:
            log.info("node %s: %s metrics at %s", node.id, kind, node.metrics_url)
            self._engine_kind[node.id] = kind

    async def _health_once(self, node: CollectorNode, session: aiohttp.ClientSession) -> None:
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
            await self.js.publish(subject, encode_event(event), timeout=self.settings.publish_timeout_s,
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

    The first tick is immediate. A round that overruns its period skips the ticks it missed
    (calling ``on_late`` for each) instead of bursting to catch up.
    """

    def __init__(self, period_s: float, stop: asyncio.Event, on_late: Callable[[], None]) -> None:
        self.period_s, self.stop, self.on_late = period_s, stop, on_late
        self._next: float | None = None

    def __aiter__(self) -> "AsyncTicks":
        return self

    async def __anext__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.time()
        else:
            self._next += self.period_s
            while self._next < loop.time():
                self._next += self.period_s
                self.on_late()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), max(0.0, self._next - loop.time()))
        if self.stop.is_set():
            raise StopAsyncIteration


# --------------------------------------------------------------------------- process


async def ensure_events_stream(js: JetStreamContext) -> None:
    """Create the streams with defaults if LB_EVENTS is missing; never reconfigure them."""
    try:
        await js.stream_info(sj.EVENTS_STREAM)
    except NotFoundError:
        await ensure_streams(js)


async def _connect(nats_url: str, timeout_s: float) -> Client:
    """Connect (reconnecting forever later on); give up on a server never reached at start."""
    warn = RateLimitedLog(30.0)

    async def on_error(exc: Exception) -> None:
        warn.warning("nats", f"NATS {nats_url}: {type(exc).__name__}: {exc}")

    async def on_disconnected() -> None:
        log.warning("NATS %s: disconnected, reconnecting", nats_url)

    async def on_reconnected() -> None:
        log.info("NATS %s: reconnected", nats_url)

    try:
        return await asyncio.wait_for(
            connect(nats_url, "laswrr-collector", error_cb=on_error, disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected), timeout_s)
    except asyncio.TimeoutError:
        raise ConnectionError(f"no NATS server answered within {timeout_s:.0f} s") from None


async def _until_stopped(start: Coroutine[Any, Any, Client], stop: asyncio.Event) -> Client | None:
    """``await start`` unless ``stop`` is set first (then cancel it and return None)."""
    task, stopped = asyncio.ensure_future(start), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _metrics_site(stats: Stats, port: int) -> web.AppRunner:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=stats.render(), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    log.info("collector metrics on http://0.0.0.0:%d/metrics", port)
    return runner


async def serve(nats_url: str, nodes: list[CollectorNode], settings: Settings,
                stop: asyncio.Event | None = None) -> Stats:
    """Connect, collect until ``stop`` (or SIGINT/SIGTERM), drain; returns the counters."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    nc = await _until_stopped(_connect(nats_url, settings.connect_timeout_s), stop)
    if nc is None:
        return Stats()
    runner = None
    collector = Collector(nodes, nc.jetstream(), settings)
    try:
        await ensure_events_stream(collector.js)
        if settings.metrics_port is not None:
            runner = await _metrics_site(collector.stats, settings.metrics_port)
        log.info("collecting %d node(s) every %.0f ms, %d npu-smi command(s), publishing to %s",
                 len(nodes), settings.interval_s * 1000, len(npu_hosts(nodes)), nats_url)
        await collector.run(stop)
    finally:
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(Exception):
            await nc.drain()
        log.info("collector stopped: %s", collector.stats.summary())
    return collector.stats


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "collector", help="poll engines' /metrics and health and npu-smi; publish samples to NATS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL") or "nats://127.0.0.1:4222",
                        help="NATS server (default: $NATS_URL, else nats://127.0.0.1:4222)")
    parser.add_argument("--nodes", required=True, help="nodes.toml ([[node]] tables, see collectors/nodes.py)")
    parser.add_argument("--interval-ms", type=int, default=500, help="engine/health polling period (default 500)")
    parser.add_argument("--timeout-ms", type=int, default=1000, help="per-request HTTP timeout (default 1000)")
    parser.add_argument("--npu-interval-ms", type=int, default=2000, help="npu-smi period (default 2000)")
    parser.add_argument("--npu-timeout-ms", type=int, default=3000, help="npu-smi command timeout (default 3000)")
    parser.add_argument("--stats-interval-s", type=float, default=60.0, help="log totals this often (default 60)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the collector's counters here")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("interval_ms", "timeout_ms", "npu_interval_ms", "npu_timeout_ms"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.stats_interval_s <= 0:
        raise ValueError(f"--stats-interval-s must be > 0, got {args.stats_interval_s}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    return Settings(interval_s=args.interval_ms / 1000, timeout_s=args.timeout_ms / 1000,
                    npu_interval_s=args.npu_interval_ms / 1000, npu_timeout_s=args.npu_timeout_ms / 1000,
                    stats_interval_s=args.stats_interval_s, metrics_port=args.metrics_port)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        nodes, warnings = load_nodes(args.nodes)
    except (ValueError, NodesConfigError) as exc:
        print(f"laswrr collector: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        log.warning("%s: %s", args.nodes, warning)
    if not nodes:
        log.warning("%s has no [[node]] tables: nothing to collect until stopped", args.nodes)
    try:
        asyncio.run(serve(args.nats_url, nodes, settings))
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        print(f"laswrr collector: NATS at {args.nats_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
