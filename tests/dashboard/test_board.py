"""The dashboard's fold, fed by the real pure scheduler core: inputs and the outputs they cause."""

from __future__ import annotations

import json
from typing import Any

from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, batch_item, batch_payload, encode
from laswrr.services.dashboard.board import MS, S, Board, percentile

T0 = 1_800_000_000 * S


class Log:
    """Inputs through the core; every input and output folded into one Board, in time order."""

    def __init__(self) -> None:
        self.core, self.board, self.seq, self.ts_ns, self.pushes = Scheduler(), Board(), 0, T0, []

    def send(self, subject: str, payload: Any, dt_ms: int = 0) -> None:
        self.seq += 1
        self.ts_ns += dt_ms * MS
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.pushes += self.board.apply(subject, self.ts_ns, data)
        for output in self.core.apply(Envelope(self.seq, self.ts_ns, subject, data)):
            self.pushes += self.board.apply(output.subject, self.ts_ns, output.data)

    def ticks(self, count: int) -> None:
        for _ in range(count):
            self.send(sj.CLOCK_TICK, {"tick": self.core.state.tick + 1}, dt_ms=100)


def pool_log() -> Log:
    log = Log()
    for node in ("n1", "n2"):
        log.send(sj.admin_node(node), {"url": f"http://{node}:8000", "capacity": 10, "chip": "910B"})
    log.ticks(10)
    return log


def test_a_capacity_drop_is_a_mark_and_a_falling_effective_weight() -> None:
    log = pool_log()
    before = log.ts_ns
    log.send(sj.admin_capacity("n2"), {"capacity": 1}, dt_ms=100)
    dropped_at = log.ts_ns
    log.ticks(30)
    state = log.board.state(log.ts_ns)["pools"]["default"]
    n2 = next(n for n in state["nodes"] if n["node"] == "n2")
    assert n2["capacity"] == 1 and n2["phase"] == "active" and n2["effective_weight"] == n2["target_weight"] <= 1
    history = log.board.history(log.ts_ns, 60)["pools"]["default"]
    assert [dropped_at // MS, "n2", "capacity", "n2: capacity set to 1"] in history["marks"]
    curve = [point[1] for point in history["series"]["n2"] if point[0] >= dropped_at // MS]
    assert curve[0] > 5 > curve[-1] == n2["effective_weight"] and curve == sorted(curve, reverse=True)  # eases down
    n1 = [p[1] for p in history["series"]["n1"] if p[0] >= dropped_at // MS]
    assert max(n1) - min(n1) < 1  # the other node's weight stays put
    # the scrubber's view before the drop still shows the old capacity
    earlier = log.board.state(before)["pools"]["default"]
    assert next(n for n in earlier["nodes"] if n["node"] == "n2")["capacity"] == 10
    assert any(p.kind == "snapshot" and p.pool == "default" for p in log.pushes)


def test_phase_changes_and_rejections_are_marked() -> None:
    log = pool_log()
    log.send(sj.admin_drain("n1"), {}, dt_ms=100)
    log.ticks(2)
    log.send(sj.admin_capacity("nope"), {"capacity": 1}, dt_ms=100)
    kinds = [(m[1], m[2]) for m in log.board.history(log.ts_ns, 60)["pools"]["default"]["marks"]]
    assert ("n1", "admin") in kinds and ("n1", "drain") in kinds and ("nope", "rejected") in kinds
    texts = [m[3] for m in log.board.history(log.ts_ns, 60)["pools"]["default"]["marks"]]
    assert "n1: active -> draining (operator drain)" in texts and "n1: registered (capacity 10)" in texts


def test_request_statistics_over_the_sliding_window() -> None:
    log = pool_log()
    for i in range(1, 101):
        log.send(sj.req_started("n1"), {"request_id": f"r{i}", "proxy": "p"}, dt_ms=10)
        log.send(sj.req_finished("n1"), {"request_id": f"r{i}", "proxy": "p", "outcome": "completed",
                                         "ttft_ms": float(i), "duration_ms": float(10 * i)})
    log.send(sj.req_started("n2"), {"request_id": "bad", "proxy": "p"})
    log.send(sj.req_finished("n2"), {"request_id": "bad", "proxy": "p", "outcome": "upstream_error"})
    stats = log.board.state(log.ts_ns)["pools"]["default"]["requests"]
    assert stats["count"] == 101 and stats["outcomes"] == {"completed": 100, "upstream_error": 1}
    assert stats["ttft_ms"] == {"p50": 50.0, "p99": 99.0} and stats["e2e_ms"] == {"p50": 500.0, "p99": 990.0}
    assert stats["rate_per_s"] == round(101 / 60, 3)
    later = log.board.request_stats("default", log.ts_ns + 61 * S)
    assert later["count"] == 0 and later["ttft_ms"]["p50"] is None  # slid out of the window
    bins = log.board.rate_bins("default", T0, log.ts_ns)
    assert sum(ok for _, ok, _ in bins) == 100 and sum(bad for _, _, bad in bins) == 1


def test_engine_errors_and_refusals_are_answers_by_class_never_completed() -> None:
    log = pool_log()
    log.send(sj.req_started("n1"), {"request_id": "ok", "proxy": "p"}, dt_ms=10)
    log.send(sj.req_finished("n1"), {"request_id": "ok", "proxy": "p", "outcome": "completed", "status": 200})
    log.send(sj.req_started("n1"), {"request_id": "e", "proxy": "p"}, dt_ms=10)
    log.send(sj.req_finished("n1"), {"request_id": "e", "proxy": "p", "outcome": "engine_error", "status": 404})
    log.send(sj.req_refused("p"), {"request_id": "r", "proxy": "p", "status": 404, "cause": "unknown_model",
                                   "pool": "default"}, dt_ms=10)
    stats = log.board.state(log.ts_ns)["pools"]["default"]["requests"]
    assert stats["outcomes"] == {"completed": 1, "engine_error": 1, "refused": 1}
    assert stats["answers"] == {"engine 2xx": 1, "engine 4xx": 1, "router 4xx": 1}
    bins = log.board.rate_bins("default", T0, log.ts_ns)
    assert sum(ok for _, ok, _ in bins) == 1 and sum(bad for _, _, bad in bins) == 2  # no green spike


def test_batched_request_events_count_as_they_would_alone() -> None:
    alone, batched = pool_log(), pool_log()
    for i in range(1, 41):
        started = {"request_id": f"r{i}", "proxy": "p"}
        finished = {"request_id": f"r{i}", "proxy": "p", "outcome": "completed" if i % 4 else "upstream_error",
                    "ttft_ms": float(i), "duration_ms": float(10 * i)}
        alone.send(sj.req_started("n1"), started, dt_ms=10)
        alone.send(sj.req_finished("n1"), finished)
        items = [batch_item("req.started", "n1", json.dumps(started).encode()),
                 batch_item("req.finished", "n1", json.dumps(finished).encode())]
        if i == 7:
            items.insert(1, batch_item("req.finished", "n1", b'{"request_id": "x", "outcome": "lost"}'))
        batched.send(sj.req_batch("p"), batch_payload("b", i, items), dt_ms=10)
    assert batched.board.state(batched.ts_ns) == alone.board.state(alone.ts_ns)
    assert batched.board.state(batched.ts_ns)["pools"]["default"]["requests"]["count"] == 40
    assert batched.board.rate_bins("default", T0, batched.ts_ns) == alone.board.rate_bins("default", T0, alone.ts_ns)
    assert batched.board.undecodable == 1  # the bad event only; its neighbours in the batch counted


def test_npu_health_bad_payloads_and_trimming() -> None:
    log = pool_log()
    chip = {"npu_id": 0, "chip_id": 0, "health": "OK"}
    log.send(sj.metrics_npu("n1"), {"chips": [chip, {**chip, "chip_id": 1, "health": "Warning"}]}, dt_ms=100)
    log.ticks(1)
    row = next(n for n in log.board.state(log.ts_ns)["pools"]["default"]["nodes"] if n["node"] == "n1")
    assert row["npu_health"] == "Warning"
    assert log.board.apply(sj.out_snapshot("default"), log.ts_ns, b"{not json") == []
    assert log.board.apply(sj.admin_capacity("n1"), log.ts_ns, b'{"capacity": -1}') == []
    assert log.board.undecodable == 2
    log.board.trim(log.ts_ns + 3600 * S)
    state = log.board.state(log.ts_ns + 3600 * S)["pools"]["default"]
    assert {n["node"] for n in state["nodes"]} == {"n1", "n2"}  # the newest snapshot survives
    assert log.board.history(log.ts_ns + 3600 * S, 60)["pools"]["default"]["marks"] == []


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def test_queue_depth_per_band_from_queued_to_started_or_refused() -> None:
    """Flow control's held requests: each counts in its pool and band from ``lb.req.queued``
    until the ``lb.req.started`` or ``lb.req.refused`` with its id (alone or in a batch, any proxy)."""
    log = pool_log()
    t_start = log.ts_ns
    held = [("i1", "interactive", "p1"), ("b1", "batch", "p1"), ("b2", "batch", "p2"), ("d1", "default", "p2")]
    for rid, band, proxy in held:
        log.send(sj.req_queued(proxy), {"request_id": rid, "proxy": proxy, "pool": "default", "band": band,
                                        "work": 100, "ttl_ms": 30000, "cause": "saturated"}, dt_ms=10)
    log.send(sj.req_queued("p1"), {"request_id": "i1", "proxy": "p1", "band": "interactive"}, dt_ms=1)  # again: once
    t_full = log.ts_ns
    assert log.board.state(t_full)["pools"]["default"]["queue"] == {"interactive": 1, "default": 1, "batch": 2}
    log.send(sj.req_started("n1"), {"request_id": "i1", "proxy": "p1"}, dt_ms=10)  # dispatched
    expired = {"request_id": "b2", "proxy": "p2", "status": 429, "cause": "queue_timeout", "pool": "default"}
    started = {"request_id": "d1", "proxy": "p2", "pool": "default"}
    log.send(sj.req_batch("p2"), batch_payload("b", 1, [batch_item("req.refused", None, json.dumps(expired).encode()),
                                                         batch_item("req.started", "n2", json.dumps(started).encode())]),
             dt_ms=10)
    log.send(sj.req_started("n1"), {"request_id": "never-held", "proxy": "p1"}, dt_ms=10)  # not a held one
    state = log.board.state(log.ts_ns)["pools"]["default"]
    assert state["queue"] == {"interactive": 0, "default": 0, "batch": 1}
    assert log.board.state(t_full)["pools"]["default"]["queue"]["batch"] == 2  # the scrubber's past stays
    assert state["requests"]["outcomes"] == {"refused": 1}  # the expiry is still a refusal
    assert not [p for p in log.pushes if p.kind == "mark" and "req" in p.data["text"]]  # no admin marks
    series = log.board.history(log.ts_ns, 60)["pools"]["default"]["queue"]
    assert [d for _, d in series["batch"]][-3:] == [1, 2, 1] and series["batch"][0][1] == 0
    assert [d for _, d in series["interactive"]] == [0, 1, 0]
    assert series["interactive"][0][0] <= t_start // MS
    log.board.trim(log.ts_ns + 1)  # b1's end never came (its proxy died): forgotten, the depth back to 0
    assert log.board.queue_depth("default", log.ts_ns + 2) == {"interactive": 0, "default": 0, "batch": 0}
    assert log.board.held == {} and log.board.undecodable == 0


def test_a_nodes_marks_land_on_its_own_pools_chart_even_before_its_first_snapshot() -> None:
    """Issue 43 item 22: the dashboard reads LB_EVENTS and LB_OUT apart, so a node's admin events
    (recorded before the page started) may fold before any snapshot names its pool: they wait for
    it, instead of landing on every pool's chart."""
    log = Log()
    for node, pool in (("d1", "default"), ("p1", "pd")):
        log.send(sj.admin_node(node), {"url": f"http://{node}:8000", "capacity": 10, "pool": pool})
    log.ticks(2)
    board = Board()  # a page started later: the inputs of LB_EVENTS first, then LB_OUT's snapshots
    board.apply(sj.admin_capacity("p1"), log.ts_ns, b'{"capacity": 4}')
    board.apply(sj.admin_drain("d1"), log.ts_ns, b"{}")
    for pool in ("default", "pd"):
        board.apply(sj.out_snapshot(pool), log.ts_ns, encode(log.core.snapshot(pool)))
    history = board.history(log.ts_ns + MS, 60)["pools"]
    assert [m[1:3] for m in history["pd"]["marks"]] == [["p1", "capacity"]]
    assert [m[1:3] for m in history["default"]["marks"]] == [["d1", "admin"]]
