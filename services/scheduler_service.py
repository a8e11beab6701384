"""`laswrr scheduler`: the IO shell around the pure core (design §3, §7).

Theory of operation.

* **One ordered log in, outputs out.** One ephemeral pull consumer on LB_EVENTS (ack policy
  ``all``: one ack per batch acknowledges the batch), read with raw pipelined pull requests
  (``Puller``), delivers inputs in stream order; a redelivered seq is dropped, a hole (a delivery
  lost across a reconnect) is fetched directly from the stream, and after a reconnect or an
  unanswered request the consumer is recreated from the next seq to apply. Each message
  becomes ``Envelope(seq=stream_seq, ts_ns=<JetStream timestamp>, subject, data)`` and goes through
  ``Scheduler.apply``. The timestamp is taken as integer nanoseconds from the ack reply subject
  (``parse_ack_subject``; nats-py's ``metadata.timestamp`` is a float datetime and loses
  precision), the same ``ts_ns`` the recorder stores, so replay sees the same time.
* **Batches.** Fetch up to ``batch`` messages, apply them all, publish every output to LB_OUT
  asynchronously with ``Nats-Msg-Id: output.msg_id`` (derived from ``as_of_seq``), await the
  pub acks together (a failure re-sends from the first unacknowledged output, in order), put each
  touched pool's latest snapshot into KV LB_WEIGHTS (compare-and-set, never over a newer
  ``as_of_seq``), then ack the batch. The fold stays exactly-once and gap-free.
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
  on ``n``, so JetStream keeps one tick per period.
* **Configuration is an event.** A ``--config`` file that differs from the configuration in force
  in the log is published as ``lb.admin.config {"set": {changed keys}}``, so replay uses it too.
* **Never dies on input.** Invalid input becomes ``lb.out.rejected`` (the core does that). Any
  other exception from the core is a broken invariant: ``apply_guarded`` (scheduler/core.py)
  records it as a rejection, this service logs it with the seq, and the batch is acked, so one
  poisoned message cannot wedge the stream (and a replay reproduces the same rejection).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from scheduler import config as config_mod
from scheduler.core import Scheduler, apply_guarded
from schemas import subjects as sj
from schemas.codec import Envelope, Output, encode
from services import settings
from services.natsbus import connect, ensure_streams

log = logging.getLogger("laswrr.scheduler")

CHECKPOINT_KEY = "scheduler"
PUBLISH_FLOOR_SCAN = 64  # LB_OUT tail messages read at start to find the highest as_of_seq
PUBLISH_TIMEOUT_S = 5.0


# -- the JetStream ack subject --------------------------------------------------------------------


class AckInfo(NamedTuple):
    """The metadata JetStream encodes in a delivered message's reply (ack) subject."""

    stream: str
    consumer: str
    delivered: int
    stream_seq: int
    consumer_seq: int
    ts_ns: int
    pending: int
    domain: str | None = None


def parse_ack_subject(reply: str) -> AckInfo:
    """Parse ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts_ns>.<pending>`` (v1) or
    ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts_ns>.<pending>
    [.<random>]`` (v2, ADR-15; domain ``_`` means none). The timestamp stays an exact integer.

    v1 has exactly 9 tokens, v2 at least 11; the seven fields are read at a fixed offset after
    the prefix (the trailing v2 token is optional, so counting from the right is ambiguous).
    Raises ValueError for anything else.
    """
    tokens = reply.split(".")
    count = len(tokens)
    if count < 9 or tokens[0] != "$JS" or tokens[1] != "ACK" or count == 10:
        raise ValueError(f"not a JetStream ack subject: {reply!r}")
    base, domain = (2, None) if count == 9 else (4, None if tokens[2] in ("", "_") else tokens[2])
    try:
        return AckInfo(tokens[base], tokens[base + 1], int(tokens[base + 2]), int(tokens[base + 3]),
                       int(tokens[base + 4]), int(tokens[base + 5]), int(tokens[base + 6]), domain)
    except ValueError:
        raise ValueError(f"non-numeric field in JetStream ack subject: {reply!r}") from None


def envelope_of(msg: Msg) -> Envelope:
    info = parse_ack_subject(msg.reply)
    return Envelope(seq=info.stream_seq, ts_ns=info.ts_ns, subject=msg.subject, data=msg.data)


# -- small pure helpers ---------------------------------------------------------------------------


def as_of_seq_of(msg_id: str | None, data: bytes | None) -> int:
    """The cause of an LB_OUT message: from its msg id ``<as_of_seq>:<subject>``, else its payload."""
    if msg_id:
        head = msg_id.split(":", 1)[0]
        if head.isdigit():
            return int(head)
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        payload = msgspec.json.decode(data or b"", type=dict[str, Any])
        value = payload.get("as_of_seq", payload.get("seq"))
        if isinstance(value, int):
            return value
    return 0


def config_changes(in_force: config_mod.SchedulerConfig, wanted: config_mod.SchedulerConfig) -> dict[str, Any]:
    """Keys whose value in ``wanted`` differs from the configuration in force, in field order."""
    current, desired = msgspec.structs.asdict(in_force), msgspec.structs.asdict(wanted)
    return {key: value for key, value in desired.items() if current[key] != value}


def tick_number(now_ns: int, period_ns: int) -> int:
    return now_ns // period_ns


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# -- reading the stream ---------------------------------------------------------------------------


def parse_rfc3339_ns(text: str) -> int:
    """``2026-05-01T10:00:00.123456789Z`` (or with ``+hh:mm``) -> integer ns since the epoch."""
    text = text.strip()
    offset_s = 0
    if text[-1] in "Zz":
        text = text[:-1]
    elif len(text) > 6 and text[-6] in "+-" and text[-3] == ":":
        sign = 1 if text[-6] == "+" else -1
        offset_s = sign * (int(text[-5:-3]) * 3600 + int(text[-2:]) * 60)
        text = text[:-6]
    whole, _, fraction = text.partition(".")
    base = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return (int(base.timestamp()) - offset_s) * 1_000_000_000 + int((fraction or "0")[:9].ljust(9, "0"))


class ConsumerGone(RuntimeError):
    """The pull consumer was deleted or stopped answering: recreate it from the next seq."""


class Puller:
    """Raw ``$JS.API.CONSUMER.MSG.NEXT`` requests into a callback buffer.

    nats-py's ``fetch`` costs several loop wake-ups per message; here a whole batch arrives
    through one subscription callback and the next request is sent before the batch is applied,
    so the server streams while the core works. One request is outstanding at a time, so at most
    two batches are buffered (the subscription's pending limits are far above that).
    """

    STATUS_DONE = frozenset({"404", "408", "409"})  # no messages / request expired / request ended

    def __init__(self, nc: Client, stream: str, consumer: str, batch: int, expires_s: float = 2.0) -> None:
        self.nc, self.stream, self.consumer = nc, stream, consumer
        self.batch, self.expires_s = batch, expires_s
        self._inbox = nc.new_inbox()
        self._sub: Any = None
        self._n = 0
        self._current = ""  # reply subject of the outstanding request ("" = none)
        self._remaining = 0
        self._deadline = 0.0
        self._buffer: list[Msg] = []
        self._wake = asyncio.Event()
        self._gone: str | None = None
        self._reconnects = nc.stats["reconnects"]  # a reconnect may have lost the request or consumer

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg,
                                            pending_msgs_limit=20 * self.batch + 1000, pending_bytes_limit=-1)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers and not msg.data else None
        if status is None:
            self._buffer.append(msg)
            self._remaining -= 1
            if self._remaining <= 0:
                self._current = ""
        elif status in self.STATUS_DONE or status == "503":
            description = msg.headers.get("Description", "") if msg.headers else ""
            if status == "503" or "Deleted" in description:
                self._gone = f"{status} {description}".strip()
            if msg.subject == self._current:
                self._current = ""
        else:
            return  # 100: idle heartbeat / flow control
        self._wake.set()

    async def _pull(self) -> None:
        self._n += 1
        self._current = f"{self._inbox}.{self._n}"
        self._remaining = self.batch
        self._deadline = time.monotonic() + self.expires_s + 2.0
        body = b'{"batch":%d,"expires":%d}' % (self.batch, int(self.expires_s * 1e9))
        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}", body, reply=self._current)

    async def next_batch(self, max_wait_s: float) -> list[Msg]:
        """The messages delivered so far (in stream order), waiting up to ``max_wait_s`` for one."""
        if self.nc.stats["reconnects"] != self._reconnects:
            raise ConsumerGone("reconnected to NATS")
        if self._current and time.monotonic() > self._deadline:
            raise ConsumerGone(f"pull request unanswered for {self.expires_s + 2:g} s")
        if not self._current:
            await self._pull()
        if not self._buffer:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max_wait_s)
        if self._gone and not self._buffer:
            raise ConsumerGone(self._gone)
        taken, self._buffer = self._buffer, []
        if not self._current:
            await self._pull()  # the next batch flows while this one is applied
        return taken


async def get_envelope(nc: Client, stream: str, seq: int) -> Envelope | None:
    """One stored message by seq with its exact timestamp (``STREAM.MSG.GET``); None if absent."""
    reply = await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", b'{"seq":%d}' % seq, timeout=5.0)
    answer = msgspec.json.decode(reply.data, type=dict[str, Any])
    message = answer.get("message")
    if not message:
        return None
    data = base64.b64decode(message.get("data") or "")
    return Envelope(seq=seq, ts_ns=parse_rfc3339_ns(message["time"]), subject=message["subject"], data=data)


# -- the service ----------------------------------------------------------------------------------


@dataclass
class SchedulerOptions:
    config_file: str | None = None
    tick_ms: int = settings.DEFAULT_TICK_MS  # 0: publish no ticks (tests drive time themselves)
    replica_id: str = field(default_factory=default_replica_id)
    batch: int = 1000
    fetch_timeout_s: float = 0.25
    checkpoint_every: int = 10_000  # events between checkpoints; 0 disables checkpoints
    use_checkpoint: bool = True


@dataclass
class Stats:
    applied: int = 0
    published: int = 0
    rejected_internal: int = 0
    batches: int = 0


class SchedulerService:
    """One scheduler replica. ``await run(stop)`` until ``stop`` is set; ``ready`` is set once
    the state is rebuilt from the log and live processing (and ticking) has begun."""

    def __init__(self, nc: Client, options: SchedulerOptions | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.options = options or SchedulerOptions()
        self.scheduler = Scheduler()
        self.publish_floor = 0
        self.ready = asyncio.Event()
        self.stats = Stats()
        self._wanted_config = config_mod.load_file(self.options.config_file) if self.options.config_file else None
        self._weights: KeyValue | None = None
        self._checkpoints: KeyValue | None = None
        self._kv_known: dict[str, tuple[int, int]] = {}  # pool -> (as_of_seq, revision) in LB_WEIGHTS
        self._latest: dict[str, Output] = {}  # pool -> newest snapshot output not yet in LB_WEIGHTS
        self._puller: Puller | None = None
        self._consumer: str | None = None
        self._next_seq = 1  # the seq expected next; a later one means messages to fetch directly
        self._stopping = asyncio.Event()
        self._unpublished = False  # outputs given up at shutdown: no checkpoint past them
        self._tick_failing = False
        self._tick_tasks: set[asyncio.Task[Any]] = set()
        self._checkpointed_seq = 0

    @property
    def applied_seq(self) -> int:
        return self.scheduler.state.last_seq

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._stopping = stop
        await ensure_streams(self.js)
        self._weights = await self.js.key_value(sj.WEIGHTS_BUCKET)
        self._checkpoints = await ensure_checkpoint_bucket(self.js)
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
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            for task in list(self._tick_tasks):
                task.cancel()
            await self._shutdown()

    async def _go_live(self) -> None:
        await self._flush_weights()
        log.info("state rebuilt at seq %d (%d pools, %d nodes); live", self.applied_seq,
                 len(self.scheduler.pools()), len(self.scheduler.state.nodes))
        await self._publish_config()
        self.ready.set()

    async def _shutdown(self) -> None:
        if self.options.checkpoint_every > 0 and self.applied_seq > self._checkpointed_seq and not self._unpublished:
            with contextlib.suppress(Exception):
                await self._write_checkpoint()
        if self._puller is not None:
            await self._puller.stop()
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(sj.EVENTS_STREAM, self._consumer)
        log.info("stopped at seq %d (%d events applied, %d outputs published)",
                 self.applied_seq, self.stats.applied, self.stats.published)

    # -- rebuild --------------------------------------------------------------------------------

    async def _restore(self) -> None:
        info = (await self.js.stream_info(sj.EVENTS_STREAM)).state
        restored = await self._load_checkpoint() if self.options.use_checkpoint else None
        if restored is not None and restored.state.last_seq > info.last_seq:
            log.warning("checkpoint at seq %d is ahead of LB_EVENTS (last %d): ignored",
                        restored.state.last_seq, info.last_seq)
        elif restored is not None:
            self.scheduler, self._checkpointed_seq = restored, restored.state.last_seq
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
        if self._puller is not None:
            await self._puller.stop()
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(sj.EVENTS_STREAM, self._consumer)
        first = (await self.js.stream_info(sj.EVENTS_STREAM)).state.first_seq
        self._next_seq = max(self.applied_seq + 1, first)  # older seqs are gone (retention)
        name = f"scheduler-{_token(self.options.replica_id)}-{os.urandom(4).hex()}"
        config = ConsumerConfig(
            name=name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.applied_seq + 1,
            ack_policy=AckPolicy.ALL, ack_wait=60.0, max_ack_pending=-1, inactive_threshold=60.0,
            mem_storage=True, num_replicas=1,
        )
        await self.js.add_consumer(sj.EVENTS_STREAM, config)
        self._consumer = name
        self._puller = Puller(self.nc, sj.EVENTS_STREAM, name, self.options.batch)
        await self._puller.start()

    # -- the batch loop -------------------------------------------------------------------------

    async def _step(self) -> bool:
        """Fetch, apply and publish one batch; False when nothing was waiting."""
        assert self._puller is not None
        try:
            msgs = await self._puller.next_batch(self.options.fetch_timeout_s)
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
        envelopes = await self._in_order(msgs)
        outputs = self._apply_all(envelopes)
        await self._publish(outputs)
        await self._flush_weights()
        await self.nc.publish(msgs[-1].reply, b"+ACK")  # AckPolicy.ALL: acks the whole batch
        self.stats.batches += 1
        every = self.options.checkpoint_every
        if every > 0 and self.applied_seq - self._checkpointed_seq >= every:
            await self._write_checkpoint()

    async def _in_order(self, msgs: list[Msg]) -> list[Envelope]:
        """Envelopes in stream order, exactly once: redeliveries dropped, holes (messages delivered
        but lost on the way, e.g. across a reconnect) fetched from the stream directly."""
        envelopes: list[Envelope] = []
        for msg in msgs:
            try:
                envelope = envelope_of(msg)
            except ValueError as exc:
                log.error("skipping a delivery without JetStream metadata: %s", exc)
                continue
            if envelope.seq < self._next_seq:
                continue  # redelivered: already folded in
            if envelope.seq > self._next_seq:
                envelopes.extend(await self._fill(self._next_seq, envelope.seq - 1))
            envelopes.append(envelope)
            self._next_seq = envelope.seq + 1
        return envelopes

    async def _fill(self, first: int, last: int) -> list[Envelope]:
        found = []
        for seq in range(first, last + 1):
            envelope = await get_envelope(self.nc, sj.EVENTS_STREAM, seq)
            if envelope is not None:
                found.append(envelope)
        log.warning("seqs %d..%d missing from the delivery: %d fetched directly, %d no longer in the stream",
                    first, last, len(found), last - first + 1 - len(found))
        return found

    def _apply_all(self, envelopes: list[Envelope]) -> list[Output]:
        to_publish: list[Output] = []
        for envelope in envelopes:
            outputs = self._apply(envelope)
            self.stats.applied += 1
            for output in outputs:
                if output.subject.startswith(sj.OUT_SNAPSHOT + "."):
                    self._latest[output.subject[len(sj.OUT_SNAPSHOT) + 1:]] = output
            if envelope.seq > self.publish_floor:
                to_publish.extend(outputs)
        return to_publish

    def _apply(self, envelope: Envelope) -> list[Output]:
        outputs, exc = apply_guarded(self.scheduler, envelope)
        if exc is not None:
            # A broken invariant in the core, not bad input (that is a Rejection inside apply):
            # recorded as rejected by apply_guarded, logged loudly here, and the batch is acked.
            # The core is deterministic, so every replica (and a replay) fails the same way.
            log.error("seq %d (%s): the scheduler core raised; recorded as rejected", envelope.seq,
                      envelope.subject, exc_info=exc)
            self.stats.rejected_internal += 1
        return outputs

    async def _publish(self, outputs: Sequence[Output]) -> None:
        """Publish outputs in order, pub acks awaited together. On a failure everything from the
        first unacknowledged output on is sent again (msg ids de-duplicate), so LB_OUT keeps the
        order; retried until it succeeds or the service is stopping (then the next start publishes
        them: they lie above its publish floor)."""
        pending = list(outputs)
        attempt = 0
        while pending:
            acked = await self._publish_once(pending)
            self.stats.published += acked
            pending = pending[acked:]
            if not pending:
                return
            attempt += 1
            if self._stopping.is_set():
                log.error("stopping with %d outputs unpublished (from seq %d): the next start publishes them",
                          len(pending), pending[0].as_of_seq)
                self._unpublished = True
                return
            log.warning("%d outputs not acknowledged by LB_OUT (from seq %d); retry %d", len(pending),
                        pending[0].as_of_seq, attempt)
            await asyncio.sleep(min(2.0, 0.1 * attempt))

    async def _publish_once(self, outputs: Sequence[Output]) -> int:
        """The number of leading outputs whose pub acks arrived."""
        futures: list[asyncio.Future[Any]] = []
        try:
            for output in outputs:
                futures.append(await self.js.publish_async(output.subject, output.data, wait_stall=PUBLISH_TIMEOUT_S,
                                                           headers={settings.MSG_ID: output.msg_id}))
        except Exception as exc:  # disconnected, too many pending acks: send the rest again later
            log.debug("publish interrupted after %d of %d: %r", len(futures), len(outputs), exc)
        if futures:
            await asyncio.wait(futures, timeout=PUBLISH_TIMEOUT_S)
        acked = 0
        for future in futures:
            if not future.done() or future.cancelled() or future.exception() is not None:
                break
            acked += 1
        for future in futures[acked:]:
            if not future.done():
                future.cancel()  # frees nats-py's pending-ack slot
        return acked

    # -- LB_WEIGHTS -----------------------------------------------------------------------------

    async def _flush_weights(self) -> None:
        for pool, output in list(self._latest.items()):
            await self._put_if_newer(pool, output)
            del self._latest[pool]

    async def _put_if_newer(self, pool: str, output: Output) -> None:
        """Compare-and-set: a pool's KV entry never goes back to an older ``as_of_seq``."""
        assert self._weights is not None
        for _ in range(10):
            known = self._kv_known.get(pool)
            if known is None:
                known = await self._read_weight(pool)
            if known[0] >= output.as_of_seq:
                self._kv_known[pool] = known
                return
            try:
                if known[1] == 0:
                    revision = await self._weights.create(pool, output.data)
                else:
                    revision = await self._weights.update(pool, output.data, last=known[1])
            except (KeyWrongLastSequenceError, BadRequestError):
                self._kv_known.pop(pool, None)  # another replica wrote meanwhile: re-read
                continue
            self._kv_known[pool] = (output.as_of_seq, revision)
            return
        log.warning("could not update LB_WEIGHTS[%s] to seq %d after 10 attempts", pool, output.as_of_seq)

    async def _read_weight(self, pool: str) -> tuple[int, int]:
        assert self._weights is not None
        try:
            entry = await self._weights.get(pool)
        except KeyNotFoundError:  # also a deleted key: create() works on it
            return (0, 0)
        return (as_of_seq_of(None, entry.value), entry.revision or 0)

    # -- checkpoints, configuration, ticks ------------------------------------------------------

    async def _write_checkpoint(self) -> None:
        assert self._checkpoints is not None
        try:
            await self._checkpoints.put(CHECKPOINT_KEY, self.scheduler.checkpoint())
        except Exception as exc:  # a checkpoint is an optimisation: never fatal
            log.warning("checkpoint at seq %d not written: %s", self.applied_seq, exc)
            return
        self._checkpointed_seq = self.applied_seq

    async def _publish_config(self) -> None:
        if self._wanted_config is None:
            return
        changes = config_changes(self.scheduler.config, self._wanted_config)
        if not changes:
            log.info("configuration file %s is already in force", self.options.config_file)
            return
        payload = encode({"set": changes})
        digest = hashlib.sha256(payload).hexdigest()[:16]
        msg_id = f"config-{self.applied_seq}-{digest}"  # replicas started together publish it once
        ack = await self.js.publish(sj.ADMIN_CONFIG, payload, headers={settings.MSG_ID: msg_id})
        log.info("published configuration %s as seq %d: %s", self.options.config_file, ack.seq, sorted(changes))

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        period_ns = self.options.tick_ms * 1_000_000
        last = -1
        while not stop.is_set():
            n = tick_number(time.time_ns(), period_ns)
            if n != last:
                last = n
                await self._publish_tick(n)
            delay_ns = (n + 1) * period_ns - time.time_ns()
            await asyncio.sleep(max(0.0, delay_ns / 1e9))

    async def _publish_tick(self, n: int) -> None:
        """Fire and forget (a late tick is useless; the next period brings the next one)."""
        task = asyncio.create_task(self.js.publish(sj.CLOCK_TICK, b'{"tick":%d}' % n, timeout=1.0,
                                                   headers={settings.MSG_ID: f"tick-{n}"}))
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


# -- NATS helpers ---------------------------------------------------------------------------------


async def ensure_checkpoint_bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(settings.CHECKPOINT_BUCKET)
    except (NotFoundError, BadRequestError):
        with contextlib.suppress(BadRequestError):
            await js.create_key_value(KeyValueConfig(bucket=settings.CHECKPOINT_BUCKET, history=1,
                                                     storage=StorageType.FILE, max_value_size=-1))
        return await js.key_value(settings.CHECKPOINT_BUCKET)


async def highest_published_seq(js: JetStreamContext, scan: int = PUBLISH_FLOOR_SCAN) -> int:
    """The highest ``as_of_seq`` among the last ``scan`` messages of LB_OUT (0 when empty)."""
    state = (await js.stream_info(sj.OUT_STREAM)).state
    best = 0
    if state.messages == 0:
        return 0
    for seq in range(state.last_seq, max(state.first_seq, state.last_seq - scan + 1) - 1, -1):
        try:
            msg = await js.get_msg(sj.OUT_STREAM, seq)
        except NotFoundError:
            continue
        msg_id = (msg.headers or {}).get(settings.MSG_ID)
        best = max(best, as_of_seq_of(msg_id, msg.data))
    return best


def _token(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:48] or "replica"


# -- command line ---------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("scheduler", help="run the scheduler service on NATS JetStream",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_nats_url(parser)
    parser.add_argument("--config", metavar="FILE.toml", help="scheduler configuration to put in force")
    parser.add_argument("--tick-ms", type=int, default=settings.DEFAULT_TICK_MS,
                        help="tick period in ms (default 100; 0 publishes no ticks)")
    parser.add_argument("--replica-id", default=None, help="name of this replica (default host-pid)")
    parser.add_argument("--batch", type=int, default=1000, help="events fetched per batch (default 1000)")
    parser.add_argument("--checkpoint-every", type=int, default=10_000,
                        help="events between checkpoints in KV LB_CHECKPOINT (0 = none; default 10000)")
    parser.add_argument("--no-checkpoint", action="store_true", help="rebuild from the first retained event")
    settings.add_verbosity(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args.verbose, "scheduler")
    if args.tick_ms < 0 or args.batch < 1 or args.checkpoint_every < 0:
        log.error("--tick-ms and --checkpoint-every must be >= 0, --batch >= 1")
        return 2
    try:
        options = SchedulerOptions(config_file=args.config, tick_ms=args.tick_ms, batch=args.batch,
                                   checkpoint_every=args.checkpoint_every, use_checkpoint=not args.no_checkpoint,
                                   replica_id=args.replica_id or default_replica_id())
        if options.config_file:
            config_mod.load_file(options.config_file)
    except (OSError, ValueError) as exc:
        print(f"laswrr scheduler: bad --config {args.config}: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(args.nats_url, options))


async def _log_nats_error(exc: Exception) -> None:
    log.warning("NATS: %s", exc or type(exc).__name__)


async def serve(nats_url: str, options: SchedulerOptions) -> int:
    stop = settings.stop_event()
    try:
        nc = await connect(nats_url, f"laswrr-scheduler-{options.replica_id}", error_cb=_log_nats_error)
    except Exception as exc:
        log.error("cannot connect to %s: %s", nats_url, exc)
        return 1
    service = SchedulerService(nc, options)
    try:
        await service.run(stop)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 10)
    return 0
