"""What-if replay: the recorded inputs, other scheduler parameters, and a side-by-side.

``run_whatif(con, overrides, out_dir)`` replays every recorded input through a core whose
configuration is ``SchedulerConfig()`` with ``overrides`` on top; the overrides are re-applied
after every recorded ``lb.admin.config`` event, so they stay in force for the whole run while
every other key follows the recording. It writes

* ``whatif.jsonl`` - every counterfactual output in the portable form (``{seq, ts_ns, subject,
  data}``, ``seq`` = the input it answers), like ``laswrr replay --events`` prints;
* ``weights.csv``  - per snapshot and node: tick, ts_ns, pool, node, as_of_seq,
  recorded_effective (from the recorded LB_OUT snapshots), whatif_effective, and both phases;

and returns, per capacity or drain event, how long each node took to get within ``fraction`` of
the way to the weight it settled at before its next such event, recorded vs what-if.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import msgspec

from laswrr.replay.portable import output_line
from laswrr.replay.replay import replay_db
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output
from laswrr.schemas.outputs import WeightSnapshot

_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)


@dataclass(frozen=True)
class Reach:
    """Time for one node to close ``fraction`` of the gap to its final weight after an event."""

    node: str
    event_seq: int
    kind: str
    recorded_ms: float | None
    whatif_ms: float | None
    recorded_final: float | None
    whatif_final: float | None


class _Collector:
    def __init__(self, jsonl: Any) -> None:
        self.jsonl = jsonl
        self.columns: dict[str, list[Any]] = {k: [] for k in ("as_of_seq", "tick", "ts_ns", "pool", "node",
                                                                "effective", "phase")}
        self.outputs = 0

    def __call__(self, envelope: Envelope, outputs: list[Output]) -> None:
        for output in outputs:
            self.outputs += 1
            self.jsonl.write(output_line(output, envelope.ts_ns))
            if output.subject.startswith(sj.OUT_SNAPSHOT + "."):
                snapshot = _SNAPSHOT.decode(output.data)
                for view in snapshot.nodes:
                    for key, value in (("as_of_seq", snapshot.as_of_seq), ("tick", snapshot.tick),
                                       ("ts_ns", snapshot.ts_ns), ("pool", snapshot.pool), ("node", view.node),
                                       ("effective", view.effective_weight), ("phase", view.phase)):
                        self.columns[key].append(value)


_SIDE_BY_SIDE = """
WITH w AS (
    SELECT * FROM (SELECT unnest($as_of_seq::BIGINT[]) AS as_of_seq, unnest($tick::BIGINT[]) AS tick,
                          unnest($ts_ns::BIGINT[]) AS ts_ns, unnest($pool::VARCHAR[]) AS pool,
                          unnest($node::VARCHAR[]) AS node, unnest($effective::DOUBLE[]) AS effective,
                          unnest($phase::VARCHAR[]) AS phase)
    QUALIFY row_number() OVER (PARTITION BY as_of_seq, pool, node ORDER BY as_of_seq) = 1
)
SELECT coalesce(r.tick, w.tick) AS tick, coalesce(r.ts_ns, w.ts_ns) AS ts_ns,
       coalesce(r.pool, w.pool) AS pool, coalesce(r.node, w.node) AS node,
       coalesce(r.as_of_seq, w.as_of_seq) AS as_of_seq,
       r.effective_weight AS recorded_effective, w.effective AS whatif_effective,
       r.phase AS recorded_phase, w.phase AS whatif_phase
FROM weights_over_time r
FULL OUTER JOIN w ON w.as_of_seq = r.as_of_seq AND w.pool = r.pool AND w.node = r.node
ORDER BY as_of_seq, pool, node
"""


def run_whatif(con: duckdb.DuckDBPyConnection, overrides: dict[str, Any], out_dir: Path,
               fraction: float = 0.9) -> tuple[int, int, list[Reach]]:
    """Returns (events replayed, outputs written, reach times per capacity/drain event)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "whatif.jsonl", "wb") as jsonl:
        collector = _Collector(jsonl)
        result = replay_db(con, overrides=overrides, on_outputs=collector, verify=False)
    side = con.execute(_SIDE_BY_SIDE, collector.columns)
    header = [d[0] for d in side.description]
    rows = side.fetchall()
    _write_csv(out_dir / "weights.csv", header, rows)
    return result.events, collector.outputs, reach_times(con, rows, fraction)


def _write_csv(path: Path, header: list[str], rows: list[tuple[Any, ...]]) -> None:
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def reach_times(con: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]], fraction: float) -> list[Reach]:
    """Per admin event: ms until each side got ``fraction`` of the way to its final weight."""
    series: dict[str, list[tuple[int, int, float | None, float | None]]] = {}
    for _tick, ts_ns, _pool, node, as_of_seq, recorded, whatif, *_ in rows:
        series.setdefault(node, []).append((as_of_seq, ts_ns, recorded, whatif))
    events = con.execute("SELECT seq, ts_ns, node, kind, next_seq FROM admin_changes WHERE applied "
                         "ORDER BY seq").fetchall()  # a rejected command moved nothing
    reaches = []
    for seq, ts_ns, node, kind, next_seq in events:
        points = series.get(node, [])
        before = [p for p in points if p[0] < seq]
        window = [p for p in points if p[0] >= seq and (next_seq is None or p[0] < next_seq)]
        if not window:
            continue
        rec = _reach([(p[1], p[2]) for p in window], before[-1][2] if before else None, ts_ns, fraction)
        wif = _reach([(p[1], p[3]) for p in window], before[-1][3] if before else None, ts_ns, fraction)
        reaches.append(Reach(node, seq, kind, rec[0], wif[0], rec[1], wif[1]))
    return reaches


def _reach(points: list[tuple[int, float | None]], start: float | None, t0: int,
           fraction: float) -> tuple[float | None, float | None]:
    values = [(ts, w) for ts, w in points if w is not None]
    if not values:
        return None, None
    final = values[-1][1]
    start = values[0][1] if start is None else start
    tolerance = (1.0 - fraction) * abs(start - final)
    for ts, weight in values:
        if abs(weight - final) <= tolerance + 1e-9:
            return max(0.0, (ts - t0) / 1e6), final
    return None, final
