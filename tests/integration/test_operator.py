"""`laswrr capacity|drain|undrain|remove|register|nodes` as an operator runs them (real processes)
against a real nats-server and an in-process scheduler service."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import select
import signal
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.outputs import LoadView, NodeView, Rejected, WeightSnapshot
from laswrr.schemas.words import Phase, RejectCause
from laswrr.services.natsbus import connect
from laswrr.services.operator import Outcome, publish_and_wait
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService


async def laswrr(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "laswrr", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def scheduler(nats_url: str, js: JetStreamContext) -> AsyncIterator[SchedulerService]:
    nc = await connect(nats_url, "scheduler")
    service = SchedulerService(nc, SchedulerOptions(tick_ms=100, fetch_timeout_s=0.1))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 10)
    yield service
    stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)
    await nc.close()


async def test_write_commands_report_applied_and_rejected(nats_url: str, js: JetStreamContext,
                                                          scheduler: SchedulerService) -> None:
    code, out, err = await laswrr("register", "n1", "--url", "http://127.0.0.1:9001", "--chip", "910B",
                                  "--capacity", "8", "--nats-url", nats_url)
    assert code == 0, err
    assert out.startswith("applied: lb.admin.node.n1") and "n1 new -> active" in out

    code, out, _ = await laswrr("capacity", "n1", "-1", "--nats-url", nats_url)
    assert code == 1 and out.startswith("rejected: ") and ">= 0" in out

    # The same code path in-process (saves a process start per command).
    async def run(subject: str, body: bytes, node: str) -> str:
        outcome = await publish_and_wait(nats_url, subject, body, node, 3.0)
        assert outcome is not None
        return outcome.summary(subject)

    assert "capacity 2" in await run("lb.admin.capacity.n1", b'{"capacity": 2}', "n1")
    last = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq
    msg = await js.get_msg(sj.EVENTS_STREAM, last)
    while msg.subject != "lb.admin.capacity.n1":  # ticks may have followed it
        last -= 1
        msg = await js.get_msg(sj.EVENTS_STREAM, last)
    assert msg.data == b'{"capacity": 2}' and not msg.headers  # what `nats pub` sends
    assert "rejected: unknown node 'ghost'" in await run("lb.admin.drain.ghost", b"{}", "ghost")
    assert "n1 active -> draining (operator drain)" in await run("lb.admin.drain.n1", b"{}", "n1")
    assert "-> recovering" in await run("lb.admin.undrain.n1", b"{}", "n1")
    assert "removed" in await run("lb.admin.remove.n1", b"{}", "n1")


async def test_nodes_prints_a_table_per_pool_and_json(nats_url: str, js: JetStreamContext,
                                                      scheduler: SchedulerService,
                                                      eventually: Callable[..., Awaitable[Any]]) -> None:
    await js.publish("lb.admin.node.a1", b'{"url": "http://a1", "capacity": 8, "chip": "910C"}')
    last = await js.publish("lb.admin.node.b1", b'{"url": "http://b1", "capacity": 4, "pool": "batch"}')
    await asyncio.wait_for(_applied(scheduler, last.seq), 5)
    weights = await js.key_value(sj.WEIGHTS_BUCKET)

    async def both_pools_in_weights() -> bool:  # the scheduler's next batch puts them into LB_WEIGHTS
        with contextlib.suppress(KeyNotFoundError):
            return bool((await weights.get("default")).value and (await weights.get("batch")).value)
        return False

    await eventually(both_pools_in_weights, what="both pools' snapshots in LB_WEIGHTS")
    code, out, err = await laswrr("nodes", "--nats-url", nats_url)
    assert code == 0, err
    assert "pool batch" in out and "pool default" in out and "a1" in out and "b1" in out
    assert "active" in out and "effective" in out and "sample age" in out
    code, out, _ = await laswrr("nodes", "--pool", "batch", "--json", "--nats-url", nats_url)
    read = json.loads(out)
    assert set(read) == {"ts_ms", "pools"}  # the shape of a --watch line
    snapshots = read["pools"]
    assert list(snapshots) == ["batch"] and snapshots["batch"]["nodes"][0]["node"] == "b1"
    code, _, err = await laswrr("nodes", "--pool", "nope", "--nats-url", nats_url)
    assert code == 1 and "no pool 'nope'" in err


async def _applied(service: SchedulerService, seq: int) -> None:
    while service.applied_seq < seq:
        await asyncio.sleep(0.02)


async def test_timeout_bad_node_id_and_unreachable_nats(nats_url: str, js: JetStreamContext) -> None:
    code, _, err = await laswrr("capacity", "n1", "1", "--wait", "0.3", "--nats-url", nats_url)
    assert code == 3 and "timeout" in err  # no scheduler running
    code, _, err = await laswrr("drain", "bad.node", "--nats-url", nats_url)
    assert code == 2 and "invalid node id" in err
    code, _, err = await laswrr("nodes", "--nats-url", "nats://127.0.0.1:1")
    assert code == 2 and err.count("\n") == 1 and "cannot connect" in err


def _rejected(as_of_seq: int, reason: str) -> bytes:
    return encode(Rejected(as_of_seq=as_of_seq, subject="x", cause=RejectCause.UNKNOWN_NODE, reason=reason))


def _snapshot(pool: str, as_of_seq: int, node: str) -> bytes:
    load = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
    view = NodeView(node=node, url="http://x", phase=Phase.ACTIVE, routable=True, capacity=4, target_weight=4,
                    effective_weight=4, inflight=0, chip="c", health=1, load=load)
    return encode(WeightSnapshot(pool=pool, as_of_seq=as_of_seq, tick=1, ts_ns=1, panic=False, nodes=[view]))


def test_outcome_folds_outputs_in_order() -> None:
    outcome = Outcome(seq=10, node="n1")
    outcome.observe(sj.OUT_REJECTED, _rejected(9, "older"))
    outcome.observe(sj.out_snapshot("default"), _snapshot("default", 9, "n1"))
    assert not outcome.applied and outcome.rejected is None
    outcome.observe(sj.OUT_REJECTED, b'{"as_of_seq": 10, "reason": "not a rejection: no cause"}')  # ignored
    assert outcome.rejected is None
    outcome.observe(sj.OUT_REJECTED, _rejected(10, "bad"))
    assert outcome.rejected == "bad" and outcome.summary("x") == "rejected: bad"

    later = Outcome(seq=10, node="n1")
    later.observe(sj.OUT_REJECTED, _rejected(11, "someone else's"))
    assert later.applied and not later.described  # 10 went through; no view of n1 yet
    later.observe(sj.out_snapshot("other"), _snapshot("other", 12, "x"))
    assert not later.described
    later.observe(sj.out_snapshot("default"), _snapshot("default", 12, "n1"))
    assert later.described and later.pool == "default" and later.view is not None and later.view.phase == Phase.ACTIVE


async def test_nodes_watch_prints_json_lines_when_not_a_terminal(nats_url: str, js: JetStreamContext,
                                                                 scheduler: SchedulerService) -> None:
    last = await js.publish("lb.admin.node.w1", b'{"url": "http://w1", "capacity": 8}')
    await asyncio.wait_for(_applied(scheduler, last.seq), 5)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "nodes", "--watch", "--interval-s", "200ms", "--nats-url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        capacities = []
        changed = False
        while len(capacities) < 40 and 3 not in capacities:
            line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 45))  # a loaded box starts slowly
            assert set(line) == {"ts_ms", "pools"}
            nodes = line["pools"].get("default", {}).get("nodes", [])
            capacities.append(next((n["capacity"] for n in nodes if n["node"] == "w1"), None))
            if capacities[-1] == 8 and not changed:
                await js.publish("lb.admin.capacity.w1", b'{"capacity": 3}')
                changed = True
        assert capacities[0] == 8 and capacities[-1] == 3  # the same process saw the change
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_nodes_watch_refreshes_the_table_in_place_on_a_terminal(nats_url: str, js: JetStreamContext,
                                                                     scheduler: SchedulerService) -> None:
    last = await js.publish("lb.admin.node.t1", b'{"url": "http://t1", "capacity": 2}')
    await asyncio.wait_for(_applied(scheduler, last.seq), 5)
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "nodes", "--watch", "--interval-s", "200ms", "--nats-url", nats_url,
        stdout=slave, stderr=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
    os.close(slave)
    try:
        screen = b""
        deadline = asyncio.get_running_loop().time() + 60  # a loaded box starts Python slowly
        while screen.count(b"pool default") < 3 and asyncio.get_running_loop().time() < deadline:
            ready, _, _ = await asyncio.to_thread(select.select, [master], [], [], 0.5)
            if ready:
                screen += os.read(master, 65536)
        assert screen.count(b"pool default") >= 3 and b"t1" in screen
        assert b"\x1b[2K" in screen or b"\x1b[1A" in screen  # rich Live moves back over the last table
        assert b'"ts_ms"' not in screen  # a table, not JSON lines
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)
