"""One message must not freeze the scheduler: bounded text, and outputs checked against the
connection's max payload before they are published.

Real parts: nats-server on a free port, the scheduler service and the recorder (in-process, on
their own connections), a DuckDB file, and the operator's own ``publish_and_wait`` (what
``laswrr capacity`` runs).

* The poison pill: three failed health probes whose ``error`` is ~1 MB. The node is ejected with
  a reason cut to ``TEXT_MAX_CHARS``, snapshots keep coming for every pool, an operator command
  gets its answer, and the same holds after the scheduler restarts (from its checkpoint).
* An output that cannot be published at all (a snapshot of 200 nodes on a server whose max
  payload is 32 KiB) is replaced by a rejection naming its input, never retried; the other pool's
  snapshots continue, and replay reproduces the replacement exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from tests.replay_cli import replay_exact
from laswrr.schemas import subjects as sj
from laswrr.schemas.words import RejectCause
from laswrr.schemas.outputs import TEXT_MAX_CHARS
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.operator import publish_and_wait
from laswrr.services.recorder import Recorder, RecorderOptions
from laswrr.services.scheduler_service import HEADER_MARGIN_BYTES, SchedulerOptions, SchedulerService

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(90)
MB_ERROR = "connection reset; body: " + "E" * 1_000_000


async def _until(predicate: Any) -> None:
    await wait_until(predicate, 20)


class Stack:
    """Scheduler and recorder on one nats-server; ``client`` publishes and watches LB_OUT."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url, self.data_dir = url, data_dir
        self.outputs: list[tuple[str, dict[str, Any]]] = []

    async def __aenter__(self) -> "Stack":
        self.client = await connect(self.url, "test")
        self.js = self.client.jetstream()
        await ensure_streams(self.js)
        await self.client.subscribe("lb.out.>", cb=self._seen)
        self.recorder_nc = await connect(self.url, "rec")
        self.recorder = Recorder(self.recorder_nc, RecorderOptions(data_dir=self.data_dir, flush_ms=20))
        self.recorder_stop = asyncio.Event()
        self.recorder_task = asyncio.create_task(self.recorder.run(self.recorder_stop))
        await self.start_scheduler()
        await asyncio.wait_for(self.recorder.ready.wait(), 10)
        return self

    async def start_scheduler(self) -> None:
        self.scheduler_nc = await connect(self.url, "sched")
        self.service = SchedulerService(self.scheduler_nc, SchedulerOptions(tick_ms=0, fetch_timeout_s=0.05,
                                                                            checkpoint_every=1))
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.service.run(self.stop))
        await asyncio.wait_for(self.service.ready.wait(), 10)

    async def stop_scheduler(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 10)
        await self.scheduler_nc.close()

    async def _seen(self, msg: Any) -> None:
        self.outputs.append((msg.subject, msgspec.json.decode(msg.data)))

    async def publish(self, subject: str, body: bytes) -> int:
        return (await self.js.publish(subject, body)).seq

    async def applied(self, seq: int) -> None:
        await _until(lambda: self.service.applied_seq >= seq)

    def snapshot_after(self, pool: str, seq: int) -> dict[str, Any] | None:
        for subject, payload in self.outputs:
            if subject == sj.out_snapshot(pool) and payload["as_of_seq"] >= seq:
                return payload
        return None

    async def recorded(self) -> None:
        last = (await self.js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        out_last = (await self.js.stream_info(sj.OUT_STREAM)).state.last_seq
        await _until(lambda: self.recorder.recorded_through[sj.EVENTS_STREAM] >= last
                     and self.recorder.recorded_through[sj.OUT_STREAM] >= out_last)

    async def __aexit__(self, *exc: object) -> None:
        if not self.task.done():
            await self.stop_scheduler()
        self.recorder_stop.set()
        await asyncio.wait_for(self.recorder_task, 10)
        for nc in (self.client, self.recorder_nc):
            await nc.close()


def register(node: str, pool: str = "default") -> bytes:
    return b'{"url": "http://%s:8000", "capacity": 4, "pool": "%s"}' % (node.encode(), pool.encode())


async def test_a_megabyte_of_health_error_text_freezes_nothing(nats_url: str, tmp_path: Path) -> None:
    async with Stack(nats_url, tmp_path) as stack:
        for node, pool in (("a", "default"), ("b", "default"), ("c", "other")):
            await stack.publish(sj.admin_node(node), register(node, pool))
        pill = msgspec.json.encode({"ok": False, "error": MB_ERROR})
        assert 1_000_000 < len(pill) < stack.client.max_payload  # the input itself is publishable
        for _ in range(3):
            seq = await stack.publish(sj.health("a"), pill)
        tick = await stack.publish(sj.CLOCK_TICK, b'{"tick": 1}')
        await stack.applied(tick)
        await _until(lambda: stack.snapshot_after("default", tick) and stack.snapshot_after("other", tick))
        view = {n["node"]: n for n in stack.snapshot_after("default", tick)["nodes"]}  # type: ignore[index]
        assert view["a"]["phase"] == "ejected"
        assert view["a"]["phase_reason"].startswith("3 failed health probes: connection reset; body: EEE")
        assert len(view["a"]["phase_reason"]) <= TEXT_MAX_CHARS
        phases = [p for s, p in stack.outputs if s == sj.out_phase("a") and p["as_of_seq"] == seq]
        assert len(phases) == 1 and len(phases[0]["reason"]) <= TEXT_MAX_CHARS

        outcome = await publish_and_wait(nats_url, sj.admin_capacity("b"), b'{"capacity": 2}', "b", 10.0)
        assert outcome is not None and outcome.applied and outcome.rejected is None  # laswrr capacity answered

        await stack.stop_scheduler()  # a restart (from the checkpoint) is just as healthy
        await stack.start_scheduler()
        again = await stack.publish(sj.CLOCK_TICK, b'{"tick": 2}')
        await stack.applied(again)
        await _until(lambda: stack.snapshot_after("default", again) and stack.snapshot_after("other", again))
        await stack.recorded()
    with store.open_read(tmp_path / store.DB_FILE) as con:
        result = replay_db(con)
        assert result.identical, result.first and result.first.describe()
    replay_exact(tmp_path / store.DB_FILE)  # and as an operator runs it


async def test_an_output_over_the_max_payload_becomes_a_rejection_of_its_input(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log"), config="max_payload: 32768") as nats:
        async with Stack(nats.url, tmp_path) as stack:
            assert stack.client.max_payload == 32768
            await stack.publish(sj.admin_node("solo"), register("solo", "small"))
            for i in range(200):
                last = await stack.publish(sj.admin_node(f"n{i:03d}"), register(f"n{i:03d}", "big"))
            tick = await stack.publish(sj.CLOCK_TICK, b'{"tick": 1}')
            await stack.applied(tick)
            await _until(lambda: stack.snapshot_after("small", tick) is not None)
            rejected = {p["as_of_seq"]: p for s, p in stack.outputs if s == sj.OUT_REJECTED}
            assert rejected[tick]["subject"] == sj.CLOCK_TICK
            assert rejected[tick]["cause"] == RejectCause.UNPUBLISHABLE_OUTPUT
            assert rejected[tick]["limit"] == stack.client.max_payload - HEADER_MARGIN_BYTES
            assert sj.out_snapshot("big") in rejected[tick]["reason"]
            assert rejected[last]["subject"] == sj.admin_node("n199")  # the registration that tipped it over
            assert stack.snapshot_after("big", last) is None
            await stack.recorded()
        with store.open_read(tmp_path / store.DB_FILE) as con:
            result = replay_db(con)
            assert result.identical, result.first and result.first.describe()
            assert result.outputs_compared > 200
        replay_exact(tmp_path / store.DB_FILE)
