"""Replay throughput: recorded events/s from DuckDB through the core with the byte diff
(goal >= 200,000/s).

Builds a realistic recorded log with ``replay.synthetic.workload`` (request start/finish pairs,
100 ms ticks, engine samples, a capacity drop and a drain; outputs recorded as the scheduler
service publishes them), writes it to a DuckDB file with the recorder's insert path, then times
``replay_db`` (the code behind ``laswrr replay --db``) end to end: queries, fetch, core, diff.
Prints the best of ``--runs``. Run: ``.venv/bin/python -m laswrr.bench.replay_bench``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import duckdb

from laswrr.replay import store
from laswrr.replay.replay import INPUTS_SQL, replay_db
from laswrr.scheduler.core import Scheduler
from laswrr.schemas.codec import Envelope
from laswrr.replay.synthetic import workload

GOAL = 200_000


def core_rate(con: duckdb.DuckDBPyConnection) -> float:
    """Scheduler.apply alone, inputs already in memory: the ceiling for any replay."""
    envelopes = [Envelope(*row) for row in con.execute(INPUTS_SQL).fetchall()]
    scheduler = Scheduler()
    started = time.perf_counter()
    for envelope in envelopes:
        scheduler.apply(envelope)
    return len(envelopes) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000, help="request start/finish pairs (default 100000)")
    parser.add_argument("--nodes", type=int, default=4, help="nodes in the pool (default 4, as in laswrr up)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laswrr-replaybench-") as tmp:
        path = Path(tmp) / "events.duckdb"
        log = workload(requests=args.requests, nodes=args.nodes)
        log.write_db(path)
        rates = []
        for _ in range(args.runs):
            with store.open_read(path) as con:
                started = time.perf_counter()
                result = replay_db(con)
                rates.append(result.events / (time.perf_counter() - started))
        with store.open_read(path) as con:
            core = core_rate(con)
        if not result.identical:
            print(result.summary())
            return 1
    best = max(rates)
    verdict = "ok" if best >= GOAL else "BELOW GOAL"
    print(f"replay: {result.events} events, {result.outputs_compared} outputs compared, identical; "
          f"best {best:,.0f} events/s (runs: {', '.join(f'{r:,.0f}' for r in rates)}; goal >= {GOAL:,}): {verdict}")
    print(f"  for comparison, the core alone on the same inputs (pre-built envelopes): {core:,.0f} events/s")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
