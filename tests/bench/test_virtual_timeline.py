"""`laswrr bench --virtual` on timeline scenarios: the scheduler's core in the loop (pure, fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from laswrr.bench.scenarios import get_scenario
from laswrr.bench.virtual_timeline import (ORACLE, Alone, check_timeline, rows_for, run_timeline, status_goals,
                                           timeline_requests)


def test_a_timeline_run_is_deterministic_serves_every_request_and_follows_the_announcement() -> None:
    scenario = get_scenario("smoke")  # n2 announced 4 -> 1 at 1 s, back at 2 s
    requests = timeline_requests(scenario, 1)
    first, again = run_timeline(scenario, "la-swrr", 1, requests), run_timeline(scenario, "la-swrr", 1, requests)
    assert (first.phases, first.per_node, first.weights) == (again.phases, again.per_node, again.weights)
    assert sum(first.per_node.values()) == len(requests) == first.requests
    before = [w["n2"][0] for t, w in first.weights if t < 1.0]
    during = [w["n2"][0] for t, w in first.weights if 1.0 < t < 2.0]
    assert before and during and max(during) <= 1.0 < before[-1]  # the target follows the announced capacity


def test_the_status_source_is_believed_at_once_and_keeps_the_slowed_node_out_of_the_tail() -> None:
    """silent-slowdown-mindie in virtual time: la-swrr reads n2's free slots from its status, the
    no-status variant only from queue evidence; the power of two choices sees neither."""
    scenario = get_scenario("silent-slowdown-mindie")
    requests = timeline_requests(scenario, 1)
    runs = {p: run_timeline(scenario, p, 1, requests) for p in ("la-swrr", "la-swrr+no-status", "p2c")}
    la, without, p2c = (runs[p].slowed_node for p in ("la-swrr", "la-swrr+no-status", "p2c"))
    assert la is not None and without is not None and p2c is not None
    assert la["weight_reaction_s"] is not None and la["weight_reaction_s"] <= 0.5  # within one status poll
    assert without["weight_reaction_s"] is None or without["weight_reaction_s"] > 0.5
    assert p2c["weight_reaction_s"] is None  # not a weighted policy
    assert la["requests_in_focus"] < p2c["requests_in_focus"]
    ttft = {p: r.phases["slow"]["ttft_p99"] for p, r in runs.items()}
    assert ttft["la-swrr"] <= 0.5 * ttft["p2c"] and ttft["la-swrr"] <= 0.9 * ttft["la-swrr+no-status"]


def test_no_router_beats_the_floor_of_requests_run_alone() -> None:
    scenario = get_scenario("silent-slowdown-mindie")
    requests = timeline_requests(scenario, 2)
    alone = Alone(scenario)
    rows = [run_timeline(scenario, policy, 2, requests, alone=alone) for policy in ("la-swrr", "least-request", ORACLE)]
    rows.append(run_timeline(replace(scenario, actions=()), "la-swrr", 2, requests, alone=alone))  # nothing slowed
    for row in rows:
        assert row.focus_alone_p99 is not None and 0 < row.focus_alone_p99 <= row.phases["slow"]["e2e_p99"]
        assert row.focus_stretch_p99 is not None and row.focus_stretch_p99 >= 1.0
    goals = status_goals(scenario, rows[:3], rows[3])
    assert goals["loss_believed_s"] <= 0.5 and goals["undisturbed_e2e_p99"] == rows[3].phases["slow"]["e2e_p99"]
    assert goals["ttft_p99_vs_best_peer"]["best"] == "least-request"


def test_what_virtual_time_does_not_model_is_refused() -> None:
    with pytest.raises(ValueError, match="models the actions"):
        check_timeline(get_scenario("crash-return"))
    with pytest.raises(ValueError, match="API keys"):
        check_timeline(get_scenario("overload"))
    with pytest.raises(ValueError, match="variants"):
        rows_for(["la-swrr+flow"])
    assert rows_for(["la-swrr", "la-swrr+no-status"]) == ["la-swrr", "la-swrr+no-status", ORACLE]


def test_the_command_runs_a_timeline_scenario(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "laswrr", "bench", "--virtual", "--out", str(tmp_path),
                           "--scenario", "smoke", "--policies", "la-swrr,la-swrr+no-status,p2c"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "with the scheduler" in done.stdout and "la-swrr+no-status" in done.stdout
    document = json.loads((tmp_path / "smoke" / "virtual.json").read_text())
    assert [r["policy"] for r in document["policies"]] == ["la-swrr", "la-swrr+no-status", "p2c", ORACLE]
    assert document["policies"][0]["focus_alone_p99"] > 0 and "detail" not in document["policies"][0]
    longer = subprocess.run([sys.executable, "-m", "laswrr", "bench", "--virtual", "--out", str(tmp_path / "x2"),
                             "--scenario", "smoke", "--policies", "la-swrr", "--duration-scale", "2", "--util", "0.8"],
                            capture_output=True, text=True, timeout=120)
    assert longer.returncode == 0, longer.stderr
    scaled = json.loads((tmp_path / "x2" / "smoke" / "virtual.json").read_text())["policies"][0]
    assert scaled["requests"] > 3 * document["policies"][0]["requests"]  # twice as long at twice the load


def test_an_npu_fault_reaches_the_core_through_the_exporters_refresh() -> None:
    """npu-fault-mindie: n4's chip reports SeparateNPU 80E18402 at 14 s; the simulated exporter's
    5 s cache, the collector's 5 s scrape and its fault-code table carry it to the core, which
    ejects n4 within two refreshes and takes it back once the code clears."""
    scenario = get_scenario("npu-fault-mindie")
    run = run_timeline(scenario, "la-swrr", 1, timeline_requests(scenario, 1))
    assert run.fault is not None and run.fault["node"] == "n4"
    assert run.fault["out_after_s"] is not None and 0 < run.fault["out_after_s"] <= 10.0
    assert max(w["n4"][1] for t, w in run.weights if 24.0 <= t < 28.0) == 0.0  # out for the rest of the fault
    assert max(w["n4"][1] for t, w in run.weights if t > 40.0) > 0.0  # back once the code cleared
