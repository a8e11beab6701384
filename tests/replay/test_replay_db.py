"""Exact replay from DuckDB and tamper detection on crafted logs (real core, real DuckDB files)."""

from __future__ import annotations

import random
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


# -- reading the file in its own order (replay/replay.py, "Memory") -----------------------------------


def shuffled_copy(log: LogBuilder, path: Path, seed: int, runs: int) -> None:
    """``log`` written as the recorder writes it, but in ``runs`` inserts, each of a random share of
    the rows of both streams in a random order (the file's order is then far from seq order)."""
    rng = random.Random(seed)
    rows = [(cols.stream, i) for cols in (log.inputs, log.outputs) for i in range(len(cols))]
    rng.shuffle(rows)
    con = store.open_writer(path)
    try:
        for part in range(runs):
            batches = {sj.EVENTS_STREAM: store.Columns(sj.EVENTS_STREAM), sj.OUT_STREAM: store.Columns(sj.OUT_STREAM)}
            for stream, i in rows[part * len(rows) // runs:(part + 1) * len(rows) // runs]:
                cols = log.inputs if stream == sj.EVENTS_STREAM else log.outputs
                batches[stream].append(cols.seq[i], cols.ts_ns[i], cols.subject[i], cols.payload(i))
            store.insert_rows(con, list(batches.values()))
    finally:
        con.close()


def everything(result: ReplayResult) -> tuple[object, ...]:
    return (result.summary(), result.found, result.divergences, result.outputs_compared, result.duplicates,
            result.verified_through)


@pytest.mark.parametrize("runs", [1, 7])
def test_a_file_in_any_order_replays_as_the_same_file_in_seq_order(tmp_path: Path, runs: int) -> None:
    log = workload(requests=1500)
    log.write_db(tmp_path / "ordered.duckdb")
    shuffled_copy(log, tmp_path / "shuffled.duckdb", seed=runs, runs=runs)
    with duckdb.connect(str(tmp_path / "shuffled.duckdb"), read_only=True) as con:  # the premise: far from seq order
        seqs = [row[0] for row in con.execute("SELECT seq FROM events WHERE stream = 'LB_EVENTS'").fetchall()]
    assert sum(1 for a, b in zip(seqs, seqs[1:]) if b < a) > len(seqs) // 10
    ordered, shuffled = replay_file(tmp_path / "ordered.duckdb"), replay_file(tmp_path / "shuffled.duckdb")
    assert ordered.identical and ordered.outputs_compared > 20
    assert everything(shuffled) == everything(ordered)
    for path in (tmp_path / "ordered.duckdb", tmp_path / "shuffled.duckdb"):  # the same divergences, in the same order
        tamper(path, "DELETE FROM events WHERE stream = 'LB_EVENTS' AND seq % 50 = 7")
        tamper(path, "UPDATE events SET data = 'not json' WHERE stream = 'LB_OUT' AND seq % 9 = 4")
        tamper(path, "UPDATE events SET ts_ns = ts_ns - 1000000000 WHERE stream = 'LB_EVENTS' AND seq % 61 = 3")
    ordered, shuffled = replay_file(tmp_path / "ordered.duckdb"), replay_file(tmp_path / "shuffled.duckdb")
    kinds = [d.kind for d in ordered.found]
    assert {"gap", "order", "unreadable", "unexpected"} <= set(kinds), kinds
    # found in this order: the unreadable outputs, the gap and time-order checks by seq, then what
    # the replay met
    unreadable, checks = kinds.count("unreadable"), kinds.count("gap") + kinds.count("order")
    assert unreadable >= 3 and kinds[:unreadable] == ["unreadable"] * unreadable
    assert set(kinds[unreadable:unreadable + checks]) == {"gap", "order"}
    in_checks = [d.seq for d in ordered.found[unreadable:unreadable + checks]]
    assert in_checks == sorted(in_checks)
    assert everything(shuffled) == everything(ordered)


def test_replay_leaves_the_connections_settings_as_it_found_them(db: Path) -> None:
    names = ("threads", "preserve_insertion_order")
    with store.open_read(db) as con:
        con.execute("SET threads = 3")
        before = [con.execute(f"SELECT current_setting('{name}')").fetchone() for name in names]
        assert replay_db(con).identical
        assert [con.execute(f"SELECT current_setting('{name}')").fetchone() for name in names] == before
