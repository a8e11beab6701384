"""Request-lifecycle events, published without ever blocking the request path.

Theory of operation. Handlers call ``started``/``finished`` (plain synchronous appends to an
in-memory buffer, a few microseconds); one background task, ``run``, drains the buffer into
JetStream as batches: one ``lb.req.batch.<proxy>`` message holds up to ``batch_max`` events in
the order they were made (docs/wire.md, "Batched request events"). A batch is cut when
``batch_max`` events wait or ``flush_s`` after the first of them, whichever comes first, and
never over the connection's payload limit. Each batch has the ``Nats-Msg-Id``
``<proxy>:<boot_id>:<batch seq>``; the batches waiting (up to ``IN_FLIGHT_BATCHES``) are
published with ``publish_async`` and their acks awaited together (one burst of writes and acks
per round). A batch is the unit of delivery: once cut it keeps its number, so re-sending it
after a lost ack is harmless (the stream's de-duplication window keeps one copy). On a failure
the batches are re-sent from the first unacknowledged one on, in order, after a short
back-off, before any newer event is cut into a batch; while NATS is disconnected nothing is
sent and events wait.

The buffer is bounded (``capacity`` events, cut into batches or not): when full, the *oldest*
event is dropped (from the oldest unacknowledged batch first), counted (``dropped``, exported
in /metrics) and logged. A dropped ``finished`` leaves a phantom in-flight in the scheduler
until this proxy stops or goes silent (docs/design.md, "Hazards designed for"); that is the
price of never blocking a request on the bus. (An event dropped from a batch whose ack was lost
after JetStream stored it was in fact delivered: the re-sent batch, shorter, is de-duplicated.)
An event too large to fit in any batch is dropped and counted the same way.

The sizes of the batches acknowledged are a histogram (``batch_sizes``, exported as
``laswrr_proxy_event_batch_size``).

Event semantics (what analysts count):

* One ``lb.req.started.<node>`` / ``lb.req.finished.<node>`` pair per **attempt**. The first
  attempt of a client request uses the request id; retry or continuation k (k >= 1) uses
  ``<request id>.<k>``, so the scheduler's in-flight bookkeeping (keyed by request id) moves
  from node to node with the attempts. A client request is the set of attempts sharing the id before the first '.'.
* ``snapshot_seq`` on started is the ``as_of_seq`` of the snapshot the pick used.
* ``finished.outcome`` (``schemas.words.RequestOutcome``): ``completed`` (the engine answered 2xx and the whole
  answer reached the client), ``engine_error`` (it answered another status below 500, a 4xx or a 3xx, and that
  answer reached the client whole; ``status`` says which), ``client_cancelled`` (the client went away; the upstream request
  was cancelled), ``upstream_error`` (connection failure, timeout, a 5xx, or a stream cut after
  its first byte and not continued), ``router_aborted`` (still running when the shutdown grace
  period ended), ``continued`` (a stream broke after the client got part of it and went on at
  ``next_attempt`` on another node; ``completion_tokens`` is what this attempt sent).
  ``next_attempt`` names the attempt that continued or retried this one (null otherwise).
  An attempt that failed before any byte reached the client and was retried on another node
  has ``outcome=upstream_error``, ``ttft_ms=null`` and an ``error`` starting with
  ``"retried: "``: the client never saw that failure. ``ttft_ms`` (first byte sent to the
  client; null when none was) and ``duration_ms`` count from the client request's arrival at
  the proxy, so a retried request's figures include its failed attempts; ``status`` is the
  engine's HTTP status (null when it never answered). ``stream`` is true once the client's
  answer is an SSE stream (the engine answered ``text/event-stream``; a stream's later attempts
  too), false otherwise: a whole (buffered) answer's ``ttft_ms`` is that whole answer's first
  byte, no time to first token, so analysts' TTFT takes streamed requests only
  (``RequestFinished.first_token_ms``).
* ``lb.req.refused.<proxy>``: a request the proxy answered itself (401, 400, 408, 413, 404,
  429, 503; 499 for a held request whose client left) before binding it to a node, with its
  own request id, ``status``, ``cause`` (``schemas.words.RefusalCause``), the client's
  ``model`` and key name, and the message sent.
* ``lb.proxy.heartbeat.<proxy>`` every ``heartbeat_s`` with this proxy's in-flight count and
  the newest snapshot it routes on (``snapshot_seq``; also at once when a snapshot takes a node
  out of rotation, so a drain need not wait for the next one), and ``lb.proxy.stopped.<proxy>``
  at clean shutdown, after the last request finished.
* Every event carries ``boot_id``, random per process (``new_boot_id``): a proxy restarted
  with the same ``--proxy-id`` is a new process to the scheduler, which voids what the old one
  left open. Heartbeats (and the stop) go through the same ordered buffer, into the same
  batches, as request events, so a heartbeat's in-flight count agrees with the events before it
  (the scheduler trusts it where it is lower).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET, structs
from nats.aio.client import Client
from nats.js import JetStreamContext

from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import MAX_PAYLOAD_BYTES, batch_item, batch_item_head, batch_payload, encode
from laswrr.schemas.outputs import clip
from laswrr.schemas.words import Band, HoldCause, NodeRole, RefusalCause, RequestOutcome
from laswrr.services.natsbus import publish_acked
from laswrr.services.service_metrics import Buckets
from laswrr.scheduler.routing.latency import (
    Estimate,
    Objective,
    Prediction,
    estimate_fields,
    estimate_record,
    slo_fields,
)
from laswrr.scheduler.routing.prompt import RequestSize

log = logging.getLogger("laswrr.proxy.events")

RETRIED_PREFIX = "retried: "


@dataclass(slots=True)
class Attempt:
    """What a finished event reports about one attempt."""

    outcome: RequestOutcome
    status: int | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    next_attempt: str | None = None  # the attempt that continued or retried this one
    stream: bool = False  # the client's answer is an SSE stream (RequestFinished.stream)
    started_ms: float | None = None  # the attempt's start after the request's arrival (its own TTFT: ttft_ms - it)


_NO_ESTIMATE = (UNSET, UNSET, UNSET, UNSET, UNSET)  # ``estimate_record`` without an estimate: the fields left out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def new_boot_id() -> str:
    """A proxy process's boot id: random at start, never derived from ``--proxy-id``."""
    return secrets.token_hex(8)


BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
IN_FLIGHT_BATCHES = 64  # batches published per round, their acks awaited together
HEADER_MARGIN_BYTES = 1024  # room for the Nats-Msg-Id header within the connection's max payload
_BATCH_OVERHEAD = 160  # bytes of a batch payload besides its events (boot id, number, brackets)


@dataclass(slots=True)
class Batch:
    """Events cut into one message: its number and id stay the same on every re-send."""

    seq: int
    msg_id: str
    items: list[bytes]
    sends: int = 0  # publishes so far


class EventBatches:
    """The bounded buffer of batch items and the batches cut from it, not yet acknowledged (module
    docstring): no IO; the publisher sends what ``cut`` made and reports the acks (``acked``)."""

    def __init__(self, proxy_id: str, boot_id: str, capacity: int, batch_max: int) -> None:
        self.proxy_id, self.boot_id = proxy_id, boot_id
        self.capacity = capacity
        self.batch_max = batch_max
        self.buffer: deque[bytes] = deque()  # events not yet cut into a batch (``batch_item`` bytes)
        self.unacked: deque[Batch] = deque()  # batches cut, not yet acknowledged, oldest first
        self.unacked_events = 0
        self.batch_seq = 0
        self.dropped = 0
        self.since = 0.0  # monotonic time the oldest event not yet cut into a batch was buffered
        self._last_drop_log = 0.0

    @property
    def size(self) -> int:
        """Events not yet acknowledged (cut into batches or not)."""
        return len(self.buffer) + self.unacked_events

    def put(self, item: bytes) -> None:
        buffer = self.buffer
        if not buffer:
            self.since = time.monotonic()
        buffer.append(item)
        if len(buffer) + self.unacked_events > self.capacity:
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        excess = len(self.buffer) + self.unacked_events - self.capacity
        if excess <= 0:
            return
        for _ in range(excess):
            if self.unacked:
                oldest = self.unacked[0]
                lost = oldest.items.pop(0)
                self.unacked_events -= 1
                if not oldest.items:
                    self.unacked.popleft()
            else:
                lost = self.buffer.popleft()
            self.dropped += 1
        self._log_drop("event buffer full (%d): dropped the oldest event (%s); %d dropped so far",
                       self.capacity, _kind_of(lost), self.dropped)

    def _log_drop(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_drop_log >= 5.0:  # log the first drop and then at most every 5 s
            self._last_drop_log = now
            log.warning(message, *args)

    def cut(self, limit: int, whole_only: bool) -> None:
        """Cut up to ``IN_FLIGHT_BATCHES`` batches of at most ``limit`` bytes of events from the
        buffer, oldest events first; with ``whole_only`` (the oldest event has waited less than
        ``flush_s``), only batches of ``batch_max`` events (or of the most bytes a message
        takes), the rest waits."""
        buffer = self.buffer
        while buffer and len(self.unacked) < IN_FLIGHT_BATCHES:
            if whole_only and len(buffer) < self.batch_max and sum(map(len, buffer)) + len(buffer) <= limit:
                return
            items: list[bytes] = []
            size = 0
            while buffer and len(items) < self.batch_max:
                if len(buffer[0]) + 1 > limit:
                    self.dropped += 1
                    lost = buffer.popleft()
                    self._log_drop("an event of %d bytes does not fit in a batch of at most %d bytes: dropped "
                                   "(%s); %d dropped so far", len(lost), limit, _kind_of(lost), self.dropped)
                    continue
                if size + len(buffer[0]) + 1 > limit:
                    break
                item = buffer.popleft()
                items.append(item)
                size += len(item) + 1
            if not items:
                continue
            self.batch_seq += 1
            self.unacked.append(Batch(self.batch_seq, f"{self.proxy_id}:{self.boot_id}:{self.batch_seq}", items))
            self.unacked_events += len(items)

    def acked(self, batch: Batch) -> None:
        """``batch``, the oldest sent, was acknowledged: it leaves (unless a full buffer emptied
        it meanwhile)."""
        if self.unacked and self.unacked[0] is batch:
            self.unacked.popleft()
            self.unacked_events -= len(batch.items)


@functools.lru_cache(maxsize=10_000)
def _node_heads(node: str) -> tuple[bytes, bytes]:
    """The ``batch_item`` heads of a node's started and finished events (``node`` checked once)."""
    sj.check_token(node)
    return batch_item_head(ev.RequestStarted.KIND, node), batch_item_head(ev.RequestFinished.KIND, node)


class EventPublisher:
    """The request path's events (producers: synchronous, never block) and the task that
    publishes them (``run``), over ``EventBatches``."""

    def __init__(self, proxy_id: str, capacity: int = 100_000, batch_max: int = 512,
                 ack_timeout_s: float = 2.0, retry_backoff_s: float = 0.25, flush_s: float = 0.005,
                 boot_id: str | None = None) -> None:
        self.proxy_id = proxy_id
        self.boot_id = boot_id or new_boot_id()
        self.batch_max = batch_max
        self.flush_s = flush_s
        self.ack_timeout_s = ack_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.subject = sj.req_batch(proxy_id)
        self.batches = EventBatches(proxy_id, self.boot_id, capacity, batch_max)
        self.batch_sizes = Buckets(BATCH_SIZE_BUCKETS)
        self.published = 0  # events acknowledged
        self.published_bytes = 0  # their batches' payloads and subjects, as NATS carried them
        self.batches_published = 0
        self.resent = 0  # publishes of a batch after its first (lost or late acks)
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        self._urgent = False  # flushing (shutdown): cut and send without waiting
        self._idle = asyncio.Event()
        self._idle.set()
        self._heartbeat_head = batch_item_head(ev.ProxyHeartbeat.KIND, None)
        self._refused_head = batch_item_head(ev.RequestRefused.KIND, None)
        self._queued_head = batch_item_head(ev.RequestQueued.KIND, None)

    # -- producers (synchronous, never block) ------------------------------------------------

    def started(self, request_id: str, node: str, pool: str, snapshot_seq: int,
                size: RequestSize | None = None, key_name: str | None = None, role: NodeRole | None = None,
                objective: Objective | None = None, cached: int | None = None, estimate: Estimate | None = None,
                predicted: Prediction | None = None) -> None:
        # keywords only, no ``**`` (a msgspec Struct called with a dict of keywords costs about 3 times
        # as much): the estimate's figures from ``estimate_record``, the targets' (rare) set after
        queue, uncached, batch, learned, slots = _NO_ESTIMATE if estimate is None else estimate_record(estimate)
        event = ev.RequestStarted(request_id=request_id, proxy=self.proxy_id, pool=pool,
                                  snapshot_seq=snapshot_seq, ts_ns=time.time_ns(), boot_id=self.boot_id,
                                  prompt_tokens=None if size is None else size.prompt_tokens,
                                  max_tokens=None if size is None else size.max_tokens, key_name=key_name,
                                  role=UNSET if role is None else role,
                                  cached_tokens=UNSET if cached is None else cached, queue_tokens=queue,
                                  uncached_tokens=uncached, batch_size=batch, learned=learned, slots=slots,
                                  learned_from=estimate.learned_from if estimate is not None and estimate.learned_from
                                  else UNSET)
        if objective is not None or predicted is not None:
            event = structs.replace(event, **slo_fields(objective, predicted))
        self._put(_node_heads(node)[0] + encode(event) + b"]")

    def finished(self, request_id: str, node: str, pool: str, attempt: Attempt, role: NodeRole | None = None) -> None:
        event = ev.RequestFinished(
            request_id=request_id, proxy=self.proxy_id, outcome=attempt.outcome, pool=pool,
            ttft_ms=attempt.ttft_ms, duration_ms=attempt.duration_ms, prompt_tokens=attempt.prompt_tokens,
            completion_tokens=attempt.completion_tokens, status=attempt.status, error=attempt.error,
            ts_ns=time.time_ns(), next_attempt=attempt.next_attempt, boot_id=self.boot_id,
            role=UNSET if role is None else role, stream=attempt.stream,
            started_ms=UNSET if attempt.started_ms is None else attempt.started_ms)
        self._put(_node_heads(node)[1] + encode(event) + b"]")

    def refused(self, request_id: str, status: int, cause: RefusalCause, error: str, pool: str | None = None,
                model: str | None = None, key_name: str | None = None, objective: Objective | None = None,
                predicted: Prediction | None = None, estimate: Estimate | None = None) -> None:
        """The proxy answered a request itself (``lb.req.refused``, keyed by this proxy like a heartbeat);
        an ``slo_unmeetable`` answer carries its targets, the best prediction and what it was made of."""
        more: dict[str, Any] = {}
        if estimate is not None:
            more = {"predicted_node": estimate.node, "max_tokens": estimate.output, **estimate_fields(estimate)}
        event = ev.RequestRefused(request_id=request_id, proxy=self.proxy_id, status=status, cause=cause, pool=pool,
                                  model=model, key_name=key_name, error=clip(error), ts_ns=time.time_ns(),
                                  boot_id=self.boot_id, **slo_fields(objective, predicted), **more)
        self._put(self._refused_head + encode(event) + b"]")

    def queued(self, request_id: str, pool: str, band: Band, key_name: str | None, work: int, ttl_ms: int,
               cause: HoldCause) -> None:
        """Flow control held a request (``lb.req.queued``, keyed by this proxy like a heartbeat)."""
        event = ev.RequestQueued(request_id=request_id, proxy=self.proxy_id, pool=pool, band=band,
                                 key_name=key_name, work=work, ttl_ms=ttl_ms, cause=cause,
                                 ts_ns=time.time_ns(), boot_id=self.boot_id)
        self._put(self._queued_head + encode(event) + b"]")

    def heartbeat(self, inflight: int, snapshot_seq: int | None = None) -> None:
        event = ev.ProxyHeartbeat(inflight=inflight, ts_ns=time.time_ns(), boot_id=self.boot_id,
                                  snapshot_seq=snapshot_seq)
        self._put(self._heartbeat_head + encode(event) + b"]")

    def stopped(self) -> None:
        event = ev.ProxyStopped(ts_ns=time.time_ns(), boot_id=self.boot_id)
        self._put(batch_item(ev.ProxyStopped.KIND, None, encode(event)))

    def _put(self, item: bytes) -> None:
        self.batches.put(item)
        if not self._wakeup.is_set():
            self._wakeup.set()
        if len(self.batches.buffer) >= self.batch_max and not self._full.is_set():
            self._full.set()
        self._idle.clear()

    # -- connection ---------------------------------------------------------------------------

    def attach(self, nc: Client) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self._wakeup.set()

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def buffered(self) -> int:
        """Events not yet acknowledged (cut into batches or not)."""
        return self.batches.size

    @property
    def dropped(self) -> int:
        """Events dropped: the buffer full, or one too large for any batch."""
        return self.batches.dropped

    # -- the drain loop -----------------------------------------------------------------------

    async def run(self) -> None:
        batches = self.batches
        while True:
            if not batches.buffer and not batches.unacked:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self.connected or self.js is None or self.nc is None:
                await asyncio.sleep(self.retry_backoff_s)
                continue
            if not batches.unacked:  # nothing to re-send: let a batch gather, then cut
                wait = batches.since + self.flush_s - time.monotonic()
                if wait > 0 and not self._urgent and len(batches.buffer) < self.batch_max:
                    self._full.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._full.wait(), wait)
                limit = min(self.nc.max_payload, MAX_PAYLOAD_BYTES) - HEADER_MARGIN_BYTES - _BATCH_OVERHEAD
                batches.cut(limit, whole_only=not self._urgent and time.monotonic() < batches.since + self.flush_s)
                if not batches.unacked:
                    continue
            await self._publish()

    async def _publish(self) -> None:
        """Publish the unacknowledged batches in order; drop the acknowledged prefix."""
        assert self.js is not None
        batches = list(self.batches.unacked)
        messages = [(self.subject, batch_payload(self.boot_id, b.seq, b.items), b.msg_id) for b in batches]
        for batch in batches:
            self.resent += batch.sends > 0
            batch.sends += 1
        acked = await publish_acked(self.js, messages, self.ack_timeout_s)  # in order, count the acked prefix
        for batch, (subject, payload, _) in zip(batches[:acked], messages):
            self.batches.acked(batch)  # (unless dropped meanwhile by a full buffer)
            if batch.items:  # (a batch the full buffer emptied meanwhile was delivered, counted dropped)
                self.published += len(batch.items)
                self.published_bytes += len(payload) + len(subject)
                self.batches_published += 1
                self.batch_sizes.observe(len(batch.items))
        if acked < len(batches):
            await asyncio.sleep(self.retry_backoff_s)

    async def flush(self, timeout: float) -> bool:
        """Send what waits at once and wait until every buffered event is acknowledged; False
        on timeout."""
        self._urgent = True
        self._full.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return not self.batches.buffer and not self.batches.unacked and self._idle.is_set()


def _kind_of(item: bytes) -> str:
    """The kind of a ``batch_item`` (for log lines)."""
    return item[2:item.find(b'"', 2)].decode("ascii", "replace")
