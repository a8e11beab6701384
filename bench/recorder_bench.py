"""Recorder throughput: events/s from a JetStream backlog into DuckDB (goal >= 20,000/s).

Starts an embedded nats-server, fills LB_EVENTS with ``--events`` request events and LB_OUT with
one snapshot per ``--out-every`` events (core publishes, so filling is not what is measured),
then runs the real ``Recorder`` (same code as ``laswrr recorder``) until every message is
committed and acked, and prints rows/s. Run: ``.venv/bin/python -m laswrr.bench.recorder_bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import duckdb

from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.recorder import Recorder, RecorderOptions

GOAL = 20_000


async def fill(url: str, events: int, out_every: int) -> int:
    nc = await connect(url, "bench-fill")
    js = nc.jetstream()
    await ensure_streams(js)
    snapshot = (b'{"pool":"default","as_of_seq":%d,"tick":1,"ts_ns":1,"panic":false,"nodes":[{"node":"n0",'
                b'"url":"http://n0:8000","phase":"active","routable":true,"capacity":8,"target_weight":8.0,'
                b'"effective_weight":8.0,"inflight":3}]}')
    outputs = 0
    for i in range(events):
        node = i % 4
        await nc.publish(sj.req_started(f"n{node}"),
                         b'{"request_id":"r-%08d","proxy":"p1","pool":"default","snapshot_seq":%d}' % (i, i))
        if out_every and i % out_every == 0:
            await nc.publish(sj.out_snapshot("default"), snapshot % i)
            outputs += 1
        if i % 5000 == 0:
            await nc.flush()
    await nc.flush()
    for stream, want in ((sj.EVENTS_STREAM, events), (sj.OUT_STREAM, outputs)):
        while (await js.stream_info(stream)).state.messages < want:
            await asyncio.sleep(0.05)
    await nc.close()
    return events + outputs


async def measure(url: str, data_dir: Path, total: int, batch: int, flush_ms: int) -> float:
    nc = await connect(url, "bench-recorder")
    recorder = Recorder(nc, RecorderOptions(data_dir=data_dir, batch=batch, flush_ms=flush_ms))
    stop = asyncio.Event()
    task = asyncio.create_task(recorder.run(stop))
    await recorder.ready.wait()
    started = time.perf_counter()
    while sum(s.recorded for s in recorder.stats.values()) < total:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    await nc.drain()
    return total / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--out-every", type=int, default=100, help="one LB_OUT snapshot per N events")
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--flush-ms", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laswrr-recbench-") as tmp, EmbeddedNats(Path(tmp) / "nats") as server:
        total = asyncio.run(fill(server.url, args.events, args.out_every))
        rate = asyncio.run(measure(server.url, Path(tmp), total, args.batch, args.flush_ms))
        con = duckdb.connect(str(Path(tmp) / "events.duckdb"), read_only=True)
        rows = con.execute("SELECT count(*), count(DISTINCT (stream, seq)) FROM events").fetchone()
        con.close()
    assert rows is not None
    verdict = "ok" if rate >= GOAL and rows[0] == total == rows[1] else "BELOW GOAL" if rate < GOAL else "ROWS MISMATCH"
    print(f"recorder: {total} messages recorded ({rows[0]} rows, {rows[1]} distinct) at {rate:,.0f} events/s "
          f"(goal >= {GOAL:,}): {verdict}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
