"""Pure benchmark metrics on vectors whose answers are known by hand."""

from __future__ import annotations

import math

import pytest

from laswrr.bench.metrics import (
    Phase,
    RequestResult,
    balance,
    by_phase,
    capacity_timeline,
    cov,
    inflight_series,
    jain,
    max_over_mean,
    percentile,
)


def test_percentile_linear_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4; rank (n-1)q/100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # rank 1.5
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_percentile_of_1_to_100() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 90) == pytest.approx(90.1)


def test_cov_max_mean_jain_even_load() -> None:
    even = [2.0, 2.0, 2.0, 2.0]
    assert cov(even) == 0.0
    assert max_over_mean(even) == 1.0
    assert jain(even) == 1.0


def test_cov_max_mean_jain_skewed_load() -> None:
    skewed = [4.0, 0.0, 0.0, 0.0]  # everything on one of four nodes
    assert cov(skewed) == pytest.approx(math.sqrt(3))  # std = sqrt(3), mean = 1
    assert max_over_mean(skewed) == 4.0
    assert jain(skewed) == 0.25  # 1/n
    assert jain([1.0, 3.0]) == pytest.approx(16 / 20)
    assert cov([1.0, 3.0]) == pytest.approx(0.5)


def test_degenerate_inputs_are_none() -> None:
    assert cov([]) is None and cov([0.0, 0.0]) is None
    assert jain([]) is None and jain([0.0]) is None
    assert max_over_mean([0.0]) is None


def _r(i: int, start: float, end: float, node: str, outcome: str = "completed",
       ttft: float | None = 0.1) -> RequestResult:
    e2e = end - start if outcome == "completed" else None
    return RequestResult(i, start, end, ttft, e2e, node, outcome)


def test_by_phase_uses_start_time_and_completed_e2e() -> None:
    phases = [Phase("steady", 0.0, 10.0), Phase("drop", 10.0, 20.0)]
    results = [_r(0, 1.0, 3.0, "a"), _r(1, 9.5, 15.0, "b"), _r(2, 11.0, 12.0, "a", "interrupted"),
               _r(3, 12.0, 12.5, "b", "client_cancelled", ttft=None)]
    out = by_phase(results, phases)
    assert out["steady"]["requests"] == 2
    assert out["steady"]["e2e_p50"] == pytest.approx(3.75)  # of 2.0 and 5.5
    assert out["drop"]["requests"] == 2
    assert out["drop"]["interrupted"] == 1 and out["drop"]["client_cancelled"] == 1
    assert out["drop"]["e2e_p99"] is None  # nothing completed
    assert out["drop"]["ttft_p50"] == pytest.approx(0.1)


def test_inflight_series_from_intervals() -> None:
    results = [_r(0, 0.0, 2.0, "a"), _r(1, 1.0, 3.0, "a"), _r(2, 1.5, 1.8, "b")]
    series = inflight_series(results, ["a", "b"], [0.5, 1.5, 2.5, 3.5])
    assert series == {"a": [1, 2, 1, 0], "b": [0, 1, 0, 0]}


def test_balance_is_relative_to_true_capacity() -> None:
    # a has capacity 2 and 2 in flight, b capacity 1 and 1 in flight: utilisation 1 and 1 -> even.
    results = [_r(0, 0.0, 1.0, "a"), _r(1, 0.0, 1.0, "a"), _r(2, 0.0, 1.0, "b")]
    cap = capacity_timeline({"a": 2, "b": 1}, [])
    out = balance(results, ["a", "b"], cap, [Phase("all", 0.0, 1.0)], step_s=0.25)
    assert out["overall"]["samples"] == 4
    assert out["overall"]["cov"] == 0.0 and out["overall"]["jain"] == 1.0


def test_balance_skips_zero_capacity_nodes() -> None:
    results = [_r(0, 0.0, 2.0, "a"), _r(1, 0.0, 2.0, "b"), _r(2, 0.0, 2.0, "c")]
    cap = capacity_timeline({"a": 1, "b": 1, "c": 1}, [(1.0, "c", 0)])
    out = balance(results, ["a", "b", "c"], cap, [Phase("p1", 0.0, 1.0), Phase("p2", 1.0, 2.0)], step_s=0.5)
    assert out["p1"]["cov"] == 0.0 and out["p2"]["cov"] == 0.0
    assert out["p2"]["mean_util"] == 1.0


def test_capacity_timeline_steps() -> None:
    cap = capacity_timeline({"n1": 10}, [(5.0, "n1", 1), (10.0, "n1", 10)])
    assert [cap("n1", t) for t in (0.0, 4.99, 5.0, 9.0, 10.0)] == [10, 10, 1, 1, 10]
    assert cap("other", 1.0) == 0.0
