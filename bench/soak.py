"""Soak: the whole stack under steady load for a long time, sampled for leaks and lag.

``python -m laswrr.bench.soak [--duration-min 60] [--warmup-min 10] [--load 0.6] [--sample-s 10]
[--trace mooncake_conversation_first300s.jsonl] [--out DIR]`` (``make soak``) starts ``laswrr
up``'s stack (``services.up.Stack``: embedded NATS, scheduler, recorder, collector, one proxy,
the five simulated engines) and keeps ``--load`` x the pool's slots (the engines' capacities
summed) requests in flight, closed loop: each client sends the real trace's requests (prompt
and output lengths, prefix blocks) one after the other, cycling through it. Every ``--sample-s``
it records each process's RSS (``/proc/<pid>/status`` VmRSS) and open file descriptors
(``/proc/<pid>/fd``), the recorder's lag on LB_EVENTS (the stream's last seq minus the seq the
recorder's consumer has acknowledged, which it does only after committing, and the age of the
oldest message not yet acknowledged) and the DuckDB file's size (with its write-ahead log). It writes ``DIR/soak.jsonl``
(one line per sample) and ``DIR/soak.json``, and prints the verdict on the soak's goals:

* each process's RSS at the end is at most 10 % above its RSS at the end of the warm-up, each
  read as the median of a window of samples (``--window-min``, 5 minutes; the first window after
  the warm-up, the last window of the run), not one sample each: a garbage-collected heap's
  sawtooth (nats-server's Go heap swings 15-17 MB) or one busy moment must not decide it; the
  last window's slope is printed too (``trend_pct_per_h``: still growing, or flat);
* each process's open fds at the end are at most its count at the end of the warm-up + 8;
* the recorder's lag at the end is at most 1 s (and its largest lag over the run is printed);
* bytes of DuckDB file per request served.

Exit status 0 when every goal holds, 1 otherwise. Load is closed loop, so "60 % of capacity" is
60 % of the pool's slots busy from the clients' side (the engines' own queueing aside).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from laswrr.bench.load import make_session, send_one
from laswrr.bench.metrics import ClientOutcome
from laswrr.bench.trace import TraceWindow, load_workload
from laswrr.replay.store import DB_FILE
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect
from laswrr.services.up import DEFAULT_SIMS, Stack

RSS_GROWTH = 0.10
FD_SLACK = 8
LAG_GOAL_S = 1.0
WINDOW_S = 300.0  # the RSS windows compared: the first after the warm-up, the last of the run


def rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


async def recorder_lag(js: Any) -> tuple[int | None, float | None]:
    """(messages, seconds) LB_EVENTS is ahead of what the recorder acknowledged (= committed);
    (None, None) when NATS did not answer in time (a busy machine)."""
    try:
        last = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        info = await js.consumer_info(sj.EVENTS_STREAM, "recorder-events", timeout=10)
        acked = info.ack_floor.stream_seq or 0
        if acked >= last:
            return 0, 0.0
        msg = await js.get_msg(sj.EVENTS_STREAM, acked + 1)
    except Exception:  # noqa: BLE001 - a missed sample, not a failed soak
        return None, None
    stamp = msg.time
    if isinstance(stamp, str):  # RFC 3339 with ns: 2026-12-06T21:10:00.123456789Z
        whole, _, frac = stamp.rstrip("Z").partition(".")
        stamp = datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}+00:00")
    age = max(0.0, time.time() - stamp.timestamp()) if isinstance(stamp, datetime) else None
    return last - acked, None if age is None else round(age, 3)


def _median(values: list[int]) -> int | None:
    return round(statistics.median(values)) if values else None


def _slope_pct_per_h(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, kB), as % of the mean per hour; None under two points."""
    if len(points) < 2 or len({t for t, _ in points}) < 2:
        return None
    slope = statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope
    return round(100 * slope * 3600 / statistics.fmean(v for _, v in points), 1)


def rss_windows(samples: list[dict[str, Any]], warmup_s: float, window_s: float) -> dict[str, dict[str, Any]]:
    """Per process: the median RSS of the first ``window_s`` after the warm-up (``warm_kb``) and of
    the last ``window_s`` (``end_kb``), the samples each holds, and the last window's trend. The
    two windows never overlap: on a short run each is at most half of what follows the warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    span = after[-1]["t_s"] - after[0]["t_s"]
    width = min(window_s, span / 2)
    first = [s for s in after if s["t_s"] <= after[0]["t_s"] + width] or after[:1]
    last = [s for s in after if s["t_s"] >= after[-1]["t_s"] - width and s not in first] or after[-1:]
    out = {}
    for name in samples[-1]["rss_kb"]:
        warm = [s["rss_kb"][name] for s in first if s["rss_kb"].get(name)]
        end = [s["rss_kb"][name] for s in last if s["rss_kb"].get(name)]
        out[name] = {"warm_kb": _median(warm), "end_kb": _median(end), "samples": [len(warm), len(end)],
                     "end_range_kb": [min(end), max(end)] if end else None,
                     "trend_pct_per_h": _slope_pct_per_h([(s["t_s"], s["rss_kb"][name]) for s in last
                                                          if s["rss_kb"].get(name)])}
    return out


def verdict(samples: list[dict[str, Any]], warmup_s: float, requests: int, db_bytes: int,
            window_s: float = WINDOW_S) -> dict[str, Any]:
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    first, last = after[0], samples[-1]
    rss = rss_windows(samples, warmup_s, window_s)
    rss_ok = all(v["warm_kb"] and v["end_kb"] and v["end_kb"] <= v["warm_kb"] * (1 + RSS_GROWTH) for v in rss.values())
    fds = {name: {"warm": first["fds"].get(name), "end": last["fds"].get(name),
                  "max": max(s["fds"].get(name) or 0 for s in after)} for name in last["fds"]}
    fds_ok = all(v["warm"] is not None and v["end"] is not None and v["end"] <= v["warm"] + FD_SLACK
                 for v in fds.values())
    lags = [s["lag_s"] for s in samples if s["lag_s"] is not None]
    measured = [s for s in samples if s["lag_s"] is not None] or [last]  # a sample NATS did not answer: skipped
    lag_ok = measured[-1]["lag_s"] is not None and measured[-1]["lag_s"] <= LAG_GOAL_S
    return {"rss": rss, "rss_ok": rss_ok, "fds": fds, "fds_ok": fds_ok, "lag_end_s": measured[-1]["lag_s"],
            "lag_end_msgs": measured[-1]["lag_msgs"], "lag_max_s": max(lags, default=None), "lag_ok": lag_ok,
            "requests": requests, "db_bytes": db_bytes,
            "bytes_per_request": round(db_bytes / requests) if requests else None,
            "ok": rss_ok and fds_ok and lag_ok}


async def soak(out: Path, duration_s: float, warmup_s: float, load: float, sample_s: float, trace: str,
               window_s: float = WINDOW_S) -> dict[str, Any]:
    workload = load_workload(TraceWindow(trace))
    slots = sum(spec[2] for spec in DEFAULT_SIMS)
    clients = max(1, round(load * slots))
    stack = Stack(out / "stack", proxy_port=0)
    await stack.start()
    assert stack.proxy_url is not None
    counts = {"served": 0, "not_served": 0}
    stop = asyncio.Event()
    specs = itertools.cycle(workload)

    async def client() -> None:
        session = make_session(timeout_s=300)
        try:
            while not stop.is_set():
                result = await send_one(session, stack.proxy_url + "/v1/chat/completions", next(specs), 0.0)
                counts["served" if result.outcome == ClientOutcome.COMPLETED else "not_served"] += 1
        finally:
            await session.close()

    samples: list[dict[str, Any]] = []
    nc = await connect(stack.role_url("recorder"), "laswrr-soak", stack.nats_auth)  # it may read single messages
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    started = time.monotonic()
    try:
        with (out / "soak.jsonl").open("w") as lines:
            while (elapsed := time.monotonic() - started) < duration_s:
                pids = {c.name: c.pid for c in stack.children if c.role != "sim-engine"}
                if stack.embedded is not None and stack.embedded.process is not None:
                    pids["nats"] = stack.embedded.process.pid
                msgs, age = await recorder_lag(nc.jetstream())
                db = stack.data_dir / DB_FILE
                wal = db.with_name(db.name + ".wal")  # DuckDB keeps new rows there until a checkpoint
                sample = {"t_s": round(elapsed, 1), "rss_kb": {n: rss_kb(p) for n, p in pids.items()},
                          "fds": {n: open_fds(p) for n, p in pids.items()}, "lag_msgs": msgs, "lag_s": age,
                          "db_bytes": sum(f.stat().st_size for f in (db, wal) if f.exists()), **counts, "loadavg": os.getloadavg()}
                samples.append(sample)
                lines.write(json.dumps(sample) + "\n")
                lines.flush()
                print(f"soak: {elapsed / 60:.1f} min, {counts['served']} served, recorder lag {msgs} msgs "
                      f"{age} s, db {sample['db_bytes'] / 1e6:.1f} MB", file=sys.stderr)
                await asyncio.sleep(min(sample_s, max(0.1, duration_s - elapsed)))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()
        await stack.stop()
    db_bytes = (stack.data_dir / DB_FILE).stat().st_size
    result = {"duration_s": duration_s, "warmup_s": warmup_s, "clients": clients, "slots": slots, **counts,
              **verdict(samples, warmup_s, counts["served"], db_bytes, window_s)}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-min", type=float, default=60.0)
    parser.add_argument("--warmup-min", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.6, help="share of the pool's slots kept busy (default 0.6)")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--window-min", type=float, default=WINDOW_S / 60,
                        help="RSS is compared as the median of this long a window, after the warm-up and at the end")
    parser.add_argument("--trace", default="mooncake_conversation_first300s.jsonl")
    parser.add_argument("--out", default=None, help="default: a new temporary directory")
    args = parser.parse_args(argv)
    if args.duration_min <= 0 or not 0 <= args.warmup_min < args.duration_min or not 0 < args.load <= 2 \
            or args.window_min <= 0 or args.sample_s <= 0:
        parser.error("need --duration-min > --warmup-min >= 0, 0 < --load <= 2, --window-min > 0 and --sample-s > 0")
    out = Path(args.out or tempfile.mkdtemp(prefix="laswrr-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(soak(out, args.duration_min * 60, args.warmup_min * 60, args.load, args.sample_s, args.trace,
                              args.window_min * 60))
    print(json.dumps(result, indent=1))
    print(f"soak: {'all goals met' if result['ok'] else 'GOAL MISSED'} ({out / 'soak.json'})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
