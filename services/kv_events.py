"""`laswrr kv-events`: subscribe to the engines' KV cache events, publish each node's cache changes.

Usage: ``laswrr kv-events --nats-url URL [--metrics-port N]``.

**Which nodes.** Those registered with ``kv_events`` (``laswrr register NODE --kv-events
tcp://10.0.0.5:5557 [--kv-events-replay tcp://10.0.0.5:5558]``, or the keys of the same names in
nodes.toml): an ordered JetStream consumer on ``lb.admin.>`` of LB_EVENTS first delivers the
newest message of each admin subject, then every new one; a registration with ``kv_events``
starts (or moves) that node's subscription, one without it or ``lb.admin.remove.<id>`` stops it.
A node without an endpoint keeps the proxies' estimated prefix view.

**Per node** one ZMQ SUB socket (pyzmq; ZMQ reconnects by itself when the engine comes back),
every message decoded by ``collectors.kv_events`` (both encodings of vLLM's structs; a message
that does not decode is a counted rejection, ``laswrr_kv_events_rejected_total``, never a
crash) and folded into the node's ``NodeCache``: each change a router sees goes out at once as
one ``CacheChanged`` (``schemas.kvcache``) on ``lb.kv.<node>``, plain core NATS (no stream: the
event log does not grow by every block). A sequence number that skips some asks the replay
endpoint for the missing batches (when there is one); what it cannot fill is a gap, and the
change says ``cleared`` (reason ``gap``): the router drops the node's index rather than trust it.
Sequence numbers that go back mean a restarted engine (reason ``restart``); ``AllBlocksCleared``
reason ``cleared``. On its first message from a node the service asks the replay endpoint for the
batches since 0, so a node that served requests before the service started is known whole.

**Why a service of its own** (not the collector): the collector polls every node on a timer and
publishes samples into the event log; this is a push stream of one message per engine step with
its own failure modes (sequence gaps, replay, restarts), its own dependency (pyzmq) and output
that must stay out of the log. Kept apart, a burst of block events never delays a health probe,
and a pool without KV events runs no such process.

Process rules as the collector's: connects to NATS (no server within 10 s: one line on stderr,
exit 1), optionally serves its counters on ``--metrics-port``, and on SIGINT/SIGTERM closes the
sockets, drains the connection and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
import zmq
import zmq.asyncio
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from laswrr.collectors.errors import ParseError
from laswrr.collectors.kv_events import KvBatch, NodeCache, decode_frames, decode_replay
from laswrr.collectors.poller import RateLimitedLog
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_event
from laswrr.schemas.events import NodeRegistered, NodeRemoveRequested
from laswrr.schemas.kvcache import CACHE_ENCODER, CacheChanged
from laswrr.services import settings as common
from laswrr.services.natsbus import NatsAuth, connect, redact_url
from laswrr.services.service_metrics import serve_metrics
from laswrr.services.tasks import stop_task

log = logging.getLogger("laswrr.kv_events")

REPLAY_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 10.0

Endpoints = tuple[str, str | None]  # (publisher, replay endpoint)
Publish = Callable[[str, CacheChanged], Awaitable[None]]


def endpoints_of(subject: str, data: bytes) -> tuple[str, Endpoints | None] | None:
    """What one admin message says of a node's KV events: (node, its endpoints, None: none now);
    None for a message that says nothing of them (another subject, a payload the scheduler rejects)."""
    if not subject.startswith((sj.ADMIN_NODE + ".", sj.ADMIN_REMOVE + ".")):
        return None
    try:
        node, event = decode_event(subject, data)
    except SchemaError:
        return None
    if node is None:
        return None
    if isinstance(event, NodeRegistered) and event.kv_events is not None:
        return node, (event.kv_events, event.kv_events_replay)
    if isinstance(event, (NodeRegistered, NodeRemoveRequested)):
        return node, None
    return None


@dataclass
class Stats:
    batches: Counter[str] = field(default_factory=Counter)  # node -> batches folded
    changes: Counter[str] = field(default_factory=Counter)  # node -> CacheChanged published
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)  # (node, reason) -> messages
    cleared: Counter[tuple[str, str]] = field(default_factory=Counter)  # (node, reason) -> index drops
    replayed: Counter[str] = field(default_factory=Counter)  # node -> batches from the replay socket
    orphans: Counter[str] = field(default_factory=Counter)  # node -> blocks stored under an unknown parent

    def render(self) -> bytes:
        lines = []
        for name, help_text, counter in (
                ("batches", "engine KV event batches folded", self.batches),
                ("changes", "cache changes published", self.changes),
                ("replayed", "batches fetched from the replay endpoint", self.replayed),
                ("orphan_blocks", "stored blocks whose parent was unknown (not indexed)", self.orphans)):
            lines += [f"# HELP laswrr_kv_events_{name}_total {help_text}", f"# TYPE laswrr_kv_events_{name}_total counter"]
            lines += [f'laswrr_kv_events_{name}_total{{node="{n}"}} {v}' for n, v in sorted(counter.items())]
        for name, help_text, pairs, label in (
                ("rejected", "messages that did not decode", self.rejected, "reason"),
                ("cleared", "node indexes dropped", self.cleared, "reason")):
            lines += [f"# HELP laswrr_kv_events_{name}_total {help_text}", f"# TYPE laswrr_kv_events_{name}_total counter"]
            lines += [f'laswrr_kv_events_{name}_total{{node="{n}",{label}="{r}"}} {v}'
                      for (n, r), v in sorted(pairs.items())]
        return ("\n".join(lines) + "\n").encode()


class NodeFeed:
    """One node's subscription: SUB socket -> decode -> fold (with replay) -> publish."""

    def __init__(self, node: str, endpoints: Endpoints, ctx: zmq.asyncio.Context, publish: Publish,
                 stats: Stats, warn: RateLimitedLog) -> None:
        self.node, self.endpoints = node, endpoints
        self.ctx, self.publish, self.stats, self.warn = ctx, publish, stats, warn
        self.cache = NodeCache()

    async def run(self) -> None:
        url, _ = self.endpoints
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(url)
        log.info("node %s: subscribed to %s", self.node, url)
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    batch = decode_frames(frames)
                except ParseError as exc:
                    self._reject(exc)
                    continue
                if batch is not None:
                    await self.take(batch)
        finally:
            sub.close(0)

    def _reject(self, exc: ParseError) -> None:
        reason = str(exc).split(":")[0][:60]
        self.stats.rejected[(self.node, reason)] += 1
        self.warn.warning(f"reject {self.node}", f"node {self.node}: KV event message rejected: {exc}")

    async def take(self, batch: KvBatch) -> None:
        """Fold ``batch``; first the batches before it that the replay endpoint still has, where
        some were missed (or where it is the first batch seen from this engine, or from a
        restarted one). What the replay cannot fill the fold sees as a gap (``NodeCache.fold``)."""
        last = self.cache.last_seq
        want = 0 if last is None or batch.seq <= last else last + 1
        if batch.seq > want:
            for earlier in await self.replay(want, batch.seq) or ():
                await self._fold(earlier)
        await self._fold(batch)

    async def _fold(self, batch: KvBatch) -> None:
        orphans = self.cache.orphans
        change = self.cache.fold(batch)
        self.stats.batches[self.node] += 1
        self.stats.orphans[self.node] += self.cache.orphans - orphans
        if change is None:
            return
        if change.cleared:
            self.stats.cleared[(self.node, change.reason)] += 1
            log.info("node %s: index dropped (%s) at seq %d", self.node, change.reason, batch.seq)
        self.stats.changes[self.node] += 1
        await self.publish(self.node, change)

    async def replay(self, start: int, stop: int) -> list[KvBatch] | None:
        """Batches ``start`` .. ``stop - 1`` from the replay endpoint (those it still holds, in
        order); None without one or when it does not answer in time."""
        _, url = self.endpoints
        if url is None:
            return None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(url)
        out: list[KvBatch] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                try:
                    batch = decode_replay(frames)  # vLLM's answers or SGLang's (without the topic)
                except ParseError as exc:
                    self._reject(exc)
                    continue
                if batch is None:
                    break  # the end marker
                if start <= batch.seq < stop:
                    out.append(batch)
        except asyncio.TimeoutError:
            self.warn.warning(f"replay {self.node}", f"node {self.node}: replay endpoint {url} did not answer")
            return None
        finally:
            dealer.close(0)
        self.stats.replayed[self.node] += len(out)
        return sorted(out, key=lambda b: b.seq)


class KvEventsService:
    def __init__(self, publish: Publish) -> None:
        self.ctx = zmq.asyncio.Context()
        self.publish = publish
        self.stats = Stats()
        self.warn = RateLimitedLog(30.0)
        self.feeds: dict[str, tuple[Endpoints, asyncio.Task[None]]] = {}

    def observe(self, subject: str, data: bytes) -> None:
        said = endpoints_of(subject, data)
        if said is None:
            return
        node, endpoints = said
        current = self.feeds.get(node)
        if current is not None and current[0] == endpoints:
            return
        if current is not None:
            current[1].cancel()
            del self.feeds[node]
            log.info("node %s: KV events subscription stopped", node)
        if endpoints is not None:
            feed = NodeFeed(node, endpoints, self.ctx, self.publish, self.stats, self.warn)
            self.feeds[node] = (endpoints, asyncio.create_task(self._guarded(feed)))

    async def _guarded(self, feed: NodeFeed) -> None:
        try:
            await feed.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not end the other nodes' feeds; it shows in the log
            log.exception("node %s: KV events feed failed", feed.node)

    async def close(self) -> None:
        await asyncio.gather(*(stop_task(task) for _, task in self.feeds.values()))
        self.feeds.clear()
        self.ctx.term()


async def serve(nats_url: str, stop: asyncio.Event | None = None, auth: NatsAuth | None = None,
                metrics_port: int | None = None) -> Stats:
    stop = common.stop_event(stop)
    try:
        nc = await asyncio.wait_for(connect(nats_url, "laswrr-kv-events", auth), CONNECT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ConnectionError(f"no NATS server answered within {CONNECT_TIMEOUT_S:.0f} s") from None

    async def publish(node: str, change: CacheChanged) -> None:
        await nc.publish(sj.kv(node), CACHE_ENCODER.encode(change))

    service = KvEventsService(publish)
    runner = None
    try:
        async def on_admin(msg: Msg) -> None:
            service.observe(msg.subject, msg.data)

        await nc.jetstream().subscribe(sj.ADMIN_ALL, stream=sj.EVENTS_STREAM, cb=on_admin, ordered_consumer=True,
                                       deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        if metrics_port is not None:
            runner = await serve_metrics(metrics_port, service.stats.render, service="kv-events")
        log.info("following node registrations for KV event endpoints; publishing on %s.<node> to %s",
                 sj.KV, redact_url(nats_url))
        await stop.wait()
    finally:
        await service.close()
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 5)
        log.info("kv-events stopped: %d batch(es), %d change(s), %d rejected",
                 sum(service.stats.batches.values()), sum(service.stats.changes.values()),
                 sum(service.stats.rejected.values()))
    return service.stats


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "kv-events", help="subscribe to the engines' KV cache events; publish each node's cache changes to NATS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_nats_options(parser)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the service's counters here")
    common.add_logging(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    common.configure_logging(args, "kv-events")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        print(f"laswrr kv-events: --metrics-port must be in 0..65535, got {args.metrics_port}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args.nats_url, auth=common.nats_auth(args), metrics_port=args.metrics_port))
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        print(f"laswrr kv-events: NATS at {redact_url(args.nats_url)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
