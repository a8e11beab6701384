"""Request-lifecycle events, published without ever blocking the request path.

Theory of operation. Handlers call ``started``/``finished`` (plain synchronous appends to an
in-memory buffer, a few microseconds); one background task, ``run``, drains the buffer into
JetStream: it lets events gather for ``linger_s`` (a few ms), takes up to ``batch_max`` of them,
publishes them all with ``publish_async`` and awaits their acks together (one socket write and
one burst of acks per batch instead of one per event). Every event carries a ``Nats-Msg-Id`` (``<proxy>:<request_id>:started``
and so on), so re-sending after a lost ack is harmless (the stream's de-duplication window
keeps one copy). On a failure the batch is re-sent from its first unacknowledged event on, in
order, after a short back-off; while NATS is disconnected nothing is sent and events wait.

The buffer is bounded (``capacity``): when full, the *oldest* event is dropped, counted
(``dropped``, exported in /metrics) and logged. A dropped ``finished`` leaves a phantom
in-flight in the scheduler until this proxy stops or goes silent (docs/design.md §1, "Hazards designed for"); that is the price
of never blocking a request on the bus.

Event semantics (what analysts count):

* One ``lb.req.started.<node>`` / ``lb.req.finished.<node>`` pair per **attempt**. The first
  attempt of a client request uses the request id; retry or continuation k (k >= 1) uses
  ``<request id>.<k>``, so the scheduler's in-flight bookkeeping (keyed by request id) moves
  from node to node with the attempts. A client request is the set of attempts sharing the id before the first '.'.
* ``snapshot_seq`` on started is the ``as_of_seq`` of the snapshot the pick used.
* ``finished.outcome`` (``schemas.words.RequestOutcome``): ``completed`` (the engine answered with a status below 500 and the whole
  answer reached the client), ``client_cancelled`` (the client went away; the upstream request
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
  engine's HTTP status (null when it never answered).
* ``lb.proxy.heartbeat.<proxy>`` every ``heartbeat_s`` with this proxy's in-flight count, and
  ``lb.proxy.stopped.<proxy>`` at clean shutdown, after the last request finished.
* Every event carries ``boot_id``, random per process (``new_boot_id``): a proxy restarted
  with the same ``--proxy-id`` is a new process to the scheduler, which voids what the old one
  left open. Heartbeats go through the same ordered buffer as request events, so a heartbeat's
  in-flight count agrees with the events before it (the scheduler trusts it where it is lower).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext

from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.words import RequestOutcome
from laswrr.services.natsbus import publish_acked
from laswrr.services.proxy.prompt import RequestSize

log = logging.getLogger("laswrr.proxy.events")

RETRIED_PREFIX = "retried: "


Pending = tuple[str, bytes, str]  # (subject, data, msg_id): what ``publish_acked`` takes, built once


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def new_boot_id() -> str:
    """A proxy process's boot id: random at start, never derived from ``--proxy-id``."""
    return secrets.token_hex(8)


class EventPublisher:
    def __init__(self, proxy_id: str, capacity: int = 100_000, batch_max: int = 512,
                 ack_timeout_s: float = 2.0, retry_backoff_s: float = 0.25, linger_s: float = 0.005,
                 boot_id: str | None = None) -> None:
        self.proxy_id = proxy_id
        self.boot_id = boot_id or new_boot_id()
        self.capacity = capacity
        self.batch_max = batch_max
        self.linger_s = linger_s
        self.ack_timeout_s = ack_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.buffer: deque[Pending] = deque()
        self.dropped = 0
        self.published = 0
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._heartbeats = 0
        self._last_drop_log = 0.0
        self._subjects: dict[str, tuple[str, str]] = {}  # node -> (started, finished) subjects

    # -- producers (synchronous, never block) ------------------------------------------------

    def started(self, request_id: str, node: str, pool: str, snapshot_seq: int,
                size: RequestSize | None = None, key_name: str | None = None) -> None:
        event = ev.RequestStarted(request_id=request_id, proxy=self.proxy_id, pool=pool,
                                  snapshot_seq=snapshot_seq, ts_ns=time.time_ns(), boot_id=self.boot_id,
                                  prompt_tokens=None if size is None else size.prompt_tokens,
                                  max_tokens=None if size is None else size.max_tokens, key_name=key_name)
        self._put(self._subjects_of(node)[0], encode(event), f"{self.proxy_id}:{request_id}:started")

    def finished(self, request_id: str, node: str, pool: str, attempt: Attempt) -> None:
        event = ev.RequestFinished(
            request_id=request_id, proxy=self.proxy_id, outcome=attempt.outcome, pool=pool,
            ttft_ms=attempt.ttft_ms, duration_ms=attempt.duration_ms, prompt_tokens=attempt.prompt_tokens,
            completion_tokens=attempt.completion_tokens, status=attempt.status, error=attempt.error,
            ts_ns=time.time_ns(), next_attempt=attempt.next_attempt, boot_id=self.boot_id)
        self._put(self._subjects_of(node)[1], encode(event), f"{self.proxy_id}:{request_id}:finished")

    def _subjects_of(self, node: str) -> tuple[str, str]:
        subjects = self._subjects.get(node)
        if subjects is None:
            if len(self._subjects) > 10_000:
                self._subjects.clear()
            subjects = self._subjects[node] = (sj.req_started(node), sj.req_finished(node))
        return subjects

    def heartbeat(self, inflight: int) -> None:
        self._heartbeats += 1
        event = ev.ProxyHeartbeat(inflight=inflight, ts_ns=time.time_ns(), boot_id=self.boot_id)
        self._put(sj.proxy_heartbeat(self.proxy_id), encode(event), f"{self.proxy_id}:hb:{self._heartbeats}:{time.time_ns()}")

    def stopped(self) -> None:
        event = ev.ProxyStopped(ts_ns=time.time_ns(), boot_id=self.boot_id)
        self._put(sj.proxy_stopped(self.proxy_id), encode(event), f"{self.proxy_id}:stopped:{time.time_ns()}")

    def _put(self, subject: str, data: bytes, msg_id: str) -> None:
        self.buffer.append((subject, data, msg_id))
        if len(self.buffer) > self.capacity:
            self._enforce_bound()
        if not self._wakeup.is_set():
            self._wakeup.set()
        self._idle.clear()

    def _enforce_bound(self) -> None:
        excess = len(self.buffer) - self.capacity
        if excess <= 0:
            return
        for _ in range(excess):
            lost = self.buffer.popleft()
            self.dropped += 1
        now = time.monotonic()
        if now - self._last_drop_log >= 5.0:  # log the first drop and then at most every 5 s
            self._last_drop_log = now
            log.warning("event buffer full (%d): dropped the oldest event (%s); %d dropped so far",
                        self.capacity, lost[0], self.dropped)

    # -- connection ---------------------------------------------------------------------------

    def attach(self, nc: Client) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self._wakeup.set()

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    # -- the drain loop -----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not self.buffer:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self.connected or self.js is None:
                await asyncio.sleep(self.retry_backoff_s)
                continue
            if self.linger_s and len(self.buffer) < self.batch_max:
                await asyncio.sleep(self.linger_s)  # let a batch gather: one write, one burst of acks
            batch = [self.buffer.popleft() for _ in range(min(self.batch_max, len(self.buffer)))]
            acked = await publish_acked(self.js, batch, self.ack_timeout_s)  # publish in order, count acked prefix
            self.published += acked
            if acked < len(batch):
                self.buffer.extendleft(reversed(batch[acked:]))
                self._enforce_bound()
                await asyncio.sleep(self.retry_backoff_s)

    async def flush(self, timeout: float) -> bool:
        """Wait until every buffered event is acknowledged; False on timeout."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return not self.buffer and self._idle.is_set()
