"""The proxy's link to NATS: connect (retrying forever), watch LB_WEIGHTS, hand the publisher its connection.

Theory of operation. The proxy must serve with NATS absent (starting before it, or cut off
later): ``run`` keeps trying to connect in the background, and until it succeeds routing uses
whatever snapshots it has (none at a cold start -> 503). Once connected it creates the streams
and bucket only if they are missing (it never rewrites a configuration another service chose),
attaches the event publisher, and watches every key of LB_WEIGHTS. The set-up runs once, at the
first connection: after a NATS restart the streams are recovered from disk, and creating them
while the server is still recovering would shadow the recovered ones. Each value is decoded as a
``WeightSnapshot`` and offered to the router, which keeps only a newer ``as_of_seq``. A deleted
or purged key forgets the pool. A bad value is logged and skipped.

A recreated LB_WEIGHTS. ``as_of_seq`` only orders snapshots of one stream: the scheduler writes
a pool's key compare-and-set, never over a newer ``as_of_seq``, so within one stream a watcher
never meets an older snapshot than one it already saw. After ``nats stream rm`` (or a new
JetStream store) a fresh scheduler counts from 1 again, and "newest wins" alone would ignore it
forever. So the link tracks the identity of the stream it reads, its creation time
(``StreamInfo.created``, kept across server restarts, new for a recreated stream): it reads it
after creating each watcher, and again (at most once per ``stream_check_s``) when the table
refuses a snapshot as not newer, which is the symptom a recreated stream shows on a watcher
that survived it. A changed identity calls ``RoutingTable.new_stream``: each pool takes the next
snapshot offered, whatever its ``as_of_seq``, and the refused one is offered again. Wall-clock
``ts_ns`` is not used to order snapshots: it can step backwards, the stream identity cannot.

Self-healing: if the watcher has been silent for ``rewatch_s`` (the scheduler ticks far more
often) or fails, it is re-created; so it is when it has been silent for ``WATCH_POLL_S`` after
the connection came back (a restarted nats-server forgot the watcher's consumer: without this,
the proxy would route on its last snapshot until ``rewatch_s`` after the last one it got). The
new watcher first re-delivers the newest value of each key, so nothing published during an
outage is missed, and older ones are ignored by the router.

The channel between proxies (docs/proxy.md, "The channel between proxies"; with a router that
has a channel, ``--peer-interval-ms`` > 0): ``PeerLink``, the IO of the sans-IO
``scheduler.routing.peers.PeerChannel``. Once connected, it subscribes ``lb.peer.>`` (plain core
NATS: nothing is stored) and hands every other proxy's message to ``PeerChannel.receive`` with
the pool and the sender read from its subject. The channel never calls back: the link drains
its outboxes. After an admission the shell calls ``picked()``, which wakes the ``_picks`` task:
``--peer-pick-ms`` (1 ms) later it publishes, on ``lb.peer.<pool>.<proxy>``, the message of each
pool ``PeerChannel.picks()`` names (every pick of that window in the one message; at any rate at
most one pick message a window): the peers count a pick within a millisecond and the bus's
delivery, not an interval later, which is what keeps replicas from all sending one burst to the
node that looked lightest to each. Its ``_peers`` task wakes every ``peer_interval_s``, drops
the peers silent for ``peer_stale_ms`` (``PeerChannel.expire``) and publishes each pool's
message that is due (``PeerChannel.due``: own counts changed otherwise, a first byte, a release,
while a peer is heard; or the heartbeat). While no peer is heard it rests until the next
heartbeat (``PeerChannel.next_due``), woken at once by a peer's message or a snapshot installed
(a new pool's first view): a proxy alone wakes once a second, not every 20 ms. What a message
carries (whole or changes) is the channel's (``PeerChannel.speak``). A bad message is counted
and skipped; with NATS away nothing is sent and the peers fall back to the snapshots' counts of
this proxy. ``on_view(pool)`` (flow
control's wake-up, when set) is called after each snapshot installed, each peer message taken
and each peer dropped: a slot another proxy freed is seen at once; the picks it makes are told
as the others.

The exact cache view (with ``--tokenizer``, ``kv_view``): once connected the link subscribes
``lb.kv.>`` (plain core NATS, published by ``laswrr kv-events``) and folds each node's
``CacheChanged`` into the table's ``KvIndex`` (``scheduler.routing.kvindex``: the rules, pure);
a message that does not decode is counted (``kv_rejected``) and skipped.

The latency estimate, shared by the replicas (``share_latency``: the proxy's ``--share-latency``):
once connected the link reads LB_EVENTS' request events (``lb.req.>``, an
ordered consumer) from the stream's next sequence ``S`` on and feeds them, every proxy's, its own
included, to a ``scheduler.routing.latency_fold.SharedLearner`` whose model (``source`` ``S``)
then replaces the admitter's: every replica learns every attempt, in stream order, and each pick
records ``learned_from = S`` so a refold rebuilds it. Until then, or when the stream cannot be
read (a role without the right: a warning in the proxy's log), the estimate learns this proxy's
own attempts as before. A message that does not decode is counted (``LatencyFeed.rejected``)
and skipped.

Stopping: ``start`` runs ``run`` as a task; ``close`` sets ``closing`` (every loop of ``run``
checks it), stops that task with ``tasks.stop_task`` (which cancels again when Python 3.11's
``wait_for`` inside nats-py swallowed a cancel: a run that outlived one cancel would otherwise
watch forever and the shutdown would hang), then drains the connection; drain and close are
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from datetime import datetime

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_batch, decode_event
from laswrr.schemas.kvcache import CACHE_DECODER
from laswrr.schemas.outputs import WeightSnapshot
from laswrr.schemas.peers import PEER_DECODER, PEER_ENCODER, PeerState
from laswrr.scheduler.routing.latency import LatencyModel
from laswrr.scheduler.routing.latency_fold import SharedLearner
from laswrr.scheduler.routing.peers import PeerChannel
from laswrr.services.natsbus import NatsAuth, StreamLimits, connect, ensure_streams, redact_url
from laswrr.services.service_metrics import Buckets
from laswrr.services.proxy.events import EventPublisher
from laswrr.scheduler.routing.admission import Admitter
from laswrr.scheduler.routing.router import Router
from laswrr.scheduler.routing.table import Offered
from laswrr.services.tasks import bounded, stop_task

log = logging.getLogger("laswrr.proxy.bus")

_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)
WEIGHTS_STREAM = f"KV_{sj.WEIGHTS_BUCKET}"
WATCH_POLL_S = 1.0  # after a reconnect, a watcher silent this long is re-created
VIEW_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class PeerLink:
    """The channel between proxies' IO (module docstring): receive, and drain the channel's outboxes."""

    def __init__(self, channel: PeerChannel, publisher: EventPublisher, interval_s: float,
                 viewed: Callable[[str], None]) -> None:
        self.channel = channel
        self.publisher = publisher
        self.interval_s = interval_s
        self._viewed = viewed
        self.peer_lag = Buckets(VIEW_LAG_BUCKETS)  # each peer message's age when taken (its ts_ns: the sender's clock)
        self.peer_sent = self.peer_sent_bytes = self.peer_received = self.peer_bad = 0
        self.peer_sent_whole = 0  # of peer_sent, the whole views (PeerState); the others carried changes
        self.peer_heard = 0  # every message on lb.peer.> delivered here (own ones are not: no_echo)
        self._pick = asyncio.Event()
        self._woken = asyncio.Event()  # wake()
        self._sending = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, nc: Client) -> None:
        await nc.subscribe(sj.PEER_ALL, cb=self.receive)
        self._tasks = [asyncio.create_task(self._peers(nc), name="proxy-peers"),
                       asyncio.create_task(self._picks(nc), name="proxy-peer-picks")]

    def picked(self) -> None:
        """Some admission may have been made: tell the channel's picks within its window."""
        if self.channel.picked:
            self._pick.set()

    async def receive(self, msg: Msg) -> None:
        self.peer_heard += 1
        sender = sj.peer_of(msg.subject)
        try:
            if sender is None:
                raise ValueError("not an lb.peer.<pool>.<proxy> subject")
            message = PEER_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.peer_bad += 1
            log.debug("ignoring a bad message on %s: %s", msg.subject, exc)
            return
        pool, proxy = sender
        self.peer_lag.observe(max(0.0, (time.time_ns() - message.ts_ns) / 1e9))
        if self.channel.receive(proxy, pool, message, time.monotonic()):
            self.peer_received += 1
            self._viewed(pool)
            self.picked()
            self.wake()

    async def _picks(self, nc: Client) -> None:
        """At an admission: publish its pool's view ``PeerChannel.pick_s`` later, with every other
        pick of that window (module docstring)."""
        channel = self.channel
        while True:
            await self._pick.wait()
            if channel.pick_s > 0:
                await asyncio.sleep(channel.pick_s)
            self._pick.clear()
            pools = channel.picks()
            if nc.is_connected:
                now = time.monotonic()
                for pool in pools:
                    await self._send(nc, pool, now)

    def wake(self) -> None:
        """A peer's message was taken or a snapshot installed: a ``_peers`` loop resting until the
        next heartbeat (no peer heard) looks at once."""
        self._woken.set()

    async def _peers(self, nc: Client) -> None:
        """Every ``interval_s`` while a peer is heard, else at each heartbeat or wake-up: drop the
        stale peers, publish each pool's due message."""
        channel = self.channel
        while True:
            now = time.monotonic()
            rest = channel.next_due(now, self.interval_s) - now
            if rest <= self.interval_s:
                await asyncio.sleep(self.interval_s)
            else:  # alone: nothing is due before the heartbeat unless a peer or a pool comes
                self._woken.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), rest)
            now = time.monotonic()
            if channel.expire(now):
                for pool in channel.table.names():
                    self._viewed(pool)
                self.picked()
            if not nc.is_connected:
                continue
            for pool in channel.table.names():
                if channel.due(pool, now):
                    await self._send(nc, pool, now)

    async def _send(self, nc: Client, pool: str, now: float) -> None:
        """The pool's next message (``PeerChannel.speak``). One that cannot be published leaves a
        gap in the counter, so the peers take no change before the next whole view."""
        async with self._sending:  # one message at a time: a pool's changes reach NATS in their order
            channel = self.channel
            message = channel.speak(pool, now, time.time_ns(), self.publisher.boot_id)
            if message is None:
                return
            data = PEER_ENCODER.encode(message)
            subject = sj.peer(pool, channel.proxy_id)
            try:
                await nc.publish(subject, data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("peer message for %s not sent: %s", pool, exc)
                return
            channel.sent(pool, message, now)
            if isinstance(message, PeerState):
                self.peer_sent_whole += 1
            self.peer_sent += 1
            self.peer_sent_bytes += len(data) + len(subject)

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)


class LatencyFeed:
    """The latency estimate shared by the replicas (module docstring): LB_EVENTS' request events
    from the stream's next sequence on, fed to a ``SharedLearner`` whose model replaces the
    admitter's once the consumer is made."""

    def __init__(self, admitter: Admitter) -> None:
        self.admitter = admitter
        self.learner: SharedLearner | None = None  # once the stream is read
        self.rejected = 0  # messages that did not decode

    async def start(self, js: JetStreamContext) -> None:
        admitter = self.admitter
        assert admitter.latency is not None
        try:
            start = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq + 1
            learner = SharedLearner(LatencyModel(admitter.latency.half_life, source=start))
            await js.subscribe(sj.REQ_ALL, stream=sj.EVENTS_STREAM, cb=functools.partial(self._learn, learner),
                               ordered_consumer=True, config=ConsumerConfig(
                                   deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("cannot read the log's request events (%s): the latency estimate learns this proxy's "
                        "own attempts only", exc or type(exc).__name__)
            return
        self.learner = learner
        admitter.latency = learner.model
        log.info("latency estimate shared: learning every proxy's attempts from %s seq %d", sj.EVENTS_STREAM, start)

    async def _learn(self, learner: SharedLearner, msg: Msg) -> None:
        try:
            seq = msg.metadata.sequence.stream
            if msg.subject.startswith(sj.REQ_BATCH + "."):  # the core's path: each name checked once
                for item in decode_batch(msg.subject, msg.data, core=True)[1]:
                    if item.event is not None:
                        learner.apply(seq, item.key, item.event)
            else:
                learner.apply(seq, *decode_event(msg.subject, msg.data, core=True))
        except SchemaError as exc:
            self.rejected += 1
            log.debug("request event on %s skipped by the latency estimate: %s", msg.subject, exc)


async def _set_event(event: asyncio.Event) -> None:
    """nats-py's ``reconnected_cb``: the connection came back (``BusLink._watch`` re-creates a silent watcher)."""
    event.set()


class BusLink:
    def __init__(self, url: str, name: str, router: Router, publisher: EventPublisher,
                 rewatch_s: float = 10.0, retry_s: float = 0.5, max_retry_s: float = 5.0,
                 stream_check_s: float = 1.0, auth: NatsAuth | None = None,
                 limits: StreamLimits | None = None, peer_interval_s: float = 0.0, kv_view: bool = False,
                 share_latency: bool = False) -> None:
        self.url = url
        self.limits = limits
        self.auth = auth
        self.name = name
        self.table = router.table
        self.publisher = publisher
        self.rewatch_s = rewatch_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.stream_check_s = stream_check_s
        self.stream_created: datetime | None = None  # identity of the LB_WEIGHTS stream being read
        self.refused: WeightSnapshot | None = None  # the last snapshot the table refused as not newer
        self._stream_checked_at = -math.inf
        self.nc: Client | None = None
        self.closing = False
        self._task: asyncio.Task[None] | None = None
        self._reconnected = asyncio.Event()  # set by the connection on a reconnect; the watcher re-created
        self.installed = asyncio.Event()  # set at the first snapshot the table installs (the worker's wait to listen)
        self.last_update = 0.0
        # wall clock now - event time of each snapshot installed: how old the other replicas'
        # in-flight counts are when routing starts on them (scheduler/routing/table.py, "One load view")
        self.view_lag = Buckets(VIEW_LAG_BUCKETS)
        self.peer_interval_s = peer_interval_s
        # called with a pool's name when its view changed (a snapshot installed, a peer's message
        # taken, a peer dropped): flow control's held requests may go now (services/proxy/flow.py)
        self.on_view: Callable[[str], None] | None = None
        self.kv_view = kv_view  # fold lb.kv.> into the table's KvIndex
        self.kv_rejected = 0
        # the latency estimate shared by the replicas (``share_latency``)
        self.latency = LatencyFeed(router.admitter) if share_latency and router.admitter.latency is not None else None
        self.peers = PeerLink(router.channel, publisher, peer_interval_s, self._viewed) \
            if router.channel is not None and peer_interval_s > 0 else None

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="proxy-bus")
        return self._task

    def picked(self) -> None:
        """An admission was made (or may have been): the peers hear of it within the pick window."""
        if self.peers is not None and self.nc is not None:
            self.peers.picked()

    async def run(self) -> None:
        nc = await self._connect()
        if self.closing:  # a cancel was lost while connecting: do not keep a second connection
            await nc.close()
            return
        self.nc = nc
        self.publisher.attach(nc)
        if self.peers is not None:
            await self.peers.start(nc)
        if self.kv_view:
            await nc.subscribe(sj.KV_ALL, cb=self._kv_changed)
        js = nc.jetstream()
        await self._bootstrap(js)
        if self.latency is not None:
            await self.latency.start(js)
        failures = 0
        while not self.closing:
            try:
                await self._watch(js)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "weights watch failed (%s); retrying", exc or type(exc).__name__)
                await asyncio.sleep(min(self.max_retry_s, self.retry_s * failures))

    async def _kv_changed(self, msg: Msg) -> None:
        node = sj.kv_node(msg.subject)
        try:
            change = CACHE_DECODER.decode(msg.data)
            if node is None:
                raise ValueError(f"not a node's subject: {msg.subject}")
            self.table.kv.apply(node, change)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.kv_rejected += 1
            log.debug("kv change on %s skipped: %s", msg.subject, exc)

    async def _connect(self) -> Client:
        delay = self.retry_s
        while True:
            try:
                # Every subject this link publishes on is built by schemas.subjects from checked
                # tokens: nats-py's per-publish subject regex (two per event) is redundant here.
                # no_echo: the server does not send this connection what it published itself, so
                # a proxy does not get back (and decode) its own lb.peer message of every pick;
                # the snapshots and publish acks come from the server, never echoes.
                nc = await connect(self.url, self.name, self.auth, skip_subject_validation=True, no_echo=True,
                                   reconnected_cb=functools.partial(_set_event, self._reconnected))
                log.info("connected to NATS at %s", redact_url(self.url))
                return nc
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("NATS at %s unreachable (%s); routing on the snapshots held, retrying in %.1f s",
                            redact_url(self.url), exc or type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(self.max_retry_s, delay * 2)

    async def _bootstrap(self, js: JetStreamContext) -> None:
        """Once, at the first connection: make sure the streams and bucket exist (retrying)."""
        delay = self.retry_s
        while not self.closing:
            try:
                await self._prepare(js, self.limits)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot set up JetStream (%s); retrying in %.1f s", exc or type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(self.max_retry_s, delay * 2)

    @staticmethod
    async def _prepare(js: JetStreamContext, limits: StreamLimits | None = None) -> None:
        """Create LB_EVENTS/LB_OUT/LB_WEIGHTS if any is missing (first service up on a fresh server)."""
        try:
            await js.stream_info(sj.EVENTS_STREAM)
            await js.stream_info(sj.OUT_STREAM)
            await js.stream_info(WEIGHTS_STREAM)
        except NotFoundError:
            await ensure_streams(js, limits)

    async def _watch(self, js: JetStreamContext) -> None:
        kv = await js.key_value(sj.WEIGHTS_BUCKET)
        self._reconnected.clear()
        watcher = await kv.watchall()
        try:
            await self._check_stream(js)  # after the watcher exists: it reads this stream or a newer one
            heard = time.monotonic()
            while not self.closing:
                try:
                    entry = await watcher.updates(timeout=min(self.rewatch_s, WATCH_POLL_S))
                except nats.errors.TimeoutError:
                    if self._reconnected.is_set():
                        log.info("NATS connection back and %s silent: watching it anew", sj.WEIGHTS_BUCKET)
                        return
                    if time.monotonic() - heard >= self.rewatch_s:
                        return  # silent too long: re-create the watcher
                    continue
                heard = time.monotonic()
                if entry is None or not self.apply(entry):
                    continue
                if time.monotonic() - self._stream_checked_at < self.stream_check_s:
                    continue
                if await self._check_stream(js) or await self._held_is_forged(js, entry.key):
                    self.apply(entry)  # refused as older than a snapshot that is gone or was never real
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _check_stream(self, js: JetStreamContext) -> bool:
        """Note the identity of LB_WEIGHTS; True (and the table told) if it changed: the stream was recreated."""
        self._stream_checked_at = time.monotonic()
        created = (await js.stream_info(WEIGHTS_STREAM)).created
        known, self.stream_created = self.stream_created, created
        if known is None or created is None or created == known:
            return False
        log.warning("%s was recreated (created %s, was %s): the next snapshot of each pool replaces the one held",
                    WEIGHTS_STREAM, created, known)
        self.table.new_stream()
        return True

    async def _held_is_forged(self, js: JetStreamContext, pool: str) -> bool:
        """True (and the pool forgotten) when the snapshot held for ``pool`` claims an
        ``as_of_seq`` beyond LB_EVENTS' last seq while the refused one does not: no scheduler
        wrote the held one, and "newest wins" would otherwise keep it against every real snapshot."""
        held, refused = self.table.snapshots().get(pool), self.refused
        if held is None or refused is None or refused.pool != pool:
            return False
        last = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        if held.as_of_seq <= last or refused.as_of_seq > last:
            return False
        log.warning("the snapshot held for pool %s claims as_of_seq %d, beyond LB_EVENTS' last seq %d: "
                    "not a scheduler's; replaced by the next one", pool, held.as_of_seq, last)
        self.table.forget(pool)
        return True

    def apply(self, entry: KeyValue.Entry) -> bool:
        """Apply one KV entry; True when it is a snapshot the table refused as not newer than its own."""
        self.last_update = time.monotonic()
        if entry.operation in (KV_DEL, KV_PURGE):
            log.info("pool %s removed from %s", entry.key, sj.WEIGHTS_BUCKET)
            self.table.forget(entry.key)
            return False
        try:
            snapshot = _SNAPSHOT.decode(entry.value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring bad snapshot under %s/%s: %s", sj.WEIGHTS_BUCKET, entry.key, exc)
            return False
        offered = self.table.offer(snapshot, time.monotonic())
        if not offered:
            self.refused = snapshot
            return True
        if offered is Offered.NARROWED:
            # a node left rotation (a drain): say at once which snapshot this proxy routes on, after
            # the events of every admission it made before (the scheduler's drained waits for it)
            self.publisher.heartbeat(self.table.load.total, self.table.applied_seq())
        self.view_lag.observe(max(0.0, (time.time_ns() - snapshot.ts_ns) / 1e9))
        self.installed.set()
        self._viewed(snapshot.pool)
        if self.peers is not None:
            self.peers.wake()  # a pool new to the channel has its first whole view due
        self.picked()
        return False

    def _viewed(self, pool: str) -> None:
        if self.on_view is not None:
            try:
                self.on_view(pool)
            except Exception:  # a bug there must not stop the watch or the channel
                log.exception("waking pool %s after a view change failed", pool)

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Stop ``run``, then drain the connection (bounded); close it when the drain fails or is late."""
        self.closing = True
        if self.peers is not None:
            await self.peers.close()
        if self._task is not None:
            await stop_task(self._task)
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        if not await bounded(nc.drain(), drain_timeout_s, "proxy-nats-drain") or not nc.is_closed:
            log.debug("NATS drain did not finish; closing")
            await bounded(nc.close(), 2.0, "proxy-nats-close")
