"""A prefill/decode pair in the views: one request of two attempts, each with its role; the
completed prefill leg is neither a retry nor a continuation, a failed prefill leg retried on
another prefill node is a retry; the request's outcome is its decode leg's. The log is built
through the real core (roles registered) and replays exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj


def _leg(log: LogBuilder, node: str, attempt: str, role: str, outcome: str = "completed", **finished: Any) -> None:
    log.add(sj.req_started(node), {"request_id": attempt, "proxy": "px", "role": role})
    log.add(sj.req_finished(node), {"request_id": attempt, "proxy": "px", "outcome": outcome, "role": role,
                                    **finished}, after_ms=50)


def _vllm_pool(**roles: str) -> LogBuilder:
    """A log whose first inputs register ``node=role`` of a vllm P/D pool, and a tick."""
    log = LogBuilder()
    for node, role in roles.items():
        log.add(sj.admin_node(node), {"url": f"http://{node}:8000", "capacity": 4, "role": role, "pd_protocol": "vllm"})
    log.tick()
    return log


def _written(log: LogBuilder, path: Path, *queries: str) -> list[list[tuple[Any, ...]]]:
    """Write ``log`` to ``path``, check that it replays exactly, and run ``queries`` on it."""
    log.write_db(path)
    with store.open_read(path) as con:
        assert replay_db(con).identical
        return [con.execute(sql).fetchall() for sql in queries]


def test_a_pair_is_one_request_of_two_attempts_with_roles(tmp_path: Path) -> None:
    log = _vllm_pool(p1="prefill", p2="prefill", d1="decode")
    _leg(log, "p1", "r1", "prefill", completion_tokens=1)
    _leg(log, "d1", "r1.1", "decode", ttft_ms=120.0, completion_tokens=16)
    _leg(log, "p1", "r2", "prefill", "upstream_error", next_attempt="r2.1", error="retried: connection reset")
    _leg(log, "p2", "r2.1", "prefill", completion_tokens=1)
    _leg(log, "d1", "r2.2", "decode", ttft_ms=300.0, completion_tokens=16)
    log.tick()
    path = tmp_path / "pd.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        assert replay_db(con).identical
        attempts = con.execute("SELECT attempt_id, node, role, outcome FROM attempts ORDER BY attempt_id").fetchall()
        requests = con.execute("SELECT request_id, node, outcome, attempts, continued, ttft_ms FROM requests "
                               "ORDER BY request_id").fetchall()
        taken_over = con.execute("SELECT attempt_id, next_attempt, kind FROM continuations").fetchall()
    assert attempts == [("r1", "p1", "prefill", "completed"), ("r1.1", "d1", "decode", "completed"),
                        ("r2", "p1", "prefill", "upstream_error"), ("r2.1", "p2", "prefill", "completed"),
                        ("r2.2", "d1", "decode", "completed")]
    assert requests == [("r1", "d1", "completed", 2, 0, 120.0), ("r2", "d1", "completed", 3, 0, 300.0)]
    assert taken_over == [("r2", "r2.1", "retried")]  # the completed prefill legs are no retry
    with store.open_read(path) as con:
        from laswrr.replay.report import gather

        report = gather(con)
    assert (report["requests"], report["completed"], report["attempts"], report["retried_attempts"]) == (2, 2, 5, 1)
    assert report["pd"] == {"pair_requests": 2, "decode_only_requests": 0, "prefill_legs": 3,
                            "prefill_legs_not_completed": 1, "decode_legs": 2, "decode_legs_not_completed": 0}
    assert report["zero_interruptions"]


def test_a_pair_continued_on_a_new_pair_counts_from_the_new_decode_leg(tmp_path: Path) -> None:
    """A decode leg broken mid-stream is taken over by a new pair's prefill leg, which sends the
    client nothing: the continuation's tokens_after, added_ms and next_outcome are the new decode
    leg's, and the prefill legs' one token is not among the tokens the client had."""
    log = _vllm_pool(p1="prefill", p2="prefill", d1="decode", d2="decode")
    _leg(log, "p1", "r3", "prefill", completion_tokens=1, duration_ms=40.0)
    _leg(log, "d1", "r3.1", "decode", "continued", next_attempt="r3.2", error="connection reset mid-stream",
         ttft_ms=100.0, duration_ms=500.0, completion_tokens=10)
    _leg(log, "p1", "r3.2", "prefill", "upstream_error", next_attempt="r3.3", error="retried: connection refused",
         duration_ms=520.0)
    _leg(log, "p2", "r3.3", "prefill", completion_tokens=1, duration_ms=600.0)
    _leg(log, "d2", "r3.4", "decode", ttft_ms=650.0, duration_ms=900.0, completion_tokens=6)
    log.tick()
    rows, cut = _written(log, tmp_path / "pd-continued.duckdb",
                         "SELECT attempt_id, next_attempt, kind, next_node, tokens_before, tokens_after, added_ms, "
                         "next_outcome FROM continuations ORDER BY attempt_id", "SELECT count(*) FROM interruptions")
    assert rows == [("r3.1", "r3.2", "continued", "p1", 10, 6, 150.0, "completed"),
                    ("r3.2", "r3.3", "retried", "p2", 10, 6, 130.0, "completed")]
    assert cut == [(0,)]


def test_a_drained_prefill_node_is_drained_at_its_own_last_leg(tmp_path: Path) -> None:
    """The drains view measures a prefill node's drain against its own legs: drained on the input
    that ends its last prefill leg (after_last_attempt_ms 0), while the pair's decode leg runs on."""
    log = _vllm_pool(p1="prefill", p2="prefill", d1="decode")
    log.add(sj.req_started("p1"), {"request_id": "r5", "proxy": "px", "role": "prefill"})
    drain_seq = log.add(sj.admin_drain("p1"))
    log.tick(after_ms=30)
    leg_end = log.add(sj.req_finished("p1"), {"request_id": "r5", "proxy": "px", "outcome": "completed",
                                              "role": "prefill", "completion_tokens": 1}, after_ms=40)
    log.add(sj.req_started("d1"), {"request_id": "r5.1", "proxy": "px", "role": "decode"})
    log.tick(after_ms=30)
    log.add(sj.req_finished("d1"), {"request_id": "r5.1", "proxy": "px", "outcome": "completed", "role": "decode",
                                    "ttft_ms": 90.0, "completion_tokens": 8}, after_ms=200)
    log.tick()
    drains, decode_end = _written(log, tmp_path / "pd-drain.duckdb",
                                  "SELECT node, started_seq, drained_seq, drained_by, after_last_attempt_ms, later_legs "
                                  "FROM drains", "SELECT finished_seq FROM attempts WHERE attempt_id = 'r5.1'")
    assert drains == [("p1", drain_seq, leg_end, "inflight", 0.0, 1)]  # r5.1 ended after p1 turned drained
    assert decode_end[0][0] > leg_end
