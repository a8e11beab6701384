"""A month of log: write a recorded log of a busy pool with the recorder's own writer.

``python -m laswrr.bench.month_log --out FILE.duckdb [--days 30 | --hours H] [--rate 50]
[--nodes 16] [--min-free-gb 20]`` writes what the recorder would have recorded from a pool of
``--nodes`` nodes serving ``--rate`` requests a second for that long, in event time (it runs as
fast as the machine allows). Every input goes through the real core (``scheduler.fold.Fold``, as the
scheduler service applies it) and every output is recorded as the service publishes it, so
``laswrr replay --db FILE`` must find the log identical. Per second of event time:

* 10 ticks (100 ms) and the pool's snapshot each tick (a busy pool always eases);
* ``--rate`` requests, each a ``lb.req.started`` and a ``lb.req.finished`` event (streamed: TTFT, tokens,
  status) published by one of two proxies as a one-event ``lb.req.batch.<proxy>`` message (a
  proxy flushes every 5 ms: at 50 requests/s its batches hold one event), a heartbeat per proxy
  every 2 s (keyed by nothing, as a proxy keys it, with the proxy's in-flight count at that
  moment, so the core applies it); 0.5 % of requests end ``upstream_error``;
* each node's engine sample every 0.5 s (the running count changes under load, so each is
  published), an NPU sample every 2 s, a health probe keep-alive every 10 s.

Rows go to DuckDB through ``replay.store.insert_rows`` (the recorder's insert, one transaction
per flush). It stops early when the file system would keep less than ``--min-free-gb`` free,
and prints one JSON line: event time covered, rows per stream, request events, bytes, and the
figures extrapolated to 30 days (rows and bytes scale linearly with event time at a fixed rate).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import msgspec

from laswrr.replay import store
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope
from laswrr.schemas.words import NpuHealth, RequestOutcome

MS = 1_000_000
S = 1_000 * MS
T0_NS = 1_780_000_000_000_000_000
FLUSH_ROWS = 200_000
DAY_S = 86_400
PROXIES = ("proxy-0", "proxy-1")


class Writer:
    """The stream and the scheduler service: seqs, the core, outputs, flushes to DuckDB."""

    def __init__(self, path: Path) -> None:
        self.con = store.open_writer(path)
        self.fold = Fold()  # the service's fold; no de-duplication set: every input's seq is new
        self.inputs = store.Columns(sj.EVENTS_STREAM)
        self.outputs = store.Columns(sj.OUT_STREAM)
        self.in_seq = self.out_seq = 0
        self.rows = {sj.EVENTS_STREAM: 0, sj.OUT_STREAM: 0}

    def add(self, ts_ns: int, subject: str, payload: object) -> None:
        data = msgspec.json.encode(payload)
        self.in_seq += 1
        self.inputs.append(self.in_seq, ts_ns, subject, data)
        for output in self.fold.apply(Envelope(self.in_seq, ts_ns, subject, data)):
            self.out_seq += 1
            self.outputs.append(self.out_seq, ts_ns + 200_000, output.subject, output.data)
        if len(self.inputs) + len(self.outputs) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        store.insert_rows(self.con, [self.inputs, self.outputs])
        self.rows[sj.EVENTS_STREAM] += len(self.inputs)
        self.rows[sj.OUT_STREAM] += len(self.outputs)
        self.inputs, self.outputs = store.Columns(sj.EVENTS_STREAM), store.Columns(sj.OUT_STREAM)

    def close(self) -> None:
        self.flush()
        self.con.execute("CHECKPOINT")
        self.con.close()


def generate(path: Path, seconds: int, rate: int, nodes: int, min_free_bytes: int, seed: int = 42) -> dict[str, object]:
    rng = random.Random(seed)
    out = Writer(path)
    names = [f"npu-{i:02d}" for i in range(nodes)]
    chips = [("910C", 16), ("910B", 8), ("910B", 8), ("910", 4)]
    for i, name in enumerate(names):
        chip, capacity = chips[i % len(chips)]
        out.add(T0_NS + i * MS, sj.admin_node(name), {"url": f"http://10.0.{i // 250}.{i % 250}:8000", "pool": "default",
                                                      "chip": chip, "capacity": capacity})
    boots = {proxy: f"{proxy}-{rng.getrandbits(32):08x}" for proxy in PROXIES}
    running = {name: 0 for name in names}
    inflight = {proxy: 0 for proxy in PROXIES}  # each proxy's own count, as its heartbeat says it
    finishing: list[tuple[int, str, str, str]] = []  # (ts_ns, node, request id, proxy), by time
    request_no = request_events = 0
    started = time.perf_counter()
    covered = 0
    for second in range(seconds):
        base = T0_NS + S + second * S
        slot_events: list[tuple[int, str, object]] = []
        for slot in range(10):
            slot_events.append((base + slot * 100 * MS, sj.CLOCK_TICK, {"tick": second * 10 + slot + 1}))
        for k in range(rate):
            at = base + int((k + rng.random()) * S / rate)
            request_no += 1
            node = names[request_no % nodes]
            proxy = PROXIES[request_no % 2]
            rid = f"{rng.getrandbits(64):016x}"
            slot_events.append((at, "start", (node, rid, proxy)))
            finishing.append((at + int(rng.uniform(0.5, 6.0) * S), node, rid, proxy))
        for half in range(2):
            for i, name in enumerate(names):
                slot_events.append((base + half * 500 * MS + i * MS + 7 * MS, "engine", name))
        for i, name in enumerate(names):
            if second % 2 == i % 2:
                slot_events.append((base + 300 * MS + i * MS, "npu", name))
            if second % 10 == i % 10:
                slot_events.append((base + 400 * MS + i * MS, "health", name))
        for j, proxy in enumerate(PROXIES):
            if second % 2 == j:
                slot_events.append((base + 900 * MS + j * MS, "heartbeat", proxy))
        finishing.sort()
        while finishing and finishing[0][0] < base + S:
            slot_events.append((finishing[0][0], "finish", finishing.pop(0)[1:]))
        slot_events.sort(key=lambda e: e[0])
        for ts_ns, kind, what in slot_events:
            if kind == sj.CLOCK_TICK:
                out.add(ts_ns, kind, what)
            elif kind == "start":
                node, rid, proxy = what  # type: ignore[misc]
                running[node] += 1
                inflight[proxy] += 1
                prompt = rng.randint(50, 4000)
                out.add(ts_ns, sj.req_batch(proxy), {"events": [["req.started", node, {
                    "request_id": rid, "proxy": proxy, "pool": "default", "snapshot_seq": out.in_seq,
                    "ts_ns": ts_ns, "boot_id": boots[proxy], "prompt_tokens": prompt, "max_tokens": 512}]]})
                request_events += 1
            elif kind == "finish":
                node, rid, proxy = what  # type: ignore[misc]
                running[node] -= 1
                inflight[proxy] -= 1
                failed = rng.random() < 0.005
                out.add(ts_ns, sj.req_batch(proxy), {"events": [["req.finished", node, {
                    "request_id": rid, "proxy": proxy, "outcome": RequestOutcome.UPSTREAM_ERROR if failed else RequestOutcome.COMPLETED,
                    "pool": "default", "ttft_ms": round(rng.uniform(30, 400), 1),
                    "duration_ms": round(rng.uniform(500, 6000), 1), "prompt_tokens": rng.randint(50, 4000),
                    "completion_tokens": rng.randint(10, 512), "status": 502 if failed else 200,
                    "ts_ns": ts_ns, "boot_id": boots[proxy], "stream": True}]]})
                request_events += 1
            elif kind == "engine":
                n = running[what]  # type: ignore[index]
                out.add(ts_ns, sj.metrics_engine(what), {  # type: ignore[arg-type]
                    "running": n, "waiting": max(0, n - 16), "kv_cache_usage": round(min(1.0, n / 40), 3),
                    "ttft_ms": round(rng.uniform(30, 400), 1), "engine": "vllm", "ts_ns": ts_ns,
                    "max_age_ms": 11_000})
            elif kind == "npu":
                out.add(ts_ns, sj.metrics_npu(what), {"chips": [  # type: ignore[arg-type]
                    {"npu_id": c, "chip_id": 0, "aicore_util": round(rng.uniform(0.2, 0.9), 2), "hbm_used_mb": 40000,
                     "hbm_total_mb": 65536, "health": NpuHealth.OK, "power_w": round(rng.uniform(150, 300), 1)}
                    for c in range(2)], "ts_ns": ts_ns, "max_age_ms": 14_000})
            elif kind == "health":
                out.add(ts_ns, sj.health(what), {"ok": True, "latency_ms": round(rng.uniform(1, 5), 2),  # type: ignore[arg-type]
                                                 "ts_ns": ts_ns})
            elif kind == "heartbeat":
                # keyed by nothing, as a proxy keys it (its proxy is the batch's: schemas.events.BatchedEvent)
                out.add(ts_ns, sj.req_batch(what), {"events": [["proxy.heartbeat", None, {  # type: ignore[arg-type]
                    "inflight": inflight[what], "ts_ns": ts_ns, "boot_id": boots[what],  # type: ignore[index]
                    "snapshot_seq": out.in_seq}]]})
        covered = second + 1
        if second % 600 == 599:
            out.flush()
            if shutil.disk_usage(path.parent).free < min_free_bytes:
                print(f"month_log: stopping at {covered} s of event time: less than "
                      f"{min_free_bytes / 1e9:.0f} GB would stay free", file=sys.stderr)
                break
            print(f"month_log: {covered} s of event time, {out.in_seq + out.out_seq:,} rows, "
                  f"{(out.in_seq + out.out_seq) / (time.perf_counter() - started):,.0f} rows/s", file=sys.stderr)
    out.close()
    size = path.stat().st_size
    rows = out.rows[sj.EVENTS_STREAM] + out.rows[sj.OUT_STREAM]
    month = 30 * DAY_S / covered
    return {"file": str(path), "event_time_s": covered, "rate": rate, "nodes": nodes, "rows": out.rows,
            "request_events": request_events, "bytes": size, "bytes_per_row": round(size / rows, 1),
            "generate_s": round(time.perf_counter() - started, 1),
            "month_extrapolated": {"rows": round(rows * month), "request_events": round(request_events * month),
                                   "gb": round(size * month / 1e9, 1)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.month_log", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the DuckDB file to write (must not exist)")
    span = parser.add_mutually_exclusive_group()
    span.add_argument("--days", type=float, default=None, help="event time to cover (default 30)")
    span.add_argument("--hours", type=float, default=None)
    parser.add_argument("--rate", type=int, default=50, help="requests per second (default 50)")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--min-free-gb", type=float, default=20.0, help="stop before the disk keeps less (default 20)")
    args = parser.parse_args(argv)
    path = Path(args.out)
    if path.exists():
        parser.error(f"{path} exists")
    if args.rate < 1 or args.nodes < 1:
        parser.error("--rate and --nodes must be >= 1")
    seconds = round(3600 * args.hours) if args.hours is not None else round(DAY_S * (args.days or 30))
    result = generate(path, seconds, args.rate, args.nodes, round(args.min_free_gb * 1e9))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
