"""Reading a JetStream stream fast and exactly: what the scheduler service and the recorder share.

Theory of operation.

* **Raw pull requests.** ``PullReader`` sends ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``
  requests itself, each with its own reply subject ``<inbox>.<n>``, and receives every answer
  through one callback subscription on ``<inbox>.*`` into a buffer. nats-py's ``fetch`` costs
  several loop wake-ups per message (docs/evidence/code-choices.md);
  this way a whole batch arrives through one callback. One request is outstanding at a time.
* **Statuses.** Every delivered message lands in the buffer, whichever request it answered (a
  late one is still a delivery the caller must account for before acking past it). A status
  message (404 no messages, 408 expired, 409 ended, 503 no responders) ends a request only when
  it answers the current one; 100 (heartbeat, flow control) is ignored. A 409 or 503 means the
  consumer is gone or unusable (deleted, leadership change): ``gone`` says why, and the caller
  recreates it from its own position with ``open``.
* **Two ways to read.** ``next_batch`` keeps a request in flight at all times, so the server
  streams the next batch while the caller applies this one (the scheduler); since a request is
  always outstanding it can also tell when one was lost (a reconnect, no answer within its
  expiry + 2 s) and raises ``ConsumerGone``. ``fetch`` asks for a batch and waits until it is
  full or the request expires (the recorder's "``batch`` rows or ``flush_ms``" commits), at
  most expiry + 5 s, then simply asks again next time.
* **Consumers.** ``open(config)`` (re)creates the consumer ``config`` names on a fresh inbox:
  the previous consumer is deleted (as is an older one of the same name, so a durable restarts
  where ``config.opt_start_seq`` says), and nothing delivered to the old one reaches the buffer
  any more. ``ack_all_consumer`` is the configuration both services start from: AckAll (one ack
  per batch acknowledges the batch), no ack-pending limit, from a given seq.
* **Exact metadata.** ``parse_ack_subject`` reads stream seq and timestamp from a delivered
  message's reply subject, the timestamp as exact integer nanoseconds (nats-py's
  ``metadata.timestamp`` is a float datetime and loses precision); ``get_envelope`` fetches one
  stored message by seq (``STREAM.MSG.GET``, for holes in a delivery) with the same exact time.
* **Exactly once, in order.** ``InOrder`` turns deliveries into envelopes for a fold that must
  see every seq once: a redelivered seq is dropped, a hole (messages delivered but lost on the
  way, e.g. across a reconnect) is fetched directly. (The recorder keeps its own account of
  what its file holds, by batch, and fetches a hole before acking past it: services/recorder.py.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import time
from typing import Any, NamedTuple

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from laswrr.schemas.codec import Envelope

log = logging.getLogger("laswrr.jsreader")

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
    """A delivered message as the core's input: stream seq and exact time from its ack subject."""
    info = parse_ack_subject(msg.reply)
    return Envelope(seq=info.stream_seq, ts_ns=info.ts_ns, subject=msg.subject, data=msg.data)


# -- one stored message, directly -----------------------------------------------------------------


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


async def get_envelope(nc: Client, stream: str, seq: int) -> Envelope | None:
    """One stored message by seq with its exact timestamp (``STREAM.MSG.GET``); None if absent."""
    reply = await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", b'{"seq":%d}' % seq, timeout=5.0)
    answer = msgspec.json.decode(reply.data, type=dict[str, Any])
    message = answer.get("message")
    if not message:
        return None
    data = base64.b64decode(message.get("data") or "")
    return Envelope(seq=seq, ts_ns=parse_rfc3339_ns(message["time"]), subject=message["subject"], data=data)


# -- pull consumers -------------------------------------------------------------------------------


def ack_all_consumer(from_seq: int, **options: Any) -> ConsumerConfig:
    """An AckAll pull consumer delivering from ``from_seq``: no ack-pending limit, 60 s ack wait;
    ``options`` name it (``name=`` or ``durable_name=``) and add the rest."""
    return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, from_seq),
                          ack_policy=AckPolicy.ALL, ack_wait=60.0, max_ack_pending=-1, **options)


class ConsumerGone(RuntimeError):
    """The pull consumer was deleted or stopped answering: recreate it from the next seq."""


class PullReader:
    """Raw pull requests on one consumer of ``stream`` into a callback buffer (module header)."""

    STATUS_ENDS = frozenset({"404", "408", "409", "503"})  # no messages / expired / ended / no responders
    STATUS_GONE = frozenset({"409", "503"})  # consumer deleted, leadership change, ... / consumer missing

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, batch: int) -> None:
        self.nc, self.js, self.stream, self.batch = nc, js, stream, batch
        self.consumer: str | None = None
        self.gone: str | None = None  # why the consumer must be recreated, once a status said so
        self._sub: Any = None
        self._inbox = ""
        self._n = 0
        self._current = ""  # reply subject of the outstanding request ("" = none)
        self._remaining = 0
        self._deadline = 0.0
        self._buffer: list[Msg] = []
        self._wake = asyncio.Event()  # a delivery or a status arrived (what next_batch waits for)
        self._ended = asyncio.Event()  # the current request ended (what fetch waits for)
        self._reconnects = 0

    async def open(self, config: ConsumerConfig) -> None:
        """(Re)create the consumer ``config`` names and read it from now on (module header)."""
        name = config.durable_name or config.name
        assert name, "the consumer needs a name"
        await self._unsubscribe()
        self._buffer = []
        self._end()  # a fetch still waiting on the old consumer returns (empty) at once
        self._wake.set()
        self._reconnects = self.nc.stats["reconnects"]  # a reconnect may lose a request or the consumer
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg, pending_bytes_limit=-1,
                                            pending_msgs_limit=20 * self.batch + 1000)
        if self.consumer is not None and self.consumer != name:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, self.consumer)
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.stream, name)
        await self.js.add_consumer(self.stream, config)  # if this raises, `gone` stays: try again later
        self.consumer, self.gone = name, None

    async def close(self, delete_consumer: bool = False) -> None:
        await self._unsubscribe()
        if delete_consumer and self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, self.consumer)

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers and not msg.data else None
        if status is None:
            self._buffer.append(msg)
            self._remaining -= 1
            if self._remaining <= 0:
                self._end()  # the request is fulfilled
        elif status in self.STATUS_ENDS:
            if status in self.STATUS_GONE:
                self.gone = f"{status} {msg.headers.get('Description', '') if msg.headers else ''}".strip()
            if msg.subject == self._current:
                self._end()
        else:
            return  # 100: idle heartbeat / flow control
        self._wake.set()

    def _end(self) -> None:
        self._current = ""
        self._ended.set()

    async def _request(self, batch: int, expires_s: float) -> None:
        self._ended.clear()
        self._n += 1
        self._current = f"{self._inbox}.{self._n}"
        self._remaining = batch
        self._deadline = time.monotonic() + expires_s + 2.0
        body = b'{"batch":%d,"expires":%d}' % (batch, int(expires_s * 1e9))
        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}", body, reply=self._current)

    def _take(self) -> list[Msg]:
        taken, self._buffer = self._buffer, []
        return taken

    async def next_batch(self, max_wait_s: float, expires_s: float = 2.0) -> list[Msg]:
        """The messages delivered so far (in stream order), waiting up to ``max_wait_s`` for one;
        a request for the next ``batch`` is in flight whenever this returns."""
        if self.nc.stats["reconnects"] != self._reconnects:
            raise ConsumerGone("reconnected to NATS")
        if self._current and time.monotonic() > self._deadline:
            raise ConsumerGone(f"pull request unanswered for {expires_s + 2:g} s")
        if not self._current:
            await self._request(self.batch, expires_s)
        if not self._buffer:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max_wait_s)
        if self.gone and not self._buffer:
            raise ConsumerGone(self.gone)
        taken = self._take()
        if not self._current:
            await self._request(self.batch, expires_s)  # the next batch flows while this one is applied
        return taken

    def hurry(self) -> None:
        """A ``fetch`` waiting now returns what is buffered at once; its pull request stays open
        on the server until it expires, and what that delivers is buffered for the next fetch."""
        if self._current:
            self._end()

    async def fetch(self, wait_s: float) -> list[Msg]:
        """Up to ``batch`` messages: what is buffered, topped up by one request that ends when the
        batch is full or after ``wait_s`` (the caller checks ``gone`` when nothing came)."""
        if len(self._buffer) < self.batch:
            await self._request(self.batch - len(self._buffer), wait_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), wait_s + 5.0)
            self._current = ""
        return self._take()


class InOrder:
    """Deliveries -> envelopes in stream order, exactly once, from ``next_seq`` on (module header)."""

    def __init__(self, nc: Client, stream: str, next_seq: int = 1) -> None:
        self.nc, self.stream = nc, stream
        self.next_seq = next_seq  # the seq expected next; a later one means messages to fetch directly

    async def envelopes(self, msgs: list[Msg]) -> list[Envelope]:
        envelopes: list[Envelope] = []
        for msg in msgs:
            try:
                envelope = envelope_of(msg)
            except ValueError as exc:
                log.error("skipping a delivery without JetStream metadata: %s", exc)
                continue
            if envelope.seq < self.next_seq:
                continue  # redelivered: already folded in
            if envelope.seq > self.next_seq:
                envelopes.extend(await self._fill(self.next_seq, envelope.seq - 1))
            envelopes.append(envelope)
            self.next_seq = envelope.seq + 1
        return envelopes

    async def _fill(self, first: int, last: int) -> list[Envelope]:
        found = []
        for seq in range(first, last + 1):
            envelope = await get_envelope(self.nc, self.stream, seq)
            if envelope is not None:
                found.append(envelope)
        log.warning("%s seqs %d..%d missing from the delivery: %d fetched directly, %d no longer in the stream",
                    self.stream, first, last, len(found), last - first + 1 - len(found))
        return found
