"""A phase rejection names what an operator can do (cause ``illegal_transition``), and every
valid config change gets an ``lb.out.config`` verdict that replay compares like any output."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj


def _log(path: Path) -> None:
    log = LogBuilder()
    log.add(sj.ADMIN_CONFIG, {"set": {"drain_deadline_ms": 500}})
    log.node("a", 4)
    log.tick()
    log.add(sj.admin_undrain("a"))  # illegal: a is active
    log.add(sj.ADMIN_CONFIG, {"set": {"slow_start_window_ms": 6000}})
    log.tick()
    log.write_db(path)


def _rows(path: Path, subject: str) -> list[tuple[int, str]]:
    with duckdb.connect(str(path)) as con:
        return con.execute("SELECT seq, data FROM events WHERE stream = 'LB_OUT' AND subject = ? ORDER BY seq",
                           [subject]).fetchall()


def test_the_core_names_operator_commands(tmp_path: Path) -> None:
    path = tmp_path / "events.duckdb"
    _log(path)
    ((seq, data),) = _rows(path, sj.OUT_REJECTED)
    rejected = json.loads(data)
    assert rejected["cause"] == "illegal_transition"
    assert rejected["reason"] == ("cannot undrain a node that is active (what an operator can do now: laswrr drain, "
                                  "laswrr remove, laswrr capacity)")
    with store.open_read(path) as con:
        assert replay_db(con).identical
    with duckdb.connect(str(path)) as con:  # an altered hint is caught
        con.execute("UPDATE events SET data = ? WHERE stream = 'LB_OUT' AND seq = ?",
                    [data.replace("laswrr remove, ", ""), seq])
    with store.open_read(path) as con:
        assert not replay_db(con).identical


def test_config_changes_get_a_verdict_that_replay_compares(tmp_path: Path) -> None:
    path = tmp_path / "events.duckdb"
    _log(path)
    verdicts = [json.loads(data) for _, data in _rows(path, sj.OUT_CONFIG)]
    assert [v["set"] for v in verdicts] == [{"drain_deadline_ms": 500}, {"slow_start_window_ms": 6000}]
    assert verdicts[1]["config"]["drain_deadline_ms"] == 500 and verdicts[1]["config"]["max_capacity"] == 4096
    with store.open_read(path) as con:
        assert replay_db(con).identical
    with duckdb.connect(str(path)) as con:  # a missing verdict is a divergence
        con.execute("DELETE FROM events WHERE stream = 'LB_OUT' AND subject = ?", [sj.OUT_CONFIG])
    with store.open_read(path) as con:
        assert not replay_db(con).identical
