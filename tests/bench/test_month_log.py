"""bench/month_log.py: the generated log is one a real pool could have recorded (real core, real DuckDB file)."""

from __future__ import annotations

from pathlib import Path

from laswrr.bench import month_log
from laswrr.replay import store
from laswrr.replay.replay import replay_db


def test_a_generated_minute_has_its_heartbeats_applied_and_replays_identically(tmp_path: Path) -> None:
    path = tmp_path / "log.duckdb"
    result = month_log.generate(path, seconds=60, rate=20, nodes=4, min_free_bytes=0)
    assert result["event_time_s"] == 60
    with store.open_read(path) as con:
        heartbeats = con.execute("SELECT count(*) FROM input_events WHERE family = 'lb.proxy.heartbeat'").fetchone()
        rejected = con.execute("SELECT count(*), any_value(reason) FROM rejections").fetchone()
        voided = con.execute("SELECT count(*), any_value(cause) FROM voided").fetchone()
        replayed = replay_db(con)
    assert heartbeats == (60,)  # one a second: each of the two proxies every 2 s
    assert rejected == (0, None)  # a heartbeat keyed like a real proxy's (no key) is applied
    assert voided == (0, None)  # and its in-flight count is the proxy's: nothing reads as a lost finish
    assert replayed.identical and replayed.events == result["rows"]["LB_EVENTS"]
