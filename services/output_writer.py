"""The scheduler service's output side: every output once and in order in LB_OUT, each pool's
latest snapshot in KV LB_WEIGHTS, never going back in time (docs/wire.md).

Theory of operation.

* **LB_OUT in order.** ``OutputWriter.publish`` sends a batch's outputs with ``publish_async``
  and ``Nats-Msg-Id: output.msg_id`` (derived from ``as_of_seq``) and awaits the pub acks
  together. On a failure everything from the first unacknowledged output on is sent again (msg
  ids de-duplicate), so LB_OUT keeps the order; retried until it succeeds or the service is
  stopping, and logged once per interval while it keeps failing (``Throttled``). An output too
  large to publish never gets here: the service replaces it first (``schemas.codec.publishable``). Then ``gave_up`` is set (no checkpoint may be written past those outputs) and the
  next start publishes them: they lie above its publish floor.
* **LB_WEIGHTS by compare-and-set.** ``note`` keeps each pool's newest snapshot of a batch;
  ``flush_weights`` writes them with create / update-on-the-last-known-revision, re-reading when
  another replica wrote meanwhile, so a pool's entry never goes back to an older ``as_of_seq``.
* **The publish floor.** ``highest_published_seq`` reads the highest ``as_of_seq`` among the last
  messages of LB_OUT: at start, the outputs of inputs up to it are already published (msg-id
  de-duplication alone would not do: its window is 2 minutes, a restart can come much later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Output
from laswrr.services.natsbus import MSG_ID, Throttled, publish_acked

log = logging.getLogger("laswrr.scheduler")

PUBLISH_FLOOR_SCAN = 64  # LB_OUT tail messages read at start to find the highest as_of_seq
PUBLISH_TIMEOUT_S = 5.0
CAS_ATTEMPTS = 10


def as_of_seq_of(msg_id: str | None, data: bytes | None) -> int:
    """The cause of an LB_OUT message: from its msg id ``<as_of_seq>:<subject>``, else its payload."""
    if msg_id:
        head = msg_id.split(":", 1)[0]
        if head.isdigit():
            return int(head)
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        return _AS_OF.decode(data or b"").as_of_seq
    return 0


class _AsOf(msgspec.Struct):
    as_of_seq: int  # every output names its input so (schemas.outputs)


_AS_OF = msgspec.json.Decoder(_AsOf)


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
        msg_id = (msg.headers or {}).get(MSG_ID)
        best = max(best, as_of_seq_of(msg_id, msg.data))
    return best


class OutputWriter:
    """LB_OUT and LB_WEIGHTS for one scheduler replica; ``await open()`` before use."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.gave_up = False  # outputs left unpublished at shutdown
        self._failing = Throttled(log)
        self._weights: KeyValue | None = None
        self._kv_known: dict[str, tuple[int, int]] = {}  # pool -> (as_of_seq, revision) in LB_WEIGHTS
        self._latest: dict[str, Output] = {}  # pool -> newest snapshot output not yet in LB_WEIGHTS
        self._events_last_seq = 0  # LB_EVENTS' last seq when last looked up (a bound on any true as_of_seq)

    async def open(self) -> None:
        self._weights = await self.js.key_value(sj.WEIGHTS_BUCKET)

    # -- LB_OUT ---------------------------------------------------------------------------------

    async def publish(self, outputs: Sequence[Output], stopping: asyncio.Event) -> int:
        """Publish ``outputs`` in order (module header); returns how many were acknowledged."""
        pending = list(outputs)
        attempt = published = 0
        while pending:
            acked = await self._publish_once(pending)
            published += acked
            pending = pending[acked:]
            if not pending:
                break
            attempt += 1
            if stopping.is_set():
                log.error("stopping with %d outputs unpublished (from seq %d): the next start publishes them",
                          len(pending), pending[0].as_of_seq)
                self.gave_up = True
                break
            self._failing.failed("%d outputs not acknowledged by LB_OUT (from seq %d); retrying", len(pending),
                                 pending[0].as_of_seq)
            await asyncio.sleep(min(2.0, 0.1 * attempt))
        if attempt and not pending:
            self._failing.ok("LB_OUT acknowledges outputs again (after %d retries)", attempt)
        return published

    async def _publish_once(self, outputs: Sequence[Output]) -> int:
        """The number of leading outputs whose pub acks arrived."""
        messages = [(output.subject, output.data, output.msg_id) for output in outputs]
        return await publish_acked(self.js, messages, PUBLISH_TIMEOUT_S, wait_stall=PUBLISH_TIMEOUT_S)

    # -- LB_WEIGHTS -----------------------------------------------------------------------------

    def note(self, outputs: Sequence[Output]) -> None:
        """Remember each pool's newest snapshot among ``outputs`` for the next ``flush_weights``."""
        for output in outputs:
            if output.subject.startswith(sj.OUT_SNAPSHOT + "."):
                self._latest[output.subject[len(sj.OUT_SNAPSHOT) + 1:]] = output

    async def flush_weights(self) -> None:
        for pool, output in list(self._latest.items()):
            await self._put_if_newer(pool, output)
            del self._latest[pool]

    async def _put_if_newer(self, pool: str, output: Output) -> None:
        """Compare-and-set: a pool's KV entry never goes back to an older ``as_of_seq``."""
        assert self._weights is not None
        for _ in range(CAS_ATTEMPTS):
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
        log.warning("could not update LB_WEIGHTS[%s] to seq %d after %d attempts", pool, output.as_of_seq,
                    CAS_ATTEMPTS)

    async def _read_weight(self, pool: str) -> tuple[int, int]:
        """``(as_of_seq, revision)`` of the pool's entry. An entry that claims a seq beyond
        LB_EVENTS' last one was not written by a scheduler (a hostile or stray writer: "newest
        wins" would keep it for good), so it counts as 0 and is replaced; one that does not
        decode counts as 0 too."""
        assert self._weights is not None
        try:
            entry = await self._weights.get(pool)
        except KeyNotFoundError:  # also a deleted key: create() works on it
            return (0, 0)
        seq = as_of_seq_of(None, entry.value)
        if seq > self._events_last_seq:
            self._events_last_seq = (await self.js.stream_info(sj.EVENTS_STREAM)).state.last_seq
            if seq > self._events_last_seq:
                log.warning("LB_WEIGHTS[%s] claims as_of_seq %d, beyond LB_EVENTS' last seq %d: not a scheduler's "
                            "snapshot; replacing it", pool, seq, self._events_last_seq)
                seq = 0
        return (seq, entry.revision or 0)
