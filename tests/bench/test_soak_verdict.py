"""The soak's RSS verdict (bench/soak.py): windows of samples, not one sample each side."""

from __future__ import annotations

from typing import Any

from laswrr.bench.soak import verdict

WARMUP_S, SAMPLE_S, DURATION_S = 600.0, 10.0, 3600.0


def run(rss: Any) -> list[dict[str, Any]]:
    """An hour's samples of one process whose RSS (kB) at ``t`` seconds is ``rss(t)``; fds flat, no lag."""
    return [{"t_s": t, "rss_kb": {"nats": rss(t)}, "fds": {"nats": 20}, "lag_msgs": 0, "lag_s": 0.0}
            for t in (i * SAMPLE_S for i in range(int(DURATION_S / SAMPLE_S) + 1))]


def judged(rss: Any) -> dict[str, Any]:
    return verdict(run(rss), WARMUP_S, requests=1000, db_bytes=10**6)


def test_a_sawtooth_is_flat_whichever_tooth_the_ends_fall_on() -> None:
    # a GC'd heap: 55 MB climbing to 72 MB every 3 minutes, then collected; the warm-up ends at the
    # bottom of a tooth and the run high on one (one sample each: +22 %, the old verdict's reading)
    saw = judged(lambda t: 55_000 + round(17_000 * ((t - 600) % 180) / 170))
    samples = run(lambda t: 55_000 + round(17_000 * ((t - 600) % 180) / 170))
    assert samples[60]["rss_kb"]["nats"] == 55_000 and samples[-1]["rss_kb"]["nats"] > 55_000 * 1.1
    assert saw["rss_ok"] and saw["ok"], saw["rss"]
    assert abs(saw["rss"]["nats"]["end_kb"] / saw["rss"]["nats"]["warm_kb"] - 1) < 0.05


def test_one_busy_sample_at_the_end_does_not_decide() -> None:
    spike = judged(lambda t: 130_000 if t < DURATION_S else 160_000)
    assert spike["rss_ok"], spike["rss"]


def test_a_leak_is_found_and_its_trend_shown() -> None:
    leak = judged(lambda t: 100_000 + round(10 * t))  # +10 kB a second: +36 MB an hour
    assert not leak["rss_ok"] and not leak["ok"]
    nats = leak["rss"]["nats"]
    assert nats["end_kb"] > nats["warm_kb"] * 1.1 and nats["trend_pct_per_h"] > 20


def test_a_cache_filling_to_its_cap_shows_a_flat_end() -> None:
    # +14 % that stops growing half-way: missed (it grew), but the last window's trend says it is flat
    capped = judged(lambda t: 90_000 + round(13_000 * min(1.0, (t - WARMUP_S) / 1500)) if t > WARMUP_S else 90_000)
    assert not capped["rss_ok"]
    assert capped["rss"]["nats"]["trend_pct_per_h"] == 0.0


def test_a_short_run_keeps_its_windows_apart() -> None:
    samples = run(lambda t: 50_000 + round(t))[:70]  # 690 s: 90 s after a 600 s warm-up
    rss = verdict(samples, WARMUP_S, 10, 10, window_s=300)["rss"]["nats"]
    assert sum(rss["samples"]) <= 10 and rss["warm_kb"] < rss["end_kb"]
