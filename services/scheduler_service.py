"""`laswrr scheduler`: the IO shell around the pure core (docs/algorithm.md §6, docs/wire.md).

Theory of operation.

* **One ordered log in, outputs out.** One ephemeral pull consumer on LB_EVENTS (ack policy
  ``all``: one ack per batch acknowledges the batch), read with raw pipelined pull requests
  (``PullReader.next_batch``, services/jsreader.py), delivers inputs in stream order; a
  redelivered seq is dropped, a hole (a delivery lost across a reconnect) is fetched directly
  from the stream, and after a reconnect or an unanswered request the consumer is recreated from
  the next seq to apply. Each message becomes ``Envelope(seq=stream_seq, ts_ns=<JetStream
  timestamp>, subject, data)`` (``envelope_of``: exact integer ns from the ack subject, the same
  ``ts_ns`` the recorder stores, so replay sees the same time) and goes through the core.
* **Batches.** Fetch up to ``batch`` messages, apply them all, publish every output to LB_OUT
  asynchronously with ``Nats-Msg-Id: output.msg_id`` (derived from ``as_of_seq``), await the
  pub acks together (a failure re-sends from the first unacknowledged output, in order), put each
  touched pool's latest snapshot into KV LB_WEIGHTS (compare-and-set, never over a newer
  ``as_of_seq``), then ack the batch. The fold stays exactly-once and gap-free. The output side
  is ``OutputWriter`` (services/output_writer.py).
* **Restart.** State is rebuilt before anything new is published: from the checkpoint in KV
  ``LB_CHECKPOINT`` (``Scheduler.checkpoint()`` bytes, whose state names its ``last_seq``,
  written every ``checkpoint_every`` events and at shutdown) plus the tail of LB_EVENTS, or from
  the first retained event. Outputs are not re-published for inputs whose outputs are already in
  LB_OUT: at start the service reads the highest ``as_of_seq`` among the last messages of LB_OUT
  (the *publish floor*) and publishes only outputs with ``as_of_seq`` above it. Msg-id
  de-duplication alone would not do: its window is 2 minutes, a restart can come much later.
  Between replicas (active-active), the msg ids de-duplicate outputs published within the window.
* **Time.** Once caught up, the service publishes ``lb.clock.tick {"tick": n}`` every
  ``tick_ms`` with ``n = wall-clock ns // period`` and ``Nats-Msg-Id: tick-<n>``: replicas agree
  on ``n``, so JetStream keeps one tick per period. A tick that would change nothing but the
  clock (``Scheduler.tick_changes``: no timer due, no easing step pending, no signal ageing; an
  idle pool) is not published, except one every ``tick_keepalive_ms`` (5 s; the proxies call a
  snapshot older than 10 s stale) counted from the last tick in the log, so an idle stack's log
  does not grow by ten ticks and snapshots a second. A deadline still fires at the first period
  after it: the check runs on the state the log has built, with time passed in, at every period
  unless nothing can have changed its answer (``TickGate``: no input since it said no, and
  before the next time the core says a tick may change something, ``Scheduler.quiet_until``);
  meanwhile the loop sleeps until that time, the keep-alive or the next input applied (then it
  asks at once, in that period).
* **Configuration is an event.** A ``--config`` file that differs from the configuration in force
  in the log is published as ``lb.admin.config {"set": {changed keys}}``, so replay uses it too.
* **Never dies on input.** Invalid input becomes ``lb.out.rejected`` (the core does that). Any
  other exception from the core is a broken invariant: the fold (``scheduler.fold.Fold``, the
  same loop body replay and the other drivers use; ``apply_guarded``, scheduler/core.py)
  records it as a rejection, this service logs it with the seq, and the batch is acked, so one
  poisoned message cannot wedge the stream (and a replay reproduces the same rejection).
* **Never stalls on output.** The core cuts every free-text field of its outputs
  (``schemas.outputs.clip``); an output still over the connection's max payload (less
  ``HEADER_MARGIN_BYTES``) is replaced by a rejection of its input (``schemas.codec.publishable``),
  which replay reproduces, instead of being retried for ever. A publish that keeps failing
  (NATS down) is retried, and logged once per interval (``natsbus.Throttled``), not per try.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client.core import CounterMetricFamily

from laswrr.scheduler import config as config_mod
from laswrr.scheduler.core import Scheduler
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, encode
from laswrr.schemas.words import RejectCause
from laswrr.services import settings
from laswrr.services.jsreader import ConsumerGone, InOrder, PullReader, ack_all_consumer
from laswrr.services.natsbus import (MSG_ID, NatsAuth, StreamLimits, Throttled, connect, ensure_checkpoint_bucket, ensure_streams,
                                     redact_url)
from laswrr.services.output_writer import OutputWriter, highest_published_seq
from laswrr.services.service_metrics import (BATCH_BUCKETS, Buckets, Metric, counter, gauge, histogram, lag,
                                             render, serve_metrics)
from laswrr.services.tasks import stop_task

log = logging.getLogger("laswrr.scheduler")

CHECKPOINT_KEY = "scheduler"


# -- small pure helpers ---------------------------------------------------------------------------


def config_changes(in_force: config_mod.SchedulerConfig, wanted: config_mod.SchedulerConfig) -> dict[str, Any]:
    """Keys whose value in ``wanted`` differs from the configuration in force, in field order."""
    current, desired = msgspec.structs.asdict(in_force), msgspec.structs.asdict(wanted)
    return {key: value for key, value in desired.items() if current[key] != value}


def tick_number(now_ns: int, period_ns: int) -> int:
    return now_ns // period_ns


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# -- the service ----------------------------------------------------------------------------------


@dataclass
class SchedulerOptions:
    config_file: str | None = None
    tick_ms: int = settings.DEFAULT_TICK_MS  # 0: publish no ticks (tests drive time themselves)
    tick_keepalive_ms: int = 5000  # a tick that changes nothing is published only this often; 0: every tick
    replica_id: str = field(default_factory=default_replica_id)
    batch: int = 1000
    fetch_timeout_s: float = 0.25
    checkpoint_every: int = 10_000  # events between checkpoints; 0 disables checkpoints
    use_checkpoint: bool = True
    allow_upstream: tuple[str, ...] | None = None  # --allow-upstream: replaces the config's allow_upstream
    stream_replicas: int = StreamLimits.replicas  # of the streams and buckets it creates (a cluster)


HEADER_MARGIN_BYTES = 1024  # room for the headers (Nats-Msg-Id) within the connection's max payload


@dataclass
class Stats:
    """The service's own counters (what the core did is counted by the fold: ``Fold.applied``,
    ``Fold.rejections`` by cause, ``Fold.faults``)."""

    published: int = 0
    batches: int = 0
    batch_seconds: Buckets = field(default_factory=lambda: Buckets(BATCH_BUCKETS))
    checkpointed_at: float = field(default_factory=time.time)  # wall time of the last checkpoint (or start)


class TickGate:
    """Which periods' ticks the service publishes (module header, "Time"); pure: the caller
    passes the time in and tells it each input applied (``applied``).

    A tick is due when ``Scheduler.tick_changes`` says it would change the state, or as the
    keep-alive, ``keepalive_ns`` after the last tick (0: every tick is due). The trial (a tick
    on a copy of the state, ~0.5 ms for 16 nodes) is not repeated while nothing can have
    changed its answer: once it said no at a seq, no input applied since, and before the
    ``Scheduler.quiet_until`` it gave (``quiet``). A tick that came within that span changed the
    clock alone, so the span holds after it too. ``next_due_ns``: the first time a tick may be
    due if no input comes, for the loop to sleep until."""

    def __init__(self, keepalive_ns: int) -> None:
        self.keepalive_ns = keepalive_ns
        self.last_tick_ns = 0  # wall time of the last tick published, or event time of the last one applied
        # (applied seq, wall time, Scheduler.quiet_until) once a tick tried then at that seq
        # changed nothing: no trial between the two times while no input is applied
        self.quiet: tuple[int, int, int | None] | None = None

    def due(self, scheduler: Scheduler, now_ns: int) -> bool:
        """Publish a tick at ``now_ns``? Yes when it would change the state, or as the keep-alive."""
        keepalive = self.keepalive_ns <= 0 or now_ns - self.last_tick_ns >= self.keepalive_ns
        if not keepalive and not self._changes(scheduler, now_ns):
            return False
        self.last_tick_ns = now_ns
        return True

    def _changes(self, scheduler: Scheduler, now_ns: int) -> bool:
        seq = scheduler.state.last_seq
        if self._quiet_at(seq, now_ns):
            return False
        if scheduler.tick_changes(now_ns):
            self.quiet = None
            return True
        self.quiet = (seq, now_ns, scheduler.quiet_until(now_ns))
        return False

    def _quiet_at(self, seq: int, now_ns: int) -> bool:
        """A tick at ``now_ns`` on the state after ``seq`` changes nothing but the clock, by ``quiet``."""
        if self.quiet is None:
            return False
        quiet_seq, tried_ns, until_ns = self.quiet
        return quiet_seq == seq and tried_ns <= now_ns and (until_ns is None or now_ns < until_ns)

    def applied(self, envelope: Envelope) -> None:
        """An input was applied: the state is quiet no longer, unless it is a tick within the span."""
        if envelope.subject != sj.CLOCK_TICK:
            return
        self.last_tick_ns = max(self.last_tick_ns, envelope.ts_ns)
        if self.quiet is not None and self._quiet_at(envelope.seq - 1, envelope.ts_ns):
            self.quiet = (envelope.seq, *self.quiet[1:])

    def next_due_ns(self, applied_seq: int) -> int:
        """The wall time from which a tick may be due with no input before it: the keep-alive's,
        or sooner the end of the quiet span; 0 (now) unless a trial found the state at
        ``applied_seq`` quiet."""
        if self.keepalive_ns <= 0 or self.quiet is None or self.quiet[0] != applied_seq:
            return 0
        until = self.quiet[2]
        keepalive_at = self.last_tick_ns + self.keepalive_ns
        return keepalive_at if until is None else min(until, keepalive_at)


class SchedulerService:
    """One scheduler replica. ``await run(stop)`` until ``stop`` is set; ``ready`` is set once
    the state is rebuilt from the log and live processing (and ticking) has begun."""

    def __init__(self, nc: Client, options: SchedulerOptions | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.options = options or SchedulerOptions()
        self.fold = Fold()
        self.publish_floor = 0
        self.ready = asyncio.Event()
        self.stats = Stats()
        self._wanted_config = config_mod.load_file(self.options.config_file) if self.options.config_file else None
        self._checkpoints: KeyValue | None = None
        self._writer = OutputWriter(self.js)
        self._reader = PullReader(nc, self.js, sj.EVENTS_STREAM, self.options.batch)
        self._ordered = InOrder(nc, sj.EVENTS_STREAM)
        self._stopping = asyncio.Event()
        self._tick_failing = False
        self._checkpoint_failing = Throttled(log)
        self._tick_tasks: set[asyncio.Task[Any]] = set()
        self._checkpointed_seq = 0
        self._gate = TickGate(self.options.tick_keepalive_ms * 1_000_000)
        self._input = asyncio.Event()  # set at each input applied: wakes a resting tick loop

    @property
    def scheduler(self) -> Scheduler:
        return self.fold.scheduler

    @property
    def applied_seq(self) -> int:
        return self.scheduler.state.last_seq

    @property
    def checkpointed_seq(self) -> int:
        return self._checkpointed_seq

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._stopping = stop
        await ensure_streams(self.js, StreamLimits(replicas=self.options.stream_replicas))
        await self._writer.open()
        self._checkpoints = await ensure_checkpoint_bucket(self.js, self.options.stream_replicas)
        await self._restore()
        self.publish_floor = await highest_published_seq(self.js)
        target = (await self.js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        log.info("replica %s: rebuilding from seq %d to %d; outputs already published up to seq %d",
                 self.options.replica_id, self.applied_seq + 1, target, self.publish_floor)
        await self._subscribe()
        ticker: asyncio.Task[None] | None = None
        try:
            while not stop.is_set():
                got = await self._step()
                if not self.ready.is_set() and (self.applied_seq >= target or not got):
                    await self._go_live()
                    if self.options.tick_ms > 0:
                        ticker = asyncio.create_task(self._tick_loop(stop))
        finally:
            if ticker is not None:
                await stop_task(ticker)  # a cancel inside a JetStream publish can be lost (services/tasks.py)
            for task in list(self._tick_tasks):
                task.cancel()
            await self._shutdown()

    async def _go_live(self) -> None:
        await self._writer.flush_weights()
        log.info("state rebuilt at seq %d (%d pools, %d nodes); live", self.applied_seq,
                 len(self.scheduler.pools()), len(self.scheduler.state.nodes))
        await self._publish_config()
        self.ready.set()

    async def _shutdown(self) -> None:
        if self.options.checkpoint_every > 0 and self.applied_seq > self._checkpointed_seq and not self._writer.gave_up:
            with contextlib.suppress(Exception):
                await self._write_checkpoint()
        await self._reader.close(delete_consumer=True)
        log.info("stopped at seq %d (%d events applied, %d outputs published)",
                 self.applied_seq, self.fold.applied, self.stats.published)

    # -- rebuild --------------------------------------------------------------------------------

    async def _restore(self) -> None:
        info = (await self.js.stream_info(sj.EVENTS_STREAM)).state
        restored = await self._load_checkpoint() if self.options.use_checkpoint else None
        if restored is not None and restored.state.last_seq > info.last_seq:
            log.warning("checkpoint at seq %d is ahead of LB_EVENTS (last %d): ignored",
                        restored.state.last_seq, info.last_seq)
        elif restored is not None:
            self.fold.scheduler, self._checkpointed_seq = restored, restored.state.last_seq
            log.info("restored checkpoint at seq %d", self._checkpointed_seq)
        start = self.applied_seq + 1
        if info.first_seq > start and info.messages > 0:
            log.warning("LB_EVENTS no longer holds seqs %d..%d (retention): state starts from an incomplete log",
                        start, info.first_seq - 1)

    async def _load_checkpoint(self) -> Scheduler | None:
        assert self._checkpoints is not None
        try:
            entry = await self._checkpoints.get(CHECKPOINT_KEY)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return Scheduler.restore(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # an older state layout
            log.warning("checkpoint not readable (%s): rebuilding from the log", exc)
            return None

    async def _subscribe(self) -> None:
        """An ephemeral AckAll pull consumer from the next seq to apply (recreated after errors)."""
        first = (await self.js.stream_info(sj.EVENTS_STREAM)).state.first_seq
        self._ordered.next_seq = max(self.applied_seq + 1, first)  # older seqs are gone (retention)
        name = f"scheduler-{_token(self.options.replica_id)}-{os.urandom(4).hex()}"
        await self._reader.open(ack_all_consumer(self.applied_seq + 1, name=name, inactive_threshold=60.0,
                                                 mem_storage=True, num_replicas=1))

    # -- the batch loop -------------------------------------------------------------------------

    async def _step(self) -> bool:
        """Fetch, apply and publish one batch; False when nothing was waiting."""
        try:
            msgs = await self._reader.next_batch(self.options.fetch_timeout_s)
            if msgs:
                await self._handle_batch(msgs)
        except (ConsumerGone, nats.errors.Error, asyncio.TimeoutError) as exc:
            # consumer deleted (server restart, inactivity), connection trouble: start over from
            # the next seq to apply; nothing is lost since the unapplied tail is still unacked.
            log.warning("consumer trouble (%s); recreating it from seq %d", exc, self.applied_seq + 1)
            await asyncio.sleep(0.5)
            with contextlib.suppress(Exception):
                await self._subscribe()
            return False
        return bool(msgs)

    async def _handle_batch(self, msgs: list[Msg]) -> None:
        started = time.perf_counter()
        envelopes = await self._in_order(msgs)
        outputs = self._apply_all(envelopes)
        self.stats.published += await self._writer.publish(outputs, self._stopping)
        await self._writer.flush_weights()
        await self.nc.publish(msgs[-1].reply, b"+ACK")  # AckPolicy.ALL: acks the whole batch
        self.stats.batches += 1
        self.stats.batch_seconds.observe(time.perf_counter() - started)
        every = self.options.checkpoint_every
        if every > 0 and self.applied_seq - self._checkpointed_seq >= every:
            await self._write_checkpoint()

    async def _in_order(self, msgs: list[Msg]) -> list[Envelope]:
        """Envelopes in stream order, exactly once (``InOrder``: redeliveries dropped, holes fetched)."""
        return await self._ordered.envelopes(msgs)

    def _apply_all(self, envelopes: list[Envelope]) -> list[Output]:
        to_publish: list[Output] = []
        limit = self.nc.max_payload - HEADER_MARGIN_BYTES
        fold = self.fold
        for envelope in envelopes:
            outputs = fold.apply(envelope, limit)
            if fold.fault is not None:
                # A broken invariant in the core, not bad input (that is a Rejection inside apply):
                # recorded as rejected by the fold, logged loudly here, and the batch is acked.
                # The core is deterministic, so every replica (and a replay) fails the same way.
                log.error("seq %d (%s): the scheduler core raised; recorded as rejected", envelope.seq,
                          envelope.subject, exc_info=fold.fault)
            self._writer.note(outputs)
            self._gate.applied(envelope)
            self._input.set()
            if envelope.seq > self.publish_floor:
                to_publish.extend(outputs)
        return to_publish

    # -- checkpoints, configuration, ticks ------------------------------------------------------

    async def _write_checkpoint(self) -> None:
        assert self._checkpoints is not None
        try:
            await self._checkpoints.put(CHECKPOINT_KEY, self.scheduler.checkpoint())
        except Exception as exc:  # a checkpoint is an optimisation: never fatal
            self._checkpoint_failing.failed("checkpoint at seq %d not written: %r", self.applied_seq, exc)
            return
        self._checkpoint_failing.ok("checkpoint written again at seq %d", self.applied_seq)
        self._checkpointed_seq = self.applied_seq
        self.stats.checkpointed_at = time.time()

    @property
    def _allow_text(self) -> str:
        return ",".join(self.options.allow_upstream or ())

    def _wanted(self) -> config_mod.SchedulerConfig | None:
        """The ``--config`` file's configuration, with ``--allow-upstream`` over it."""
        if self.options.allow_upstream is None:
            return self._wanted_config
        base = self._wanted_config or self.scheduler.config
        return config_mod.with_changes(base, {"allow_upstream": self._allow_text})

    async def _publish_config(self) -> None:
        await self._publish_wanted_config()
        if not self.scheduler.config.allow_upstream and self.options.allow_upstream is None:
            log.warning("no --allow-upstream: lb.admin.node may register any upstream host; "
                        "give the engines' hosts or CIDR blocks to refuse the others")

    async def _publish_wanted_config(self) -> None:
        wanted = self._wanted()
        if wanted is None:
            return
        changes = config_changes(self.scheduler.config, wanted)
        if not changes:
            log.info("configuration %s is already in force", self.options.config_file or "--allow-upstream")
            return
        payload = encode({"set": changes})
        digest = hashlib.sha256(payload).hexdigest()[:16]
        msg_id = f"config-{self.applied_seq}-{digest}"  # replicas started together publish it once
        ack = await self.js.publish(sj.ADMIN_CONFIG, payload, headers={MSG_ID: msg_id})
        log.info("published configuration %s as seq %d: %s", self.options.config_file or "--allow-upstream", ack.seq,
                 sorted(changes))

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        period_ns = self.options.tick_ms * 1_000_000
        last = -1
        while not stop.is_set():
            now_ns = time.time_ns()
            n = tick_number(now_ns, period_ns)
            if n != last:
                last = n
                if self._gate.due(self.scheduler, now_ns):
                    await self._publish_tick(n)
            # the next period, or the first one at or after the next time a tick may be due
            wake = max(n + 1, -(-self._gate.next_due_ns(self.applied_seq) // period_ns))
            delay_s = max(0.0, (wake * period_ns - time.time_ns()) / 1e9)
            if wake == n + 1:
                await asyncio.sleep(delay_s)
            else:  # resting: an input applied meanwhile wakes the loop, which asks at once (once a period)
                self._input.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._input.wait(), delay_s)

    async def _publish_tick(self, n: int) -> None:
        """Fire and forget (a late tick is useless; the next period brings the next one)."""
        task = asyncio.create_task(self.js.publish(sj.CLOCK_TICK, b'{"tick":%d}' % n, timeout=1.0,
                                                   headers={MSG_ID: f"tick-{n}"}))
        self._tick_tasks.add(task)
        task.add_done_callback(lambda done: self._tick_done(n, done))

    def _tick_done(self, n: int, task: asyncio.Task[Any]) -> None:
        self._tick_tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            if not self._tick_failing:  # once per outage, not ten times a second
                log.warning("tick %d not published (%s); retrying every period", n, exc or type(exc).__name__)
            self._tick_failing = True
        elif self._tick_failing and not task.cancelled():
            log.info("ticks published again from tick %d", n)
            self._tick_failing = False


# -- /metrics (services/service_metrics.py) ------------------------------------------------------


async def render_metrics(service: SchedulerService) -> bytes:
    """The counters as they are now, then the lag behind the seq applied at that moment (the
    look-ups yield to the batch loop, which may move on meanwhile)."""
    applied_seq, families = service.applied_seq, list(_families(service))
    behind, behind_s = await lag(service.js, sj.EVENTS_STREAM, applied_seq)
    families += [gauge("laswrr_scheduler_lag_messages", "Events in LB_EVENTS not yet applied", behind),
                 gauge("laswrr_scheduler_lag_seconds", "Age of the oldest event not yet applied", behind_s)]
    return render(lambda: iter(families))


def _families(service: SchedulerService) -> Iterator[Metric]:
    stats = service.stats
    fold = service.fold
    yield counter("laswrr_scheduler_events_applied", "Events of LB_EVENTS applied to the core", fold.applied)
    yield counter("laswrr_scheduler_outputs_published", "Outputs acknowledged by LB_OUT", stats.published)
    rejections = CounterMetricFamily("laswrr_scheduler_rejections", "Inputs rejected, by cause (Rejected.cause)",
                                     labels=["reason"])
    for cause in RejectCause:  # every cause, 0 included: a bounded set of series
        rejections.add_metric([cause.value], fold.rejections[cause])
    yield rejections
    yield gauge("laswrr_scheduler_applied_seq", "Stream seq of the last applied event", service.applied_seq)
    yield gauge("laswrr_scheduler_checkpoint_age_seconds", "Time since the last checkpoint (or start)",
                max(0.0, time.time() - stats.checkpointed_at))
    yield gauge("laswrr_scheduler_checkpoint_lag_events", "Events applied since the last checkpoint",
                service.applied_seq - service.checkpointed_seq)
    yield histogram("laswrr_scheduler_batch_seconds", "One batch: apply, publish, KV, ack", stats.batch_seconds)


# -- NATS helpers ---------------------------------------------------------------------------------


def _token(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:48] or "replica"


# -- command line ---------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("scheduler", help="run the scheduler service on NATS JetStream",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_nats_options(parser)
    parser.add_argument("--config", metavar="FILE.toml", help="scheduler configuration to put in force")
    parser.add_argument("--tick-ms", type=settings.duration("ms"), default=SchedulerOptions.tick_ms,
                        help="tick period in ms (default %(default)s; 0 publishes no ticks)")
    parser.add_argument("--tick-keepalive-ms", type=settings.duration("ms"), default=SchedulerOptions.tick_keepalive_ms,
                        help="a tick that would change nothing (an idle pool) is published only this often "
                             "(default %(default)s; 0: every tick)")
    parser.add_argument("--replica-id", default=None, help="name of this replica (default host-pid)")
    parser.add_argument("--batch", type=int, default=SchedulerOptions.batch,
                        help="events fetched per batch (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=SchedulerOptions.checkpoint_every,
                        help=f"events between checkpoints in KV {sj.CHECKPOINT_BUCKET} (0 = none; default %(default)s)")
    parser.add_argument("--no-checkpoint", action="store_true", help="rebuild from the first retained event")
    settings.add_stream_replicas(parser)
    settings.add_metrics_port(parser)
    parser.add_argument("--allow-upstream", action="append", default=None, metavar="PATTERN",
                        help="a host, host:port or CIDR block that lb.admin.node URLs may name (repeatable; "
                             "published as the configuration key allow_upstream; default: the key in force, "
                             "empty = any host)")
    settings.add_logging(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "scheduler")
    if args.tick_ms < 0 or args.tick_keepalive_ms < 0 or args.batch < 1 or args.checkpoint_every < 0:
        log.error("--tick-ms, --tick-keepalive-ms and --checkpoint-every must be >= 0, --batch >= 1")
        return 2
    try:
        options = SchedulerOptions(config_file=args.config, tick_ms=args.tick_ms, batch=args.batch,
                                   tick_keepalive_ms=args.tick_keepalive_ms,
                                   checkpoint_every=args.checkpoint_every, use_checkpoint=not args.no_checkpoint,
                                   replica_id=args.replica_id or default_replica_id(),
                                   allow_upstream=_patterns(args.allow_upstream), stream_replicas=args.stream_replicas)
        if options.config_file:
            config_mod.load_file(options.config_file)
    except (OSError, ValueError) as exc:
        print(f"laswrr scheduler: bad --config {args.config}: {exc}", file=sys.stderr)
        return 2
    if options.allow_upstream is not None:
        try:
            config_mod.with_changes(config_mod.SchedulerConfig(), {"allow_upstream": ",".join(options.allow_upstream)})
        except ValueError as exc:
            print(f"laswrr scheduler: bad --allow-upstream: {exc}", file=sys.stderr)
            return 2
    return asyncio.run(serve(args.nats_url, options, args.metrics_port, settings.nats_auth(args)))


def _patterns(values: list[str] | None) -> tuple[str, ...] | None:
    """Repeated ``--allow-upstream`` values (each may itself be comma-separated)."""
    if values is None:
        return None
    return tuple(p.strip() for value in values for p in value.split(",") if p.strip())


async def _log_nats_error(exc: Exception) -> None:
    log.warning("NATS: %s", exc or type(exc).__name__)


async def serve(nats_url: str, options: SchedulerOptions, metrics_port: int | None = None,
                auth: NatsAuth | None = None) -> int:
    stop = settings.stop_event()
    try:
        nc = await connect(nats_url, f"laswrr-scheduler-{options.replica_id}", auth, error_cb=_log_nats_error)
    except Exception as exc:
        log.error("cannot connect to %s: %s", redact_url(nats_url), exc)
        return 1
    service = SchedulerService(nc, options)
    runner = None
    try:
        if metrics_port is not None:
            runner = await serve_metrics(metrics_port, lambda: render_metrics(service), service="scheduler")
        await service.run(stop)
    finally:
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 10)
    return 0
