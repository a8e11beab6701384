"""Analyst views, `laswrr report` and `laswrr export` on a crafted log with known answers."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import MS, T0_NS, LogBuilder
from laswrr.schemas import subjects as sj


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """Every outcome once, an admission to a draining node, a proxy that stops with a request
    open, a request open at the end, an operator drain that ends at in-flight 0 and a capacity-0
    drain cut short by the deadline (50 ms, set by a recorded config event)."""
    log = LogBuilder()
    seqs: dict[str, int] = {}
    log.add(sj.ADMIN_CONFIG, {"set": {"drain_deadline_ms": 50}})
    log.node("a", 4)
    log.node("b", 4)
    log.tick()
    snap = log.last_snapshot_seq()
    for rid, node, outcome in (("r1", "a", "completed"), ("r2", "b", "client_cancelled"),
                               ("r3", "a", "upstream_error"), ("r4", "a", "router_aborted")):
        log.started(node, rid, snapshot_seq=snap)
        log.finished(node, rid, outcome=outcome, ttft_ms=40.0, duration_ms=500.0)
    log.started("b", "r5", snapshot_seq=snap)
    seqs["drain_b"] = log.add(sj.admin_drain("b"))
    seqs["r6"] = log.started("b", "r6", snapshot_seq=log.last_snapshot_seq())  # routed on a stale view
    log.finished("b", "r6")
    seqs["b_drained"] = log.finished("b", "r5", after_ms=20)
    log.started("a", "r7", proxy="p2", snapshot_seq=log.last_snapshot_seq())
    log.started("a", "r8", proxy="p1", snapshot_seq=log.last_snapshot_seq())
    seqs["p2_stopped"] = log.add(sj.proxy_stopped("p2"))
    log.add(sj.proxy_heartbeat("p1"), {"inflight": 1})  # p1 lives on: the log will not end cleanly
    seqs["cap_a"] = log.add(sj.admin_capacity("a"), {"capacity": 0})
    seqs["a_drained"] = log.tick(after_ms=100)  # past the 50 ms deadline with r8 in flight
    log.tick()
    path = tmp_path / "events.duckdb"
    log.write_db(path)
    seqs["ts_drain_b"] = log.inputs.ts_ns[seqs["drain_b"] - 1]
    return path, seqs


def query(path: Path, sql: str) -> list[tuple[object, ...]]:
    with store.open_read(path) as con:
        return con.execute(sql).fetchall()


def test_crafted_log_replays_identically(crafted: tuple[Path, dict[str, int]]) -> None:
    with store.open_read(crafted[0]) as con:
        result = replay_db(con)
    assert result.identical, result.first and result.first.describe()


def test_requests_view(crafted: tuple[Path, dict[str, int]]) -> None:
    rows = query(crafted[0], "SELECT request_id, node, pool, proxy, outcome, ttft_ms, duration_ms, "
                             "finished_ts_ns - started_ts_ns FROM requests ORDER BY request_id")
    assert [r[:5] for r in rows] == [
        ("r1", "a", "default", "p1", "completed"), ("r2", "b", "default", "p1", "client_cancelled"),
        ("r3", "a", "default", "p1", "upstream_error"), ("r4", "a", "default", "p1", "router_aborted"),
        ("r5", "b", "default", "p1", "completed"), ("r6", "b", "default", "p1", "completed"),
        ("r7", "a", "default", "p2", None), ("r8", "a", "default", "p1", None)]
    assert rows[0][5:] == (40.0, 500.0, 1 * MS)


def test_interruptions_and_open_requests(crafted: tuple[Path, dict[str, int]]) -> None:
    path, seqs = crafted
    assert query(path, "SELECT request_id, reason, proxy_stopped_seq FROM interruptions ORDER BY request_id") == [
        ("r3", "engine_cut", None),  # its upstream error came after the client's first byte (ttft 40 ms)
        ("r4", "router_aborted", None), ("r7", "open_at_proxy_stop", seqs["p2_stopped"])]
    assert query(path, "SELECT request_id FROM open_requests") == [("r8",)]
    assert query(path, "SELECT count(*) FROM clean_end") == [(0,)]


def test_clean_shutdown_turns_open_requests_into_interruptions(tmp_path: Path) -> None:
    log = LogBuilder()
    log.node("a", 4)
    log.tick()
    log.started("a", "q1", proxy="p1")
    log.started("a", "q2", proxy="p2")  # p2 dies with q2 in flight and never says so
    log.started("a", "q3", proxy="p1")
    log.finished("a", "q3", proxy="p1")
    log.add(sj.proxy_stopped("p1"))  # the clean shutdown of the surviving proxy, with q1 open
    log.tick()
    path = tmp_path / "clean.duckdb"
    log.write_db(path)
    assert query(path, "SELECT request_id, reason FROM interruptions ORDER BY request_id") == [
        ("q1", "open_at_proxy_stop"), ("q2", "open_at_end")]
    assert query(path, "SELECT count(*) FROM open_requests") == [(0,)]


def test_admissions_to_draining(crafted: tuple[Path, dict[str, int]]) -> None:
    path, seqs = crafted
    assert query(path, "SELECT request_id, node, snapshot_seq, phase, routable, verdict FROM admissions_to_draining") == [
        ("r6", "b", seqs["drain_b"], "draining", False, "not_routable")]


def test_drains_and_drain_timeline(crafted: tuple[Path, dict[str, int]]) -> None:
    path, seqs = crafted
    drains = query(path, "SELECT node, started_seq, drained_seq, drained_by, started_reason FROM drains ORDER BY started_seq")
    assert drains == [("b", seqs["drain_b"], seqs["b_drained"], "inflight", "operator drain"),
                      ("a", seqs["cap_a"], seqs["a_drained"], "deadline", "capacity set to 0")]
    timeline = query(path, "SELECT event_seq, node, kind, capacity, drained_by, time_to_drained_ms, len(ramp) "
                           "FROM drain_timeline ORDER BY event_seq")
    assert [t[:5] for t in timeline] == [(seqs["drain_b"], "b", "drain", None, "inflight"),
                                         (seqs["cap_a"], "a", "capacity", 0, "deadline")]
    assert timeline[0][5] == pytest.approx(22.0)  # r6 started +1 ms, r6 done +1 ms, r5 done +20 ms
    assert timeline[1][5] == pytest.approx(100.0) and timeline[1][6] >= 2
    ramp = query(path, f"SELECT unnest(ramp, recursive := true) FROM drain_timeline WHERE event_seq = {seqs['drain_b']}")
    assert ramp[0][0] == seqs["ts_drain_b"] and ramp[0][2:4] == ("draining", 0.0)  # ts, tick, phase, effective


def test_weights_over_time(crafted: tuple[Path, dict[str, int]]) -> None:
    path, seqs = crafted
    rows = query(path, "SELECT node, phase, effective_weight, inflight FROM weights_over_time "
                       f"WHERE as_of_seq = {seqs['cap_a']} ORDER BY node")
    assert rows == [("a", "draining", 0.0, 1), ("b", "drained", 0.0, 0)]
    first = query(path, "SELECT ts_ns, tick, pool, node, effective_weight FROM weights_over_time "
                        "ORDER BY as_of_seq, node LIMIT 1")
    assert first == [(T0_NS + 2 * MS, 0, "default", "a", 4.0)]  # registered at seq 2, cold pool: active


def test_views_survive_malformed_rows(crafted: tuple[Path, dict[str, int]]) -> None:
    path, _ = crafted
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO events (stream, seq, ts_ns, subject, data) VALUES "
                "('LB_EVENTS', 1000, 1, 'lb.req.started.a', '{broken'), "
                "('LB_OUT', 1000, 1, 'lb.out.snapshot.default', 'garbage')")
    con.close()
    assert query(path, "SELECT count(*) FROM requests") == [(8,)]
    assert query(path, "SELECT count(*) > 0 FROM weights_over_time") == [(True,)]


def test_report_json_counts(crafted: tuple[Path, dict[str, int]], capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.cli import main

    path, seqs = crafted
    assert main(["report", "--db", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k: report[k] for k in ("requests", "completed", "client_cancelled", "upstream_error", "router_aborted",
                                   "interrupted", "open", "admitted_to_draining", "zero_interruptions")} == {
        "requests": 8, "completed": 3, "client_cancelled": 1, "upstream_error": 1, "router_aborted": 1,
        "interrupted": 3, "open": 1, "admitted_to_draining": 1, "zero_interruptions": False}
    assert [(d["node"], d["by"], d["duration_ms"], d["after_last_attempt_ms"]) for d in report["drains"]] == [
        ("b", "inflight", 22.0, 0.0),  # drained on the input that ended its last request
        ("a", "deadline", 100.0, None)]  # cut short with r8 in flight
    assert main(["report", "--db", str(path)]) == 0
    table = capsys.readouterr().out
    assert "admitted_to_draining" in table and "deadline" in table


def test_export_round_trip(crafted: tuple[Path, dict[str, int]], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.cli import main

    path, _ = crafted
    out = tmp_path / "parquet"
    assert main(["export", "--db", str(path), "--parquet", str(out)]) == 0
    original = query(path, "SELECT * FROM events ORDER BY stream, seq")
    con = duckdb.connect()
    assert con.execute(f"SELECT * FROM read_parquet('{out}/events.parquet') ORDER BY stream, seq").fetchall() == original
    assert con.execute(f"SELECT count(*) FROM read_parquet('{out}/requests.parquet')").fetchone() == (8,)
    capsys.readouterr()
    assert main(["replay", "--db", str(out)]) == 0  # the export is a replayable log
    assert "identical" in capsys.readouterr().out
    assert main(["report", "--db", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["interrupted"] == 3


def test_retries_are_attempts_of_one_request(tmp_path: Path) -> None:
    log = LogBuilder()
    log.node("a", 4)
    log.node("b", 4)
    log.tick()
    log.started("a", "q1", snapshot_seq=log.last_snapshot_seq())
    log.add(sj.req_finished("a"), {"request_id": "q1", "proxy": "p1", "outcome": "upstream_error",
                                   "error": "retried: connection refused"})
    log.started("b", "q1.1", snapshot_seq=log.last_snapshot_seq())
    log.finished("b", "q1.1", ttft_ms=70.0, duration_ms=900.0)
    path = tmp_path / "r.duckdb"
    log.write_db(path)
    assert query(path, "SELECT attempt_id, node, outcome FROM attempts ORDER BY started_seq") == [
        ("q1", "a", "upstream_error"), ("q1.1", "b", "completed")]
    assert query(path, "SELECT request_id, node, outcome, attempts, ttft_ms FROM requests") == [
        ("q1", "b", "completed", 2, 70.0)]
    with store.open_read(path) as con:
        from laswrr.replay.report import gather

        report = gather(con)
    assert (report["requests"], report["completed"], report["upstream_error"], report["retried_attempts"]) == (1, 1, 0, 1)


def test_continued_streams_are_not_interrupted(tmp_path: Path) -> None:
    """q1 breaks on a after 3 tokens, is continued on b, which breaks after 2 more and is continued
    on c; q2 is cut on a with continuation off; q3 is retried whole (non-streamed) after a 502."""
    log = LogBuilder()
    for node in ("a", "b", "c"):
        log.node(node, 4)
    log.tick()
    log.started("a", "q1")
    log.finished("a", "q1", outcome="continued", ttft_ms=40.0, duration_ms=100.0, completion_tokens=3,
                 error="ClientPayloadError: Response payload is not completed", next_attempt="q1.1")
    log.started("b", "q1.1")
    log.finished("b", "q1.1", outcome="continued", ttft_ms=130.0, duration_ms=200.0, completion_tokens=2,
                 error="stalled: no byte for 1 s", next_attempt="q1.2")
    log.started("c", "q1.2")
    log.finished("c", "q1.2", ttft_ms=260.0, duration_ms=400.0, prompt_tokens=9, completion_tokens=5)
    log.started("a", "q2")
    log.finished("a", "q2", outcome="upstream_error", ttft_ms=40.0, duration_ms=90.0, completion_tokens=3)
    log.started("a", "q3")
    log.finished("a", "q3", outcome="upstream_error", status=502, ttft_ms=None, duration_ms=30.0,
                 error="retried: HTTP 502", next_attempt="q3.1")
    log.started("b", "q3.1")
    log.finished("b", "q3.1", ttft_ms=80.0, duration_ms=80.0)
    path = tmp_path / "continued.duckdb"
    log.write_db(path)
    assert query(path, "SELECT request_id, outcome, ttft_ms, attempts, continued FROM requests ORDER BY request_id") == [
        ("q1", "completed", 40.0, 3, 2), ("q2", "upstream_error", 40.0, 1, 0), ("q3", "completed", 80.0, 2, 0)]
    assert query(path, "SELECT request_id, reason FROM interruptions") == [("q2", "engine_cut")]
    assert query(path, "SELECT attempt_id, next_attempt, kind, node, next_node, tokens_before, tokens_after, added_ms, "
                       "next_outcome FROM continuations ORDER BY finished_seq") == [
        ("q1", "q1.1", "continued", "a", "b", 3, 2, 30.0, "continued"),
        ("q1.1", "q1.2", "continued", "b", "c", 5, 5, 60.0, "completed"),
        ("q3", "q3.1", "retried", "a", "b", 0, None, 50.0, "completed")]
    with store.open_read(path) as con:
        from laswrr.replay.report import gather

        report = gather(con)
        assert replay_db(con).identical
    assert {k: report[k] for k in ("interrupted", "interrupted_engine_cut", "continued_streams", "continuations",
                                   "retried_before_first_byte", "continuation_added_ms_p50")} == {
        "interrupted": 1, "interrupted_engine_cut": 1, "continued_streams": 1, "continuations": 2,
        "retried_before_first_byte": 1, "continuation_added_ms_p50": 45.0}


def test_every_sql_example_in_the_analyst_guide_runs(crafted: tuple[Path, dict[str, int]]) -> None:
    import re

    guide = (Path(__file__).parents[2] / "docs" / "analysts.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", guide, flags=re.S)
    assert len(blocks) >= 5
    with store.open_read(crafted[0]) as con:
        for block in blocks:
            for statement in filter(str.strip, block.split(";")):
                con.execute(statement).fetchall()


def test_a_file_with_outdated_views_is_read_with_the_current_ones(crafted: tuple[Path, dict[str, int]]) -> None:
    path, _ = crafted
    con = duckdb.connect(str(path))
    con.execute("CREATE OR REPLACE VIEW requests AS SELECT 1 AS stale")  # as an older recorder left it
    con.execute("DROP VIEW interruptions")
    con.close()
    assert query(path, "SELECT count(*) FROM requests") == [(8,)]
    assert query(path, "SELECT count(*) FROM interruptions") == [(3,)]


def test_what_if_overrides_outlive_recorded_config_events(crafted: tuple[Path, dict[str, int]], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import csv

    from laswrr.cli import main

    path, seqs = crafted
    out = tmp_path / "whatif"
    # the log sets drain_deadline_ms=50 by a config event; the what-if keeps 60 s in force
    assert main(["replay", "--db", str(path), "--what-if", "drain_deadline_ms=60000", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "what-if (drain_deadline_ms=60000)" in printed and "capacity" in printed
    lines = [json.loads(line) for line in (out / "whatif.jsonl").read_text().splitlines()]
    phases = [(d["seq"], d["data"]["node"], d["data"]["to"]) for d in lines if d["subject"].startswith("lb.out.phase.")]
    assert (seqs["a_drained"], "a", "drained") not in phases  # no deadline cut in the counterfactual
    with open(out / "weights.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["tick", "ts_ns", "pool", "node", "as_of_seq", "recorded_effective", "whatif_effective",
                             "recorded_phase", "whatif_phase"]
    at_deadline = {r["node"]: r for r in rows if int(r["as_of_seq"]) == seqs["a_drained"]}
    assert (at_deadline["a"]["recorded_phase"], at_deadline["a"]["whatif_phase"]) == ("drained", "draining")
    same = [r for r in rows if int(r["as_of_seq"]) < seqs["cap_a"]]
    assert same and all(r["recorded_effective"] == r["whatif_effective"] for r in same)

    # the same run with no effective change reproduces the recording exactly
    assert main(["replay", "--db", str(path), "--what-if", "drain_deadline_ms=50", "--out", str(out / "same")]) == 0
    with open(out / "same" / "weights.csv") as handle:
        assert all(r["recorded_effective"] == r["whatif_effective"] and r["recorded_phase"] == r["whatif_phase"]
                   for r in csv.DictReader(handle))


def test_weights_over_time_shows_the_believed_slots_of_a_silent_capacity_loss(tmp_path: Path) -> None:
    log = LogBuilder()
    log.node("a", 10)
    log.node("b", 10)
    log.tick()
    for _ in range(2):  # a queue beside free slots, twice in a row: the engine runs only 2
        log.add(sj.metrics_engine("a"), {"running": 2, "waiting": 3, "kv_cache_usage": 0.1}, after_ms=500)
    seq = log.tick()
    path = tmp_path / "events.duckdb"
    log.write_db(path)
    rows = query(path, f"SELECT node, believed_slots, target_weight FROM weights_over_time WHERE as_of_seq = {seq} "
                       "ORDER BY node")
    assert [(node, slots) for node, slots, _ in rows] == [("a", 2.1), ("b", None)]  # + 10 slots · 0.1 s / 10 s
    assert rows[0][2] <= 2.1 < rows[1][2]
    with store.open_read(path) as con:
        assert replay_db(con).identical


def test_requests_open_at_a_proxy_that_is_gone_are_interruptions_by_the_recorded_void(tmp_path: Path) -> None:
    """Issue 43 item 2: a proxy killed (-9) and restarted under its id (a new boot id), and one
    that falls silent for proxy_timeout_ms, leave their open requests voided by the scheduler
    (lb.out.voided.<proxy>, replayed byte for byte): the views count them as interruptions
    (`proxy_gone`), not as open; a live proxy's open request keeps the verdict from "zero"."""
    from laswrr.replay import report as report_mod

    log = LogBuilder()
    log.add(sj.ADMIN_CONFIG, {"set": {"proxy_timeout_ms": 1000}})
    log.node("a", 16)
    log.tick()

    def start(rid: str, proxy: str, boot: str) -> int:
        return log.add(sj.req_started("a"), {"request_id": rid, "proxy": proxy, "boot_id": boot})

    for i in range(3):
        start(f"k{i}", "p1", "A")  # p1 is killed with these three open
    start("s0", "p2", "C")
    start("s1", "p2", "C")  # p2 falls silent with these two
    for i in range(2):
        start(f"l{i}", "p3", "E")
    start("live", "p4", "F")
    replaced = log.add(sj.proxy_heartbeat("p1"), {"inflight": 0, "boot_id": "B"})  # p1 restarted
    log.add(sj.proxy_heartbeat("p3"), {"inflight": 1, "boot_id": "E"})  # one finished event of p3 was lost
    for _ in range(12):  # 1.2 s: p2 silent past its timeout; p1, p3 and p4 keep beating
        log.tick()
        for proxy, boot, inflight in (("p1", "B", 0), ("p3", "E", 1), ("p4", "F", 1)):
            log.add(sj.proxy_heartbeat(proxy), {"inflight": inflight, "boot_id": boot})
    path = tmp_path / "gone.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        assert replay_db(con).identical
        rows = con.execute("SELECT request_id, reason, proxy_stopped_seq FROM interruptions ORDER BY 1").fetchall()
        causes = dict(con.execute("SELECT attempt_id, cause FROM voided").fetchall())
        facts = report_mod.gather(con)
        assert con.execute("SELECT request_id FROM open_requests ORDER BY 1").fetchall() == [("l1",), ("live",)]
    assert [r[:2] for r in rows] == [(f"k{i}", "proxy_gone") for i in range(3)] + [("s0", "proxy_gone"),
                                                                                   ("s1", "proxy_gone")]
    assert {r[2] for r in rows[:3]} == {replaced}
    assert causes == {"k0": "proxy_replaced", "k1": "proxy_replaced", "k2": "proxy_replaced",
                      "s0": "proxy_silent", "s1": "proxy_silent", "l0": "finish_lost"}
    assert (facts["interrupted"], facts["interrupted_proxy_gone"], facts["cut_by_router"], facts["open"],
            facts["finished_event_lost"], facts["verdict"], facts["zero_interruptions"]) == (
        5, 5, 5, 2, 1, "interruptions_found", False)


def test_a_log_with_requests_open_on_live_proxies_is_not_zero_interruptions(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.replay import report as report_mod

    log = LogBuilder()
    log.node("a", 4)
    log.tick()
    log.started("a", "q1")
    log.finished("a", "q1")
    log.started("a", "q2")  # still streaming when the log was read
    log.add(sj.proxy_heartbeat("p1"), {"inflight": 1})
    path = tmp_path / "live.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        facts = report_mod.gather(con)
    assert (facts["interrupted"], facts["open"], facts["verdict"], facts["zero_interruptions"]) == (
        0, 1, "open_requests", False)
    report_mod.render(facts)
    out = " ".join(capsys.readouterr().out.split())
    assert "1 requests still open on live proxies" in out and "zero interruptions" not in out


def test_the_report_never_cuts_a_node_id_when_piped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.replay import report as report_mod

    node = "sim-910b-2-replacement-in-rack-17-slot-3"  # wider than its column at 80 characters
    log = LogBuilder()
    log.node(node, 4)
    log.tick()
    log.add(sj.admin_drain(node))
    log.tick()
    path = tmp_path / "long.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        report_mod.render(report_mod.gather(con))
    out = capsys.readouterr().out
    assert node in out and "…" not in out, out
