"""`laswrr report` reads its busiest views from tables computed once (report.materialised): the
same report as from the views themselves, and the connection's views are live again after it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from laswrr.replay import report, store
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj


def _log(path: Path) -> Path:
    log = LogBuilder()
    log.node("a", 4)
    log.node("b", 4)
    log.tick()
    snap = log.last_snapshot_seq()
    for rid, node, outcome in (("r1", "a", "completed"), ("r2", "b", "router_aborted"), ("r3", "a", "upstream_error")):
        log.started(node, rid, snapshot_seq=snap)
        log.finished(node, rid, outcome=outcome, ttft_ms=40.0, duration_ms=500.0)
    log.started("b", "r4", snapshot_seq=snap)
    log.add(sj.admin_drain("b"))
    log.started("b", "r5", snapshot_seq=log.last_snapshot_seq())  # admitted to a draining node
    log.finished("b", "r4", after_ms=20)
    log.tick()
    log.write_db(path)
    return path


@pytest.mark.parametrize("writable", [False, True])
def test_same_report_and_live_views_after(tmp_path: Path, writable: bool) -> None:
    path = _log(tmp_path / "events.duckdb")
    with store.open_read(path) if not writable else contextlib.nullcontext(store.open_writer(path)) as con:
        plain = report._gather(con)  # from the views as they are
        assert report.gather(con) == plain
        assert plain["admitted_to_draining"] == 1 and plain["interrupted"] == 2 and plain["drains"]
        assert not con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()
        assert not con.execute("SELECT view_name FROM duckdb_views() WHERE sql LIKE '%report_%'").fetchall()
        if writable:  # a new attempt shows in the views: they read the events again, not a stale table
            before = con.execute("SELECT count(*) FROM attempts").fetchone()
            con.execute("INSERT INTO events SELECT stream, seq + 1000, ts_ns, subject, "
                        "replace(data, '\"r1\"', '\"r9\"'), raw FROM events "
                        "WHERE stream = 'LB_EVENTS' AND data LIKE '%\"r1\"%'")
            after = con.execute("SELECT count(*) FROM attempts").fetchone()
            assert before is not None and after is not None and after[0] == before[0] + 1


def test_the_stored_input_events_are_the_view_s_rows(tmp_path: Path) -> None:
    """``input_events`` is stored without a parsed payload's text (its JSON keeps it): the rows
    read back are the view's, a payload that is not JSON and one that is not UTF-8 included."""
    log = LogBuilder()
    log.node("a", 4)
    log.add(sj.admin_capacity("a"), "not json {")
    log.add(sj.admin_capacity("a"), b'{"capacity": \xff}')
    log.add(sj.admin_capacity("a"), '{"capacity":  3,"x" : [1, 2.50]}')  # spacing kept as sent
    log.tick()
    log.started("a", "r1", snapshot_seq=log.last_snapshot_seq())
    log.finished("a", "r1", outcome="completed", ttft_ms=40.0, duration_ms=500.0)
    path = tmp_path / "events.duckdb"
    log.write_db(path)
    query = "SELECT * FROM input_events ORDER BY seq, event_index"
    with store.open_read(path) as con:
        plain = con.execute(query).fetchall()
        with report.materialised(con, ("input_events",)):
            stored = con.execute(query).fetchall()
    assert stored == plain
    assert any(row[7] is not None for row in plain) and any(row[5] is None and row[6] == "not json {" for row in plain)
