"""The simulated engine's KV cache events on vLLM's wire (``laswrr sim-engine --kv-events ENDPOINT``).

What vLLM's ``ZmqEventPublisher`` does (``collectors/kv_events.py``, "The wire"), for the
simulated prefix cache (``prefix_cache.py``): after every advance of the engine that stored or
evicted blocks, one ``KVEventBatch`` (named fields, as vLLM 0.11 and later encode it) on a
publishing socket bound to ``ENDPOINT``, as the multipart message ``[topic, seq, payload]``, ``seq`` an 8-byte
big-endian counter from 0 at every engine start. With ``--kv-events-replay ENDPOINT2`` a ROUTER
socket answers an 8-byte start sequence with the last ``BUFFER_STEPS`` batches from there, each
``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", -1, b""]``.

The socket is an XPUB, a PUB to its subscribers, which also hears their subscriptions:
``subscribers`` (``GET /sim/state``, ``kv_events_subscribers``) counts those subscribed now, so a
test can wait until a subscriber will get the next batch rather than lose it to the PUB's
"slow joiner" (a batch published before a subscription arrives is not sent to it).

The events: a run of blocks stored one after the other, each the child of the one before, is one
``BlockStored`` (``block_hashes`` the blocks' keys, which stand for the engine's own hashes,
``parent_block_hash`` the key of the block before the first, None for a prompt's first, and the
blocks' ``token_ids``); evicted blocks are one ``BlockRemoved``, in the order the cache logged
them. The engine never resets its cache, so it never sends ``AllBlocksCleared``; a restarted
engine counts from 0 again, which is how ``laswrr kv-events`` tells it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from laswrr.collectors.kv_events import NamedBatch, NamedRemoved, NamedStored
from laswrr.services.sim_engine.prefix_cache import BlockChange

log = logging.getLogger("laswrr.sim_engine.kv_events")

BUFFER_STEPS = 10_000  # vLLM's default replay buffer
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENCODER = msgspec.msgpack.Encoder()


def batch_events(changes: Sequence[BlockChange], block_size: int) -> list[NamedStored | NamedRemoved]:
    """The change log as vLLM's events (module docstring, "The events")."""
    events: list[NamedStored | NamedRemoved] = []
    hashes: list[int] = []
    tokens: list[int] = []
    parent: int | None = None
    stored = False

    def flush() -> None:
        if hashes:
            events.append(NamedStored(block_hashes=list(hashes), token_ids=list(tokens), block_size=block_size,
                                      parent_block_hash=parent, medium="GPU") if stored
                          else NamedRemoved(block_hashes=list(hashes), medium="GPU"))
        hashes.clear()
        tokens.clear()

    for change in changes:
        follows = hashes and stored == change.stored and (not stored or change.parent == hashes[-1])
        if not follows:
            flush()
            stored, parent = change.stored, change.parent
        hashes.append(change.key)
        tokens.extend(change.token_ids)
    flush()
    return events


class KvEventPublisher:
    """The publishing socket (and the replay ROUTER) of one simulated engine."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every subscription and unsubscription, duplicates too
        self.subscribers = 0
        self.router: zmq.asyncio.Socket | None = None
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._tasks: list[asyncio.Task[None]] = []
        try:
            self.pub.bind(endpoint)
            if replay_endpoint is not None:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        self._tasks.append(asyncio.create_task(self._follow_subscriptions(), name="sim-engine-kv-subscriptions"))
        if self.router is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="sim-engine-kv-replay"))
        log.info("KV events published on %s (replay: %s)", endpoint, replay_endpoint or "none")

    def publish(self, changes: Sequence[BlockChange], block_size: int) -> None:
        """One batch of the changes (none when there are none). A PUB socket never blocks: a
        subscriber too slow for its high-water mark loses messages (and asks the replay)."""
        events = batch_events(changes, block_size)
        if not events:
            return
        payload = _ENCODER.encode(NamedBatch(ts=time.time(), events=events, data_parallel_rank=None))
        seq = self.seq.to_bytes(8, "big")
        self.buffer.append((self.seq, payload))
        self.seq += 1
        self.pub.send_multipart([self.topic, seq, payload])  # done at once: PUB drops rather than waits

    async def _follow_subscriptions(self) -> None:
        while True:
            message = await self.pub.recv()  # 1 + topic: subscribed; 0 + topic: unsubscribed (or gone)
            if message[:1] == b"\x01":
                self.subscribers += 1
            elif message[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a replay request of %d frame(s) ignored", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()
