"""`laswrr collector`: poll engines and npu-smi, publish samples into the event log.

Usage: ``laswrr collector --nats-url URL --nodes nodes.toml [--interval-ms 500]
[--timeout-ms 1000] [--npu-interval-ms 2000] [--npu-timeout-ms 5000]
[--exporter-interval-ms 5000] [--keepalive-ms 10000] [--probe-keepalive-ms 60000] [--idle-interval-ms 4000] [--fault-codes FILE] [--metrics-port N]``.
The node keys it reads (``metrics_url``, ``health_url``, ``engine``, ``npu_smi``, ``npu_ids``,
``chips``, ``npu_exporter``, ``chips_per_npu``, ``pod``, ``status_url``) are documented in
``collectors/nodes.py`` and docs/ascend.md; what it polls and publishes, and why
with JetStream publish, in ``collectors/poller.py``.

The node set follows registrations at runtime (collectors/registrations.py): an ordered
JetStream consumer on ``lb.admin.>`` of LB_EVENTS first delivers the newest message of each
admin subject, in stream order, then every new one; ``lb.admin.node.<id>`` starts (or changes)
polling a node, ``lb.admin.remove.<id>`` stops it. nodes.toml stays the start-up list (and the
only source of npu-smi settings).

Process rules: this is the thin shell. It reads nodes.toml (a bad file: one line on stderr,
exit 2), connects to NATS (reconnecting forever once connected; no server within 10 s at
start: one line on stderr, exit 1), creates the streams only if LB_EVENTS does not exist yet
(never reconfigures them), optionally serves the counters on ``--metrics-port``, and on
SIGINT/SIGTERM stops the loops, drains the connection, logs the summary and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_PURGE

from laswrr.collectors.errors import ParseError
from laswrr.collectors.exporter import load_fault_table
from laswrr.collectors.nodes import Node, NodesConfigError, load_nodes
from laswrr.collectors.poller import Collector, RateLimitedLog, Settings, Stats, npu_hosts
from laswrr.collectors.registrations import RegisteredNodes
from laswrr.schemas import subjects as sj
from laswrr.services import settings as common
from laswrr.services.natsbus import NatsAuth, StreamLimits, connect, ensure_streams, redact_url
from laswrr.services.service_metrics import serve_metrics
from laswrr.services.tasks import stop_task

log = logging.getLogger("laswrr.collector")

async def _connect(nats_url: str, timeout_s: float, stop: asyncio.Event, auth: NatsAuth | None) -> Client:
    """Connect (reconnecting forever later on); give up on a server never reached at start."""
    warn = RateLimitedLog(30.0)
    where = redact_url(nats_url)

    async def on_error(exc: Exception) -> None:
        warn.warning("nats", f"NATS {where}: {type(exc).__name__}: {exc}")

    async def on_disconnected() -> None:
        if not stop.is_set():  # draining at shutdown disconnects too
            log.warning("NATS %s: disconnected, reconnecting", where)

    async def on_reconnected() -> None:
        log.info("NATS %s: reconnected", where)

    try:
        return await asyncio.wait_for(
            connect(nats_url, "laswrr-collector", auth, error_cb=on_error, disconnected_cb=on_disconnected,
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
    await stop_task(task)  # cancelled until it ends: one cancel inside nats-py's connect can be lost
    return None


async def follow_registrations(js: JetStreamContext, collector: Collector, file_nodes: list[Node]) -> asyncio.Task[None]:
    """Follow the admin subjects and the weight snapshots (what the scheduler applied); every
    change of the polled set goes to ``collector.update``. Returns the snapshot watch's task."""
    node_set = RegisteredNodes(file_nodes)

    def apply(changes: list[tuple[str, Node | None]]) -> None:
        for node_id, node in changes:
            if node is None:
                log.info("node %s removed: polling stopped", node_id)
            else:
                log.info("node %s registered: polling %s and %s", node_id, node.metrics_url, node.health_url)
            collector.update(node_id, node)

    async def on_admin(msg: Msg) -> None:
        apply(node_set.observe(msg.subject, msg.data))

    await js.subscribe(sj.ADMIN_ALL, stream=sj.EVENTS_STREAM, cb=on_admin, ordered_consumer=True,
                       deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    watcher = await (await js.key_value(sj.WEIGHTS_BUCKET)).watchall()

    async def follow_snapshots() -> None:
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=60)
                except nats.errors.TimeoutError:
                    continue
                if entry is None:
                    continue  # the end of the initial values
                deleted = entry.operation in (KV_DEL, KV_PURGE)
                apply(node_set.observe_snapshot(entry.key, None if deleted else entry.value))
                collector.set_busy(node_set.busy)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    return asyncio.create_task(follow_snapshots())


async def serve(nats_url: str, nodes: list[Node], settings: Settings,
                stop: asyncio.Event | None = None, auth: NatsAuth | None = None,
                limits: StreamLimits | None = None) -> Stats:
    """Connect, collect until ``stop`` (or SIGINT/SIGTERM), drain; returns the counters.
    ``limits``: of the streams it creates where missing (``--stream-replicas``)."""
    stop = common.stop_event(stop)
    nc = await _until_stopped(_connect(nats_url, settings.connect_timeout_s, stop, auth), stop)
    if nc is None:
        return Stats()
    runner = None
    follower: asyncio.Task[None] | None = None
    collector = Collector(nodes, nc.jetstream(), settings)
    try:
        await ensure_streams(collector.js, limits)
        follower = await follow_registrations(collector.js, collector, nodes)
        if settings.metrics_port is not None:
            runner = await serve_metrics(settings.metrics_port, collector.stats.render, service="collector")
        log.info("collecting %d node(s) every %.0f ms, %d npu-smi command(s), publishing to %s",
                 len(nodes), settings.interval_s * 1000, len(npu_hosts(nodes)), redact_url(nats_url))
        await collector.run(stop)
    finally:
        if follower is not None:
            await stop_task(follower)
        if runner is not None:
            await runner.cleanup()
        # bounded: a drain with NATS gone would wait for ever; 5 s, half of the stop timeout that
        # `laswrr up` gives a child, so a slow drain still ends in this summary, not in a kill
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 5)
        log.info("collector stopped: %s", collector.stats.summary())
    return collector.stats


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "collector", help="poll engines' /metrics and health and npu-smi; publish samples to NATS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_nats_options(parser)
    parser.add_argument("--nodes", required=True, help="nodes.toml ([[node]] tables, see collectors/nodes.py)")
    parser.add_argument("--interval-ms", type=common.duration("ms"), default=_ms(Settings.interval_s),
                        help="engine/health polling period (default %(default)s)")
    parser.add_argument("--timeout-ms", type=common.duration("ms"), default=_ms(Settings.timeout_s),
                        help="per-request HTTP timeout (default %(default)s)")
    parser.add_argument("--npu-interval-ms", type=common.duration("ms"), default=_ms(Settings.npu_interval_s),
                        help="npu-smi period (default %(default)s)")
    parser.add_argument("--npu-timeout-ms", type=common.duration("ms"), default=_ms(Settings.npu_timeout_s),
                        help="npu-smi command timeout (default %(default)s)")
    parser.add_argument("--exporter-interval-ms", type=common.duration("ms"),
                        default=_ms(Settings.exporter_interval_s),
                        help="npu-exporter scrape period per host: its own refresh, -updateTime (default %(default)s; "
                             "at least 1000)")
    parser.add_argument("--models-interval-ms", type=common.duration("ms"), default=_ms(Settings.models_interval_s),
                        help="GET /v1/models per node this often; the model ids go to the scheduler on a change "
                             "(default %(default)s)")
    parser.add_argument("--keepalive-ms", type=common.duration("ms"), default=_ms(Settings.keepalive_s),
                        help="an engine or NPU sample unchanged since the last one published "
                             "is published again only this often; each sample's max_age_ms covers it "
                             "(default %(default)s; 0: publish every one)")
    parser.add_argument("--probe-keepalive-ms", type=common.duration("ms"), default=_ms(Settings.probe_keepalive_s),
                        help="a passed health probe like the last one published is published again only this often "
                             "(default %(default)s; 0: as --keepalive-ms)")
    parser.add_argument("--idle-interval-ms", type=common.duration("ms"), default=_ms(Settings.idle_interval_s),
                        help="longest polling period of an idle node (its samples unchanged, no request in flight "
                             "in its pool's snapshot): its engine and health, and its host's npu-smi, are polled "
                             "twice as far apart each unchanged round up to this, and at the normal interval again "
                             "from its first change or request (default %(default)s; at most --interval-ms: off)")
    parser.add_argument("--fault-codes", metavar="FILE", default=None,
                        help="MindCluster fault-code table (default: the shipped collectors/faultcodes.toml)")
    parser.add_argument("--stats-interval-s", type=common.duration("s"), default=Settings.stats_interval_s,
                        help="log totals this often (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=Settings.metrics_port,
                        help="serve the collector's counters here")
    common.add_stream_replicas(parser)
    common.add_logging(parser)
    parser.set_defaults(func=run)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("interval_ms", "timeout_ms", "npu_interval_ms", "npu_timeout_ms", "models_interval_ms"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("keepalive_ms", "probe_keepalive_ms"):
        if getattr(args, name, 0) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.stats_interval_s <= 0:
        raise ValueError(f"--stats-interval-s must be > 0, got {args.stats_interval_s}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    exporter_ms = getattr(args, "exporter_interval_ms", _ms(Settings.exporter_interval_s))
    if exporter_ms < 1000:
        raise ValueError(f"--exporter-interval-ms must be >= 1000 (npu-exporter refreshes at most once a second), "
                         f"got {exporter_ms}")
    try:
        table = load_fault_table(getattr(args, "fault_codes", None))
    except ParseError as exc:
        raise ValueError(f"--fault-codes: {exc}") from None
    return Settings(interval_s=args.interval_ms / 1000, timeout_s=args.timeout_ms / 1000,
                    npu_interval_s=args.npu_interval_ms / 1000, npu_timeout_s=args.npu_timeout_ms / 1000,
                    stats_interval_s=args.stats_interval_s, metrics_port=args.metrics_port,
                    exporter_interval_s=exporter_ms / 1000, fault_table=table,
                    models_interval_s=args.models_interval_ms / 1000,
                    keepalive_s=getattr(args, "keepalive_ms", _ms(Settings.keepalive_s)) / 1000,
                    probe_keepalive_s=getattr(args, "probe_keepalive_ms", _ms(Settings.probe_keepalive_s)) / 1000,
                    idle_interval_s=getattr(args, "idle_interval_ms", _ms(Settings.idle_interval_s)) / 1000)


def run(args: argparse.Namespace) -> int:
    common.configure_logging(args, "collector")
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
        asyncio.run(serve(args.nats_url, nodes, settings, auth=common.nats_auth(args),
                          limits=StreamLimits(replicas=args.stream_replicas)))
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        print(f"laswrr collector: NATS at {redact_url(args.nats_url)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
