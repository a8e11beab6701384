"""Exact replay from DuckDB and tamper detection on crafted logs (real core, real DuckDB files)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from laswrr.replay import store
from laswrr.replay.replay import ReplayResult, replay_db
from laswrr.replay.synthetic import LogBuilder, workload
from laswrr.schemas import subjects as sj


def small_log() -> LogBuilder:
    """Two nodes, ticks, requests, a capacity drop, a drain that ends at once, bad inputs."""
    log = LogBuilder()
    log.node("a", 8)
    log.node("b", 4)
    log.tick()
    for i in range(6):
        log.started("a" if i % 2 else "b", f"r{i}", snapshot_seq=log.last_snapshot_seq())
    log.tick()
    log.add(sj.admin_capacity("a"), {"capacity": 2})
    log.tick()
    for i in range(6):
        log.finished("a" if i % 2 else "b", f"r{i}")
    log.add(sj.admin_capacity("b"), "not json {")
    log.add(sj.admin_capacity("zz"), {"capacity": 1})
    log.add(sj.admin_drain("b"))  # nothing in flight: draining -> drained in one input
    log.tick()
    log.tick()
    return log


def replay_file(path: Path) -> ReplayResult:
    with store.open_read(path) as con:
        return replay_db(con)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "events.duckdb"
    small_log().write_db(path)
    return path


def tamper(path: Path, sql: str, *params: object) -> None:
    con = duckdb.connect(str(path))
    con.execute(sql, list(params))
    con.close()


def test_untouched_log_replays_identically(db: Path) -> None:
    result = replay_file(db)
    assert result.identical, result.first and result.first.describe()
    assert result.events == 23 and result.first_seq == 1 and result.last_seq == 23
    assert result.snapshots >= 7 and result.outputs_compared > result.snapshots
    # draining -> drained in one input: both lb.out.phase.b outputs were recorded and compared
    assert result.verified_through == 23


def test_realistic_workload_replays_identically(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    workload(requests=2000).write_db(path)
    result = replay_file(path)
    assert result.identical, result.first and result.first.describe()
    assert result.events > 4000


def test_deleted_input_is_a_gap_even_when_no_output_depends_on_it(db: Path) -> None:
    # seq 5 is a request start: deleting it changes no output before the next tick's inflight...
    tamper(db, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq = 5")
    result = replay_file(db)
    assert not result.identical
    assert result.first is not None and result.first.kind == "gap" and result.first.seq == 5
    assert "input seq 5 missing" in result.first.describe()


def test_deleted_input_without_any_output_effect(tmp_path: Path) -> None:
    log = LogBuilder()
    log.node("a", 4)
    log.add(sj.health("a"), {"ok": True})  # seq 2: changes nothing the core outputs
    log.tick()
    path = tmp_path / "e.duckdb"
    log.write_db(path)
    tamper(path, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq = 2")
    result = replay_file(path)
    assert [result.first.kind if result.first else None, result.divergences] == ["gap", 1]


def test_altered_input_changes_outputs(db: Path) -> None:
    seq = tamper_seq(db, "lb.admin.capacity.a")
    tamper(db, "UPDATE events SET data = '{\"capacity\": 3}' WHERE stream = 'LB_EVENTS' AND seq = ?", seq)
    result = replay_file(db)
    assert result.first is not None and result.first.kind == "output" and result.first.seq == seq
    assert '"capacity":2' in (result.first.expected or "") and '"capacity":3' in (result.first.actual or "")


def test_swapped_inputs_are_caught_by_time_order(db: Path) -> None:
    # swap seq 7 and 8 (two request starts: same outputs either way), ts moves with each row
    tamper(db, "UPDATE events SET seq = CASE seq WHEN 7 THEN 8 ELSE 7 END WHERE stream = 'LB_EVENTS' AND seq IN (7, 8)")
    result = replay_file(db)
    assert result.first is not None and result.first.kind == "order" and result.first.seq == 8


def test_swapped_contents_with_effects_are_caught_by_outputs(db: Path) -> None:
    # keep seq and ts, swap subject+data of a capacity change and the tick after it
    cap = tamper_seq(db, "lb.admin.capacity.a")
    con = duckdb.connect(str(db))
    rows = con.execute("SELECT seq, subject, data FROM events WHERE stream = 'LB_EVENTS' AND seq IN (?, ?) ORDER BY seq",
                       [cap, cap + 1]).fetchall()
    for (seq, _, _), (_, subject, data) in zip(rows, reversed(rows)):
        con.execute("UPDATE events SET subject = ?, data = ? WHERE stream = 'LB_EVENTS' AND seq = ?", [subject, data, seq])
    con.close()
    result = replay_file(db)
    assert result.first is not None and result.first.seq == cap and result.first.kind in ("output", "missing")


def test_deleted_tail_is_caught_by_outputs_beyond_the_last_input(db: Path) -> None:
    tamper(db, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq >= 22")
    result = replay_file(db)
    assert result.first is not None and result.first.kind == "beyond" and result.first.seq == 22


def test_an_altered_rejection_is_caught(db: Path) -> None:
    tamper(db, "UPDATE events SET data = replace(data, 'unknown node', 'unknown nodes') "
               "WHERE stream = 'LB_OUT' AND subject = 'lb.out.rejected'")
    result = replay_file(db)
    assert result.first is not None and result.first.kind == "output" and result.first.seq == 20


def test_altered_recorded_output_is_caught(db: Path) -> None:
    tamper(db, "UPDATE events SET data = replace(data, '\"capacity\":4', '\"capacity\":5') "
               "WHERE stream = 'LB_OUT' AND seq = (SELECT min(seq) FROM events WHERE stream = 'LB_OUT' "
               "AND subject = 'lb.out.snapshot.default' AND data LIKE '%\"capacity\":4%')")
    result = replay_file(db)
    assert result.first is not None and result.first.kind == "output"


def test_unverified_tail_when_outputs_stop_early(db: Path) -> None:
    # the scheduler had not processed the last inputs: their outputs were never recorded
    tamper(db, "DELETE FROM events WHERE stream = 'LB_OUT' AND ((subject = 'lb.out.rejected' AND (data->>'as_of_seq')::INT >= 20) "
               "OR (subject <> 'lb.out.rejected' AND (data->>'as_of_seq')::INT >= 20))")
    result = replay_file(db)
    assert result.identical
    assert result.verified_through < 20 and "unverified tail" in result.summary()


def test_log_that_starts_after_retention_says_what_was_verified(db: Path) -> None:
    tamper(db, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq <= 3")
    result = replay_file(db)
    assert result.retention_gap and result.first_seq == 4
    assert "dropped by stream retention" in result.summary()
    assert not result.identical  # the nodes registered at 1..2 are unknown to a fresh core


def tamper_seq(db: Path, subject: str) -> int:
    con = duckdb.connect(str(db), read_only=True)
    row = con.execute("SELECT min(seq) FROM events WHERE stream = 'LB_EVENTS' AND subject = ?", [subject]).fetchone()
    con.close()
    assert row and row[0]
    return int(row[0])


def test_cli_exit_codes(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.cli import main

    assert main(["replay", "--db", str(db)]) == 0
    assert "identical" in capsys.readouterr().out
    tamper(db, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq = 9")
    assert main(["replay", "--db", str(db)]) == 1
    out = capsys.readouterr().out
    assert "first divergence at input seq 9 (gap)" in out
    assert main(["replay", "--db", str(db.parent / "missing.duckdb")]) == 1
    assert "no recorded log" in capsys.readouterr().err
