"""The slo-mixed virtual bench (bench/slo_mixed.py): deterministic, its classes measured, the
latency estimate's error reported for the rows with objectives."""

from __future__ import annotations

from laswrr.bench.slo_mixed import CLASSES, capacity_rps, run, workload


def test_a_run_is_deterministic_and_reports_goodput_per_class_and_the_estimate_error() -> None:
    requests = workload(0.6, 80, seed=3)
    assert len({r.klass for r in requests}) == 2 and capacity_rps() > 0
    first = run("la-swrr+slo", 0.6, requests, 3).summary()
    assert first == run("la-swrr+slo", 0.6, requests, 3).summary()
    for klass in CLASSES:
        assert 0 <= first[klass]["good_share"] <= 1 and first[klass]["ttft_p50"] is not None
    assert first["estimate_abs_error_s"]["n"] > 40
    today = run("la-swrr", 0.6, requests, 3).summary()
    assert "estimate_abs_error_s" not in today
    refusing = run("la-swrr+slo-refuse", 1.2, workload(1.2, 80, seed=3), 3).summary()
    assert sum(refusing[k]["refused"] for k in CLASSES) >= 0


def test_the_bench_command_runs_it_in_virtual_time_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "laswrr", "bench", "--scenario", "slo-mixed"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "add --virtual" in done.stderr
    listed = subprocess.run([sys.executable, "-m", "laswrr", "bench", "--list"], capture_output=True, text=True)
    assert "slo-mixed" in listed.stdout


def test_the_sglang_rows_pick_from_the_requests_texts_and_count_their_branches() -> None:
    requests = workload(0.8, 80, seed=3)
    for row in ("sglang-cache-aware", "sglang-cache-aware-tree"):
        summary = run(row, 0.8, requests, 3).summary()
        assert summary == run(row, 0.8, requests, 3).summary()
        assert sum(summary["decisions"].values()) == len(requests)
        assert summary["decisions"].get("hit", 0) == 0  # every text is the request's own: nothing to match
