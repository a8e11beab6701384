"""Results assembly, goal checks and plots on a synthetic two-policy run (no stack needed)."""

from __future__ import annotations

import json
from pathlib import Path

from laswrr.bench.metrics import RequestResult
from laswrr.bench.plots import plot_all
from laswrr.bench.report import NodePoint, PolicyRun, SnapshotPoint, admitted_to_draining_from_snapshots, scenario_summary
from laswrr.bench.scenarios import SMOKE


def _results(slow: float) -> list[RequestResult]:
    out = []
    for i in range(40):
        start = i * 0.1
        node = "n2" if i % 2 else "n1"
        e2e = 0.3 + (slow if node == "n2" and 1.5 <= start < 3.0 else 0.0)
        out.append(RequestResult(i, start, start + e2e, 0.05, e2e, node, "completed", 200, 10))
    return out


def _snapshots() -> list[SnapshotPoint]:
    points = []
    for k in range(40):
        t = k * 0.1
        w2 = 4.0 if t < 1.5 or t >= 3.0 else 1.0
        points.append(SnapshotPoint(t, k, {"n1": NodePoint(4.0, 4.0, 1, "active", True),
                                           "n2": NodePoint(w2, w2, 1, "active", True)}))
    return points


def test_summary_goals_and_plots(tmp_path: Path) -> None:
    runs = [PolicyRun("la-swrr", _results(0.1), _snapshots()), PolicyRun("rr", _results(2.0), _snapshots())]
    summary = scenario_summary(SMOKE, runs, seed=1, scale=1.0)
    json.dumps(summary)  # serialisable
    la, rr = summary["policies"]["la-swrr"], summary["policies"]["rr"]
    assert la["phases"]["drop"]["e2e_p99"] < rr["phases"]["drop"]["e2e_p99"]
    assert la["interrupted"] == 0 and la["admitted_to_draining"] == 0
    goals = summary["goals"]
    assert goals["zero_interruptions"]["met"] and goals["focus_vs_steady_p99"]["value"] is not None
    assert goals["p99_vs_rr"]["value"] < 0.5 and goals["p99_vs_rr"]["met"]
    paths = plot_all(SMOKE, runs, summary, tmp_path)
    assert [p.name for p in paths] == ["smoke-weights.png", "smoke-inflight.png", "smoke-p99.png",
                                       "smoke-balance.png"]
    assert all(p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_admission_to_a_weightless_node_is_counted() -> None:
    snaps = [SnapshotPoint(0.0, 1, {"n1": NodePoint(1.0, 1.0, 0, "active", True)}),
             SnapshotPoint(1.0, 2, {"n1": NodePoint(0.0, 0.0, 0, "draining", False)})]
    results = [RequestResult(0, 0.5, 0.9, 0.1, 0.4, "n1", "completed"),
               RequestResult(1, 1.5, 1.9, 0.1, 0.4, "n1", "completed"),
               RequestResult(2, 1.6, 1.7, None, None, None, "error")]
    assert admitted_to_draining_from_snapshots(results, snaps) == 1


def test_status_goals_compare_the_focus_tails_on_e2e_and_on_ttft() -> None:
    from laswrr.bench.report import status_goals
    from laswrr.bench.scenarios import get_scenario

    def row(e2e: float, ttft: float, reaction: float | None = None) -> dict[str, object]:
        return {"slowed_node": {"weight_reaction_s": reaction}, "phases": {"slow": {"e2e_p99": e2e, "ttft_p99": ttft}}}

    goals = status_goals(get_scenario("silent-slowdown-mindie"), {
        "la-swrr": row(6.0, 0.2, 0.3), "la-swrr+no-status": row(6.5, 0.8, 1.7),
        "vllm-router:power_of_two": row(6.2, 2.5), "sglang-router:cache_aware": row(7.0, 1.0)})
    assert goals["loss_believed_s"]["met"] and not goals["focus_p99_vs_best_peer"]["met"]
    assert goals["focus_ttft_p99_vs_best_peer"] == {"value": 0.2, "best": "sglang-router:cache_aware", "goal": 0.5,
                                                    "met": True}
    assert goals["focus_ttft_p99_vs_no_status"] == {"value": 0.25, "goal": 0.9, "met": True}
