"""`laswrr export --db PATH --parquet DIR`: the log as Parquet, for long retention.

``DIR/events.parquet`` holds the ``events`` table ordered by (stream, seq) — the only thing
needed to rebuild everything else: every command that takes ``--db`` also accepts the directory
(or the file), opening it in memory with the views on top. The analyst views are exported
beside it (``DIR/<view>.parquet``, every view of replay/views.sql but the raw row views, which
``events.parquet`` holds already) for tools that read Parquet but not SQL.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from laswrr.replay.store import views_sql

RAW_VIEWS = ("input_messages", "output_events")  # rows of events.parquet as they are (input_events: batches unnested)
VIEWS = tuple(view for view in re.findall(r"^CREATE OR REPLACE VIEW (\w+)", views_sql(), re.M) if view not in RAW_VIEWS)


def export(con: duckdb.DuckDBPyConnection, directory: Path, views: bool = True) -> dict[str, int]:
    """Write the Parquet files; returns rows written per file stem."""
    directory.mkdir(parents=True, exist_ok=True)
    written = {"events": _copy(con, "SELECT * FROM events ORDER BY stream, seq", directory / "events.parquet")}
    if views:
        for view in VIEWS:
            written[view] = _copy(con, f"SELECT * FROM {view}", directory / f"{view}.parquet")
    return written


def _copy(con: duckdb.DuckDBPyConnection, query: str, target: Path) -> int:
    literal = str(target).replace("'", "''")
    con.execute(f"COPY ({query}) TO '{literal}' (FORMAT parquet, COMPRESSION zstd)")
    row = con.execute(f"SELECT count(*) FROM read_parquet('{literal}')").fetchone()
    return int(row[0]) if row else 0
