"""The recorder against a real nats-server and a real DuckDB file: exactly-once across SIGKILL,
graceful stop, malformed payloads, hole repair, and live reads while it holds the write lock."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.recorder_copy import copy_from_recorder

pytestmark = pytest.mark.timeout(60)
STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _reap_recorders() -> Iterator[None]:
    """A failed test must not leave a recorder behind."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_recorder(url: str, data_dir: Path, *extra: str, ready: bool = True) -> subprocess.Popen[bytes]:
    """``laswrr recorder`` as a child process; with ``ready``, wait until it records."""
    log_file = data_dir / f"recorder-{time.monotonic_ns()}.log"
    with open(log_file, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "laswrr", "recorder", "--nats-url", url,
                                 "--data-dir", str(data_dir), *extra], stdout=subprocess.DEVNULL, stderr=log)
    proc.log_file = log_file  # type: ignore[attr-defined]
    STARTED.append(proc)
    deadline = time.monotonic() + 20
    while ready and b" recording " not in log_file.read_bytes():
        assert proc.poll() is None, log_file.read_text()
        assert time.monotonic() < deadline, "recorder did not start"
        time.sleep(0.02)
    return proc


async def ack_floor(js, stream: str, durable: str) -> int:  # type: ignore[no-untyped-def]
    try:
        info = await js.consumer_info(stream, durable)
    except Exception:  # noqa: BLE001 - not created yet
        return 0
    return int(info.ack_floor.stream_seq or 0)


async def wait_acked(js, stream: str, durable: str, seq: int, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while await ack_floor(js, stream, durable) < seq:
        assert time.monotonic() < deadline, f"{stream}: recorder did not ack up to {seq}"
        await asyncio.sleep(0.02)


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        print(proc.log_file.read_text())  # type: ignore[attr-defined]
    return code


def rows(db: Path, stream: str) -> list[tuple[int, int, str, str]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT seq, ts_ns, subject, data FROM events WHERE stream = ? ORDER BY seq",
                           [stream]).fetchall()
    finally:
        con.close()


async def stream_times(js, stream: str, seqs: list[int]) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """The exact stored timestamps (ns) of some messages, read back with STREAM.MSG.GET."""
    from laswrr.services.recorder import Recorder, RecorderOptions

    recorder = Recorder(js._nc, RecorderOptions())
    out = {}
    for seq in seqs:
        got = await recorder._get_msg(stream, seq)
        assert got is not None
        out[seq] = got[1]
    return out


async def test_sigkill_mid_run_loses_nothing_and_duplicates_nothing(nats_url: str, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    total = 4000
    publisher_done = asyncio.Event()

    async def publish() -> None:
        for i in range(total):
            await nc.publish(sj.req_started(f"n{i % 3}"), b'{"request_id":"r%d","proxy":"p1"}' % i)
            if i % 10 == 0:
                await nc.publish(sj.out_snapshot("default"), b'{"pool":"default","as_of_seq":%d}' % i)
            if i % 100 == 0:
                await nc.flush()
                await asyncio.sleep(0.01)  # paced: the kills land in the middle of the run
        await nc.flush()
        publisher_done.set()

    publisher = asyncio.create_task(publish())
    kills = 0
    floor = 0
    while kills < 3:
        proc = start_recorder(nats_url, tmp_path, "--batch", "100", "--flush-ms", "20", ready=False)
        # wait for progress past the last kill, then SIGKILL in the middle of the run
        await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", floor + 150)
        proc.kill()
        proc.wait()
        kills += 1
        floor = await ack_floor(js, sj.EVENTS_STREAM, "recorder-events")
    assert floor < total, "the run ended before the kills: make it longer"
    await publisher
    proc = start_recorder(nats_url, tmp_path, "--batch", "100", "--flush-ms", "20")
    events_last = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq
    out_last = (await js.stream_info(sj.OUT_STREAM)).state.last_seq
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", events_last)
    await wait_acked(js, sj.OUT_STREAM, "recorder-out", out_last)
    assert stop(proc) == 0

    recorded = rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)
    assert [r[0] for r in recorded] == list(range(1, total + 1))  # none lost, none duplicated
    assert sorted(r[3] for r in recorded) == sorted('{"request_id":"r%d","proxy":"p1"}' % i for i in range(total))
    assert [r[0] for r in rows(tmp_path / "events.duckdb", sj.OUT_STREAM)] == list(range(1, out_last + 1))
    exact = await stream_times(js, sj.EVENTS_STREAM, [1, total // 2, total])
    assert {r[0]: r[1] for r in recorded if r[0] in exact} == exact  # integer-ns JetStream timestamps
    await nc.close()


async def test_graceful_stop_records_malformed_payloads_and_exits_zero(nats_url: str, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    payloads = [b'{"capacity": 1}', b"not json {", b"", b'{"capacity": -3}', "caf\u00e9".encode()]
    for payload in payloads:
        await js.publish(sj.admin_capacity("n1"), payload, headers={"Nats-Msg-Id": payload.hex() or "empty"})
    proc = start_recorder(nats_url, tmp_path)
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", len(payloads))
    assert stop(proc) == 0
    recorded = rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)
    assert [r[3] for r in recorded] == [p.decode() for p in payloads]
    assert all(r[2] == "lb.admin.capacity.n1" for r in recorded)
    await nc.close()


async def test_restart_fills_a_hole_from_the_stream(nats_url: str, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    for i in range(10):
        await js.publish(sj.health(f"n{i}"), b'{"ok": true}')
    proc = start_recorder(nats_url, tmp_path)
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", 10)
    assert stop(proc) == 0
    before = rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)
    con = duckdb.connect(str(tmp_path / "events.duckdb"))
    con.execute("DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq IN (4, 5, 8)")
    con.close()
    proc = start_recorder(nats_url, tmp_path)  # ready: the repair runs before recording starts
    assert stop(proc) == 0
    assert b"filled 3 hole(s)" in proc.log_file.read_bytes()  # type: ignore[attr-defined]
    after = rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)
    assert after == before  # same seq, ts_ns, subject and data as first recorded
    await nc.close()


async def test_readers_get_a_consistent_copy_while_the_recorder_runs(nats_url: str, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    for i in range(50):
        await js.publish(sj.health("n1"), b'{"ok": true}')
    await js.publish(sj.out_snapshot("default"), b'{"pool":"default","as_of_seq":50}')
    proc = start_recorder(nats_url, tmp_path)
    try:
        await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", 50)
        db = tmp_path / "events.duckdb"
        with pytest.raises(duckdb.IOException):
            duckdb.connect(str(db), read_only=True)  # the one-writer rule, for real
        counts = await asyncio.to_thread(read_counts, db, nats_url)
        assert counts == [("LB_EVENTS", 50), ("LB_OUT", 1)]
        with pytest.raises(duckdb.IOException):
            duckdb.connect(str(db), read_only=True)  # copying did not release the writer's lock
        with pytest.raises(store.StoreError, match="no recorder answered"):
            await asyncio.to_thread(read_counts, db, "nats://127.0.0.1:1")
    finally:
        assert stop(proc) == 0
    await nc.close()


def read_counts(db: Path, url: str) -> list[tuple[str, int]]:
    with store.open_read(db, copy_from_recorder(url, timeout_s=10)) as con:
        result = con.execute("SELECT stream, count(*) FROM events GROUP BY stream ORDER BY stream").fetchall()
        con.execute("SELECT count(*) FROM weights_over_time").fetchall()  # views are there too
        return result


async def test_a_deleted_consumer_is_recreated_from_the_database(nats_url: str, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    for _ in range(5):
        await js.publish(sj.health("n1"), b'{"ok": true}')
    proc = start_recorder(nats_url, tmp_path, "--flush-ms", "50")
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", 5)
    await js.delete_consumer(sj.EVENTS_STREAM, "recorder-events")  # an operator's mistake
    for _ in range(5):
        await js.publish(sj.health("n1"), b'{"ok": false}')
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", 10)
    assert stop(proc) == 0
    assert [r[0] for r in rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)] == list(range(1, 11))
    assert b"recreating consumer recorder-events from seq 6" in proc.log_file.read_bytes()  # type: ignore[attr-defined]
    await nc.close()


async def publish_while_stopped(nats_url: str, proc: subprocess.Popen[bytes], count: int,
                                delete_consumer: bool = False) -> None:
    """SIGSTOP the recorder, publish ``count`` events (and one snapshot per 100) it cannot read
    yet, optionally delete its consumer meanwhile (as a leader election loses it), then SIGCONT
    and SIGTERM at once: the stop finds it ``count`` messages behind."""
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for i in range(count):
            await nc.publish(sj.req_started(f"n{i % 3}"), b'{"request_id":"r%d","proxy":"p1"}' % i)
            if i % 100 == 0:
                await nc.publish(sj.out_snapshot("default"), b'{"pool":"default","as_of_seq":%d}' % i)
        await nc.flush()
        deadline = time.monotonic() + 20
        while (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq < count:  # stored (asynchronously)
            assert time.monotonic() < deadline, "the stream did not store the events"
            await asyncio.sleep(0.02)
        if delete_consumer:
            await js.delete_consumer(sj.EVENTS_STREAM, "recorder-events")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
    await nc.close()


def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("delete_consumer", [False, True], ids=["lagging", "consumer-lost"])
async def test_a_stop_records_up_to_the_streams_end(nats_url: str, tmp_path: Path, delete_consumer: bool) -> None:
    """Stopped while 2000 events behind (20 of its batches; before the catch-up on stop it
    recorded at most the batch in flight), it records all of them before it exits."""
    nc = await connect(nats_url, "test")
    await ensure_streams(nc.jetstream())
    await nc.close()
    proc = start_recorder(nats_url, tmp_path, "--batch", "100")
    total = 2000
    await publish_while_stopped(nats_url, proc, total, delete_consumer)
    assert wait_exit(proc) == 0, proc.log_file.read_text()  # type: ignore[attr-defined]
    log_text = proc.log_file.read_text()  # type: ignore[attr-defined]
    assert [r[0] for r in rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)] == list(range(1, total + 1)), log_text
    assert [r[0] for r in rows(tmp_path / "events.duckdb", sj.OUT_STREAM)] == list(range(1, total // 100 + 1))
    assert "not recorded" not in log_text
    assert ("recreating consumer recorder-events" in log_text) == delete_consumer


async def test_a_stop_past_its_bound_logs_the_seqs_left(nats_url: str, tmp_path: Path) -> None:
    """--stop-catch-up-s 0: the stop records only what is in flight and names the rest, exactly."""
    nc = await connect(nats_url, "test")
    await ensure_streams(nc.jetstream())
    await nc.close()
    proc = start_recorder(nats_url, tmp_path, "--batch", "100", "--stop-catch-up-s", "0")
    total = 2000
    await publish_while_stopped(nats_url, proc, total)
    assert wait_exit(proc) == 0
    log_text = proc.log_file.read_text()  # type: ignore[attr-defined]
    recorded = [r[0] for r in rows(tmp_path / "events.duckdb", sj.EVENTS_STREAM)]
    assert recorded == list(range(1, len(recorded) + 1)) and len(recorded) < total
    left = total - len(recorded)
    assert (f"--stop-catch-up-s 0 with LB_EVENTS seqs {len(recorded) + 1}..{total} not recorded ({left} messages"
            in log_text), log_text


async def test_a_stop_records_no_output_beyond_its_inputs(nats_url: str, tmp_path: Path) -> None:
    """While the stopping recorder catches up, a publisher goes on storing an input and then an
    output naming it, pair after pair: every output in the file has its input there too (what
    ``laswrr replay`` needs: no output beyond the recorded inputs)."""
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    proc = start_recorder(nats_url, tmp_path, "--batch", "50", "--flush-ms", "20")
    running = True

    async def pairs() -> int:
        k = 0
        while running:
            k += 1
            await js.publish(sj.req_started("n1"), b'{"request_id":"r%d","proxy":"p1"}' % k)
            await js.publish(sj.out_snapshot("default"), b'{"pool":"default","as_of":%d}' % k)
        return k

    publisher = asyncio.create_task(pairs())
    await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", 100)  # it records while the pairs come
    os.kill(proc.pid, signal.SIGSTOP)
    await asyncio.sleep(0.5)  # stopped: the publisher gets ahead of it
    os.kill(proc.pid, signal.SIGCONT)
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(wait_exit, proc)
    running = False
    published = await publisher
    assert code == 0
    db = tmp_path / "events.duckdb"
    inputs = {json.loads(r[3])["request_id"] for r in rows(db, sj.EVENTS_STREAM)}
    outputs = [f"r{json.loads(r[3])['as_of']}" for r in rows(db, sj.OUT_STREAM)]
    assert outputs and len(outputs) < published
    assert [k for k in outputs if k not in inputs] == []
    await nc.close()


async def test_a_trickle_is_committed_less_often_a_burst_at_once_and_a_stop_cuts_the_wait(
        nats_url: str, tmp_path: Path) -> None:
    """In process: a trickle (4 messages a second) doubles each fetch's wait up to
    --idle-flush-ms, so it costs a few commits, not one a message; a burst sets the wait back to
    --flush-ms; a stop in the middle of a long wait is not held by it."""
    from laswrr.services.recorder import Recorder, RecorderOptions

    nc, pub = await connect(nats_url, "recorder"), await connect(nats_url, "test")
    js = pub.jetstream()
    await ensure_streams(js)
    recorder = Recorder(nc, RecorderOptions(data_dir=tmp_path, flush_ms=100, idle_flush_ms=1600))
    stopping = asyncio.Event()
    task = asyncio.create_task(recorder.run(stopping))
    await asyncio.wait_for(recorder.ready.wait(), 20)
    stats = recorder.stats[sj.EVENTS_STREAM]
    for n in range(24):  # 6 s at 4 a second: 24 commits at a fixed 100 ms wait
        await js.publish(sj.CLOCK_TICK, b'{"tick":%d}' % n)
        await asyncio.sleep(0.25)  # the trickle's pace: the behaviour under test is timed
    trickle_commits = stats.batches
    await asyncio.gather(*(js.publish(sj.CLOCK_TICK, b'{"tick":%d}' % n) for n in range(100, 400)))
    deadline = time.monotonic() + 20
    while stats.recorded < 324:
        assert time.monotonic() < deadline, stats.recorded
        await asyncio.sleep(0.02)
    before, started = stats.batches, time.monotonic()
    for n in range(10):  # 10 every 0.1 s for 1 s: the wait stays at 100 ms
        await asyncio.gather(*(js.publish(sj.CLOCK_TICK, b'{"tick":%d}' % (1000 + 10 * n + k)) for k in range(10)))
        await asyncio.sleep(0.1)  # the steady load's pace
    while stats.recorded < 424:
        assert time.monotonic() < deadline, stats.recorded
        await asyncio.sleep(0.02)
    steady_commits, steady_s = stats.batches - before, time.monotonic() - started
    recorder.options.idle_flush_ms = 30_000
    await asyncio.sleep(7.0)  # silence: waits of 0.1, 0.2 ... 3.2 s, then one of 6.4 s from ~6.3 s
    stopped_at = time.monotonic()
    stopping.set()
    await asyncio.wait_for(task, 20)
    stop_s = time.monotonic() - stopped_at
    await nc.close()
    await pub.close()
    assert trickle_commits <= 12, trickle_commits
    assert steady_commits >= steady_s / 0.1 / 2, (steady_commits, steady_s)
    assert stop_s < 3.0, stop_s
