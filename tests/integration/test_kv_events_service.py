"""`laswrr kv-events` on a real nats-server, fed over real ZMQ sockets with the batches a real vLLM
published (tests/fixtures/kv_events): a node registered with ``kv_events`` is subscribed to, its
cache changes arrive on ``lb.kv.<node>``; batches the subscription missed are fetched from the
replay endpoint; a gap the replay cannot fill drops the node's index (``cleared``, reason gap);
a registration without ``kv_events`` stops the subscription. SGLang's publisher (its replay answers
without the topic frame) is followed the same way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from nats.aio.client import Client

from laswrr.collectors.kv_events import NodeCache, decode_frames
from laswrr.schemas import subjects as sj
from laswrr.schemas.kvcache import CACHE_DECODER, CacheChanged
from laswrr.services import kv_events
from laswrr.services.nats_server import free_port

from tests.conftest import Eventually

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events" / "vllm-0.32.0-cpu_named_tiny-llama.jsonl"
SGLANG = FIXTURE.with_name("sglang-pages16_current-layout.jsonl")


def frames_of(path: Path) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in json.loads(line)["frames"]] for line in path.read_text().splitlines()]


FRAMES = frames_of(FIXTURE)
END = (-1).to_bytes(8, "big", signed=True)


class Engine:
    """vLLM's publisher's two sockets: PUB, and a ROUTER replaying what it holds (``held``); with
    ``sglang``, SGLang's, whose replay answers leave the topic out."""

    def __init__(self, sglang: bool = False) -> None:
        self.sglang = sglang
        self.frames = frames_of(SGLANG) if sglang else FRAMES
        self.ctx = zmq.asyncio.Context()
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that also reads its subscribers' (un)subscriptions
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.held: list[list[bytes]] = []
        self.asked: list[int] = []
        self.task = asyncio.create_task(self.serve_replay())

    async def serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            for frames in self.held:
                if int.from_bytes(frames[1], "big") >= self.asked[-1]:
                    await self.router.send_multipart([client, b"", *(frames[1:] if self.sglang else frames)])
            await self.router.send_multipart([client, b"", *([] if self.sglang else [b""]), END, b""])

    async def publish(self, k: int, replayable: bool = True) -> None:
        if replayable:
            self.held.append(self.frames[k])
        await self.pub.send_multipart(self.frames[k])

    async def subscription(self, subscribe: bool) -> None:
        """Until a subscription (with ``subscribe`` False: its end) reaches the publisher: from then
        on what it sends reaches the subscriber (or no one)."""
        flag = b"\x01" if subscribe else b"\x00"
        while not (await asyncio.wait_for(self.pub.recv(), 15)).startswith(flag):
            pass

    async def subscribed(self) -> None:
        await self.subscription(True)

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    yield e
    e.close()


async def test_subscribe_replay_gap_and_stop(nats_url: str, nc: Client, engine: Engine, eventually: Eventually) -> None:
    changes: list[CacheChanged] = []

    async def on_kv(msg: object) -> None:
        assert sj.kv_node(msg.subject) == "n1"  # type: ignore[attr-defined]
        changes.append(CACHE_DECODER.decode(msg.data))  # type: ignore[attr-defined]

    await nc.subscribe(sj.kv("n1"), cb=on_kv)
    await nc.flush()
    stop = asyncio.Event()
    service = asyncio.create_task(kv_events.serve(nats_url, stop=stop))
    js = nc.jetstream()
    await js.publish(sj.admin_node("n1"), json.dumps({
        "url": "http://127.0.0.1:1", "capacity": 4, "kv_events": f"tcp://127.0.0.1:{engine.pub_port}",
        "kv_events_replay": f"tcp://127.0.0.1:{engine.replay_port}"}).encode())
    await engine.subscribed()
    for k in (0, 1, 2):  # one lost all the same (a slow joiner) would be fetched from the replay endpoint
        await engine.publish(k)
    # batches 3 and 4 never reach the subscriber, but the replay endpoint has them
    engine.held += [FRAMES[3], FRAMES[4]]
    await engine.publish(5)
    await eventually(lambda: changes and changes[-1].seq == 5, what="batch 5")
    expected = NodeCache()
    wanted = [c for f in FRAMES[:6] if (c := expected.fold(decode_frames(f))) is not None]  # type: ignore[arg-type]
    assert [(c.seq, c.stored, c.removed, c.cleared) for c in changes] == \
        [(c.seq, c.stored, c.removed, c.cleared) for c in wanted]
    assert [c.n for c in changes] == list(range(1, len(changes) + 1))
    assert changes[0].cleared and changes[0].reason == "cleared"  # the fixture starts with a cache reset
    assert 3 in engine.asked  # the missed batches were asked for
    # batches 6 and 7 are lost for good: the node's index is dropped, not trusted
    await engine.publish(8)
    await eventually(lambda: changes[-1].seq == 8, what="batch 8")
    assert changes[-1].cleared and changes[-1].reason == "gap"
    # registered again without kv_events: the subscription stops
    await js.publish(sj.admin_node("n1"), json.dumps({"url": "http://127.0.0.1:1", "capacity": 4}).encode())
    count = len(changes)
    await engine.subscription(False)  # the service closed its subscriber
    engine.held.clear()
    await engine.pub.send_multipart(FRAMES[0][:1] + [(9).to_bytes(8, "big"), FRAMES[0][2]])
    await asyncio.sleep(0.5)  # a window in which the service must not take the batch up
    assert len(changes) == count
    stop.set()
    stats = await asyncio.wait_for(service, 10)
    assert stats.cleared[("n1", "gap")] == 1 and stats.replayed["n1"] >= 2 and not stats.rejected


async def test_a_message_that_does_not_decode_is_counted_not_fatal(nats_url: str, nc: Client, engine: Engine,
                                                                   eventually: Eventually) -> None:
    changes: list[bytes] = []

    async def on_kv(msg: object) -> None:
        changes.append(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(sj.kv("n2"), cb=on_kv)
    stop = asyncio.Event()
    service = asyncio.create_task(kv_events.serve(nats_url, stop=stop))
    await nc.jetstream().publish(sj.admin_node("n2"), json.dumps({
        "url": "http://127.0.0.1:1", "capacity": 4, "kv_events": f"tcp://127.0.0.1:{engine.pub_port}"}).encode())
    await engine.subscribed()
    await engine.pub.send_multipart([b"kv", b"\x00" * 8, b"\xc1 not msgpack"])
    await engine.publish(0)
    await eventually(lambda: changes, what="the batch after the bad message")
    stop.set()
    stats = await asyncio.wait_for(service, 10)
    assert sum(v for (node, _), v in stats.rejected.items() if node == "n2") >= 1
    assert b"laswrr_kv_events_rejected_total" in stats.render()


async def test_sglang_s_replay_fills_what_the_subscription_missed(nats_url: str, nc: Client,
                                                                  eventually: Eventually) -> None:
    engine = Engine(sglang=True)
    changes: list[CacheChanged] = []

    async def on_kv(msg: object) -> None:
        changes.append(CACHE_DECODER.decode(msg.data))  # type: ignore[attr-defined]

    try:
        await nc.subscribe(sj.kv("s1"), cb=on_kv)
        stop = asyncio.Event()
        service = asyncio.create_task(kv_events.serve(nats_url, stop=stop))
        await nc.jetstream().publish(sj.admin_node("s1"), json.dumps({
            "url": "http://127.0.0.1:1", "capacity": 4, "kv_events": f"tcp://127.0.0.1:{engine.pub_port}",
            "kv_events_replay": f"tcp://127.0.0.1:{engine.replay_port}"}).encode())
        await engine.subscribed()
        await engine.publish(0)
        engine.held += engine.frames[1:4]  # batches 1 to 3 never reach the subscriber; the replay has them
        await engine.publish(4)  # a salted request's page: no change a router sees, but it asks for 1 to 3
        await eventually(lambda: changes and changes[-1].seq == 3, what="batches 1 to 3 replayed")
        stop.set()
        stats = await asyncio.wait_for(service, 10)
    finally:
        engine.close()
    expected = NodeCache()
    wanted = [c for f in engine.frames[:5] if (c := expected.fold(decode_frames(f))) is not None]  # type: ignore[arg-type]
    assert [(c.seq, c.stored, c.removed) for c in changes] == [(c.seq, c.stored, c.removed) for c in wanted]
    assert not any(c.cleared for c in changes) and stats.replayed["s1"] == 3 and not stats.rejected
