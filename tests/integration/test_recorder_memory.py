"""The recorder's DuckDB under its memory limit (``--memory-limit-mb``, 16 MB by default): large
payloads in a backlog need more than a small pool's limit (one commit of them fails for want of
memory; DuckDB fails its checkpoint after a durable commit, which invalidates the connection).
The recorder raises the limit, opens the file again where it must, and records every message
once: none lost, none written twice.

Real parts: a real nats-server, ``laswrr recorder`` as a child process, its DuckDB file.
"""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from tests.faults.test_full_disk import free_port, start_recorder
from tests.integration.test_recorder import stop, wait_acked

pytestmark = pytest.mark.timeout(180)


def payload(rnd: random.Random, n: int) -> bytes:
    """A request event with ~10 kB of incompressible text (a 30-node pool's snapshot is as large)."""
    return b'{"request_id":"r%d","proxy":"p1","pad":"%s"}' % (n, rnd.randbytes(5000).hex().encode())


@pytest.mark.parametrize("backlog", [6000, 0])
async def test_large_payloads_raise_the_memory_limit_and_are_recorded_once(nats_url: str, tmp_path: Path,
                                                                           backlog: int) -> None:
    """``backlog``: messages in the stream before the recorder starts (its first commits hold
    thousands); 0: all published while it records. Either way a commit fails for want of memory
    and the limit is raised (the fatal checkpoint path: the next test)."""
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    rnd, published = random.Random(7), 0

    async def publish(n: int) -> None:
        nonlocal published
        for _ in range(n):
            published += 1
            await js.publish(sj.req_started("n1"), payload(rnd, published))

    await publish(backlog)  # the recorder's first commits hold up to --batch of them
    port = free_port()
    proc = start_recorder(nats_url, tmp_path / "data", tmp_path / "recorder.log", "--metrics-port", str(port))
    try:
        await publish(8000 - backlog)
        await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", published, timeout=120)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as response:
            metrics = await response.text()
    finally:
        code = stop(proc)
        await nc.close()
    log = proc.log_file.read_text()  # type: ignore[attr-defined]
    limit = next(float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("laswrr_recorder_memory_limit_bytes "))
    with store.open_read(tmp_path / "data" / store.DB_FILE) as con:
        count, distinct, top = con.execute(
            "SELECT count(*), count(DISTINCT seq), max(seq) FROM events WHERE stream = ?", [sj.EVENTS_STREAM]).fetchone()
    raised = log.count("limit raised to")
    print(f"RECORDER memory: {published} events of ~10 kB, limit 16 MB at start -> {limit / 2**20:g} MB "
          f"({raised} raise(s), {log.count('reopened')} reopen(s)); recorded {count} rows ({distinct} distinct)")
    assert code == 0, log[-3000:]
    assert raised >= 1 and limit > 16 * 2**20, log[-3000:]
    assert (count, distinct, top) == (published, published, published)  # no hole, no duplicate


async def test_a_checkpoint_that_fails_after_a_durable_commit_loses_and_repeats_nothing(
        nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The recorder's own write path (``Recorder._write``) on 10 kB rows in commits of 40, as a
    busy recorder makes them, under a 16 MB limit: DuckDB's checkpoint after one of them fails for
    want of memory (DuckDB 2.0: fatally, after the commit is durable). Every row is in the file
    once at the end, and the limit in force was raised."""
    from laswrr.services.recorder import Recorder, RecorderOptions

    nc = await connect(nats_url, "test")
    recorder = Recorder(nc, RecorderOptions(data_dir=tmp_path, memory_limit_mb=16))
    recorder.con = store.open_writer(recorder.options.db_path, recorder.memory_limit_mb)
    rnd, seq = random.Random(3), 0
    try:
        while seq < 8000:
            rows = store.Columns(sj.EVENTS_STREAM)
            for _ in range(40):
                seq += 1
                rows.append(seq, seq, sj.req_started("n1"), payload(rnd, seq))
            assert await recorder._write(sj.EVENTS_STREAM, rows)
        assert recorder.con is not None
        count, distinct, top = recorder.con.execute("SELECT count(*), count(DISTINCT seq), max(seq) FROM events").fetchone()
    finally:
        if recorder.con is not None:
            recorder.con.close()
        await nc.close()
    print(f"RECORDER checkpoint: 8000 rows of ~10 kB in commits of 40, limit 16 MB -> {recorder.memory_limit_mb} MB "
          f"({recorder.memory_raised} raise(s), {caplog.text.count('reopened')} reopen(s)); {count} rows, "
          f"{distinct} distinct")
    assert recorder.memory_raised >= 1 and recorder.stats[sj.EVENTS_STREAM].write_failures == 0
    assert "reopened" in caplog.text  # the fatal path: the durable commit found in the file, not written again
    assert (count, distinct, top) == (8000, 8000, 8000)


def test_the_analysts_copy_fits_beside_a_small_limit(tmp_path: Path) -> None:
    """``lb.recorder.snapshot``'s copy (``copy_database``) of a live log under the recorder's
    16 MB limit: DuckDB's copy needs more (on three minutes of a 16-node pool's log it failed at
    once, "failed to allocate data of size 8.0 MiB"), so it runs on one thread under
    COPY_MEMORY_MB, and the writer's limit and threads are restored after."""
    import subprocess
    import sys

    from laswrr.services.recorder_copy import copy_database

    live = tmp_path / "live.duckdb"
    subprocess.run([sys.executable, "-m", "laswrr.bench.month_log", "--out", str(live), "--hours", "0.05",
                    "--min-free-gb", "0"], check=True, capture_output=True)
    con = store.open_writer(live, 16)
    try:
        rows = con.execute("SELECT count(*) FROM events").fetchone()
        before = con.execute("SELECT current_setting('memory_limit'), current_setting('threads')").fetchone()
        copy_database(con, tmp_path / "copy.duckdb", 16)
        after = con.execute("SELECT current_setting('memory_limit'), current_setting('threads')").fetchone()
    finally:
        con.close()
    with store.open_read(tmp_path / "copy.duckdb") as copy:
        assert copy.execute("SELECT count(*) FROM events").fetchone() == rows
    assert after == before
