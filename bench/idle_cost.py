"""What an idle stack costs: log rows per second by subject, bytes, CPU seconds per process.

``python -m laswrr.bench.idle_cost [--nodes 16] [--warmup-s 20] [--duration-s 60] [--data-dir DIR]``
starts the whole stack (``services.up.Stack``: embedded NATS, scheduler, recorder, collector, one
proxy) on ``--nodes`` simulated engines in one pool, sends no traffic, waits ``--warmup-s``, then
measures for ``--duration-s``:

* each process's CPU seconds (utime + stime from ``/proc/<pid>/stat``) over the window, so the
  figure does not depend on how busy a shared machine is (wall-clock speed would);
* after an ordered stop, the rows the recorder wrote with ``ts_ns`` in the window, by stream and
  subject (the node id cut off), and the DuckDB file's size per recorded row.

It prints one JSON object: ``rows_per_s``, ``by_subject``, ``cpu_core_share`` per process (CPU
seconds / window), ``services_core_share`` (NATS, scheduler, recorder, collector, proxy: the
engines are the workload, not the service), ``bytes_per_row`` and ``mb_per_day`` (rows/s x the
file's bytes/row x 86400: a small file's fixed blocks inflate it) and ``mb_per_day_uncompressed``
(the window's rows' own bytes, payload and keys, before DuckDB compresses them: an upper bound). The goals for an idle 16-node pool: <= 200 MB of log a day, <= 5 % of a core for the services.

After the window it sends one streamed request through the proxy, the first after the idle time,
and reports under ``first_request`` how long after its ``lb.req.started`` (JetStream time) the
log has the first engine sample of its node that counts it running (``engine_sample_ms``) and
the first snapshot whose target weight for that node is below its idle one (``weight_ms``: the
weights reacting to the node's load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import duckdb
import msgspec

from laswrr.replay.store import DB_FILE
from laswrr.services.up import SimSpec, Stack

SERVICES = ("nats", "scheduler", "recorder", "collector", "proxy")
CHIPS = (("910C", 16), ("910B", 8), ("910B", 8), ("910", 4))


def sims(count: int) -> list[SimSpec]:
    """``count`` simulated engines of the default stack's chips, in turn."""
    return [(f"sim-{i + 1:02d}", *CHIPS[i % len(CHIPS)]) for i in range(count)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (its own threads; children are separate processes here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def subject_kind(subject: str) -> str:
    """The subject without its node or proxy id: ``lb.metrics.engine.<node>`` -> ``lb.metrics.engine``."""
    parts = subject.split(".")
    return ".".join(parts[:3] if len(parts) > 3 else parts[:2] if parts[1] == "health" else parts)


async def measure(data_dir: Path, nodes: int, warmup_s: float, duration_s: float) -> dict[str, object]:
    stack = Stack(data_dir, proxy_port=0)
    specs = sims(nodes)
    stack.allow_hosts([], sims=True)
    await stack.start_nats()
    try:
        await stack.start_core()
        started = await stack.start_sim_engines(specs)
        await stack.register(started)
        stack.write_nodes_file(started)
        await stack.start_collector()
        await stack.start_proxy()
        await asyncio.sleep(warmup_s)
        pids = {child.name: child.pid for child in stack.children if child.role != "sim-engine"}
        if stack.embedded is not None and stack.embedded.process is not None:
            pids["nats"] = stack.embedded.process.pid
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.time_ns()
        await asyncio.sleep(duration_s)
        t1 = time.time_ns()
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await one_request(stack.proxy_url)
    finally:
        await stack.stop()
    window_s = (t1 - t0) / 1e9
    db = data_dir / DB_FILE
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT stream, subject FROM events WHERE ts_ns BETWEEN ? AND ?", [t0, t1]).fetchall()
        payload = con.execute("SELECT coalesce(sum(octet_length(encode(data)) + length(subject) + 24), 0) FROM events "
                              "WHERE ts_ns BETWEEN ? AND ?", [t0, t1]).fetchone()[0]  # type: ignore[index]
        total_rows = con.execute("SELECT count(*) FROM events").fetchone()[0]  # type: ignore[index]
        first = first_reaction(con, t1)
    counts: dict[str, int] = {}
    for stream, subject in rows:
        key = f"{stream} {subject_kind(subject)}"
        counts[key] = counts.get(key, 0) + 1
    share = {name: round((after[name] - before[name]) / window_s, 4) for name in sorted(pids)}
    bytes_per_row = db.stat().st_size / max(1, total_rows)
    rows_per_s = len(rows) / window_s
    return {
        "nodes": nodes, "window_s": round(window_s, 1), "rows_per_s": round(rows_per_s, 2),
        "by_subject": {key: round(n / window_s, 2) for key, n in sorted(counts.items(), key=lambda kv: -kv[1])},
        "cpu_core_share": share,
        "services_core_share": round(sum(v for k, v in share.items() if k.split("-")[0] in SERVICES), 4),
        "db_bytes": db.stat().st_size, "db_rows": total_rows, "bytes_per_row": round(bytes_per_row),
        "mb_per_day": round(rows_per_s * bytes_per_row * 86400 / 1e6, 1),
        # the rows' bytes before DuckDB's compression (payload, subject, 24 for stream, seq, ts): an upper bound
        "mb_per_day_uncompressed": round(payload / window_s * 86400 / 1e6, 1),
        "first_request": first,
        "loadavg": os.getloadavg(),
    }


async def one_request(proxy_url: str | None) -> None:
    """One streamed completion through the proxy, read to its end (a few seconds on a sim engine)."""
    assert proxy_url is not None
    body = {"model": "sim-llm", "prompt": "hello " * 50, "max_tokens": 300, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{proxy_url}/v1/completions", json=body) as resp:
        async for _ in resp.content:
            pass
    await asyncio.sleep(3.0)  # the samples and snapshots after it reach the log


def first_reaction(con: duckdb.DuckDBPyConnection, after_ns: int) -> dict[str, object]:
    """How long after the first request started past ``after_ns`` its node's engine sample and the
    weights showed it (``first_request`` of the module doc); None where the log has no such row."""
    row = con.execute("SELECT ts_ns, key FROM input_events WHERE family = 'lb.req.started' AND ts_ns > ? "
                      "ORDER BY seq LIMIT 1", [after_ns]).fetchone()
    if row is None:
        return {"node": None}
    started, node = row
    sampled = con.execute("SELECT min(ts_ns) FROM input_events WHERE family = 'lb.metrics.engine' AND key = ? "
                          "AND ts_ns >= ? AND CAST(j->>'$.running' AS INTEGER) > 0", [node, started]).fetchone()[0]
    idle_weight, weighed = None, None
    for ts_ns, data in con.execute("SELECT ts_ns, data FROM events WHERE stream = 'LB_OUT' AND subject LIKE "
                                   "'lb.out.snapshot.%' AND ts_ns <= ? + 10e9 ORDER BY seq", [started]).fetchall():
        weight = next((v["target_weight"] for v in msgspec.json.decode(data)["nodes"] if v["node"] == node), None)
        if weight is None:
            continue  # a snapshot from before the node was registered
        if ts_ns < started:
            idle_weight = weight
        elif idle_weight is not None and weight < idle_weight:
            weighed = ts_ns
            break
    return {"node": node, "engine_sample_ms": None if sampled is None else round((sampled - started) / 1e6),
            "weight_ms": None if weighed is None else round((weighed - started) / 1e6)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.idle_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--data-dir", default=None, help="default: a new temporary directory")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="laswrr-idle-"))
    result = asyncio.run(measure(data_dir, args.nodes, args.warmup_s, args.duration_s))
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
