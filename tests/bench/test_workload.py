"""Workload generation: reproducible from the seed, shaped as asked."""

from __future__ import annotations

import math
import statistics

import pytest

from laswrr.bench.workload import WorkloadSpec, burst_rates, generate, mean_output_tokens, prompt_text
from laswrr.services.sim_engine.openai_api import parse_request


def test_same_seed_same_workload_other_seed_other() -> None:
    spec = WorkloadSpec(duration_s=20, rate_rps=10, cancel_share=0.2)
    assert generate(spec, 7) == generate(spec, 7)
    assert generate(spec, 7) != generate(spec, 8)


def test_poisson_rate_and_order() -> None:
    spec = WorkloadSpec(duration_s=200, rate_rps=10, cancel_share=0)
    work = generate(spec, 1)
    assert 1800 < len(work) < 2200  # 2000 expected, sd ~45
    offsets = [r.offset_s for r in work]
    assert offsets == sorted(offsets) and offsets[-1] < 200
    assert [r.index for r in work] == list(range(len(work)))
    assert all(r.cancel_after_s is None for r in work)


def test_lognormal_lengths_have_the_asked_median_and_bounds() -> None:
    spec = WorkloadSpec(duration_s=400, rate_rps=10, output_median=100, output_sigma=0.6, output_max=400)
    work = generate(spec, 3)
    outputs = [r.max_tokens for r in work]
    assert 90 <= statistics.median(outputs) <= 110
    assert max(outputs) <= 400 and min(outputs) >= 1
    assert max(r.prompt_tokens for r in work) <= spec.prompt_max
    assert mean_output_tokens(spec) == pytest.approx(100 * math.exp(0.18))


def test_cancel_share_and_delays() -> None:
    spec = WorkloadSpec(duration_s=300, rate_rps=10, cancel_share=0.1, cancel_min_s=0.5, cancel_max_s=1.0)
    work = generate(spec, 5)
    cancels = [r.cancel_after_s for r in work if r.cancel_after_s is not None]
    assert 0.07 < len(cancels) / len(work) < 0.13
    assert all(0.5 <= c <= 1.0 for c in cancels)


def test_bursty_arrivals_concentrate_in_bursts_with_the_same_mean() -> None:
    spec = WorkloadSpec(duration_s=400, rate_rps=5, arrival="bursty", burst_on_s=2, burst_off_s=6, burst_factor=3)
    on, off = burst_rates(spec)
    assert (on, off) == (15.0, pytest.approx(1.6667, abs=1e-3))
    work = generate(spec, 11)
    in_burst = sum(1 for r in work if r.offset_s % 8 < 2)
    assert 1700 < len(work) < 2300
    assert in_burst / len(work) == pytest.approx(0.75, abs=0.05)  # 15*2 / (15*2 + 1.667*6) per 8 s period


def test_prompt_text_maps_to_the_asked_prompt_tokens_in_the_simulator() -> None:
    for spec in generate(WorkloadSpec(duration_s=5, rate_rps=10), 2)[:20]:
        body = {"messages": [{"role": "user", "content": prompt_text(spec)}], "max_tokens": spec.max_tokens}
        parsed = parse_request(body, "chat", "m")
        assert parsed.prompt_tokens == max(2, spec.prompt_tokens)
        assert parsed.output_tokens == spec.max_tokens


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        generate(WorkloadSpec(rate_rps=0), 1)
    with pytest.raises(ValueError):
        generate(WorkloadSpec(arrival="weird"), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        generate(WorkloadSpec(cancel_share=1.5), 1)


def test_stratified_phases_get_the_same_length_distribution() -> None:
    spec = WorkloadSpec(duration_s=30, rate_rps=4, output_median=96, output_sigma=0.6, output_max=512)
    strata = [(0.0, 10.0), (10.0, 30.0)]
    work = generate(spec, 9, strata)
    assert work == generate(spec, 9, strata)
    first = sorted(r.max_tokens for r in work if r.offset_s < 10)
    second = sorted(r.max_tokens for r in work if r.offset_s >= 10)
    # each window holds the lognormal's quantiles (i + 0.5) / N: median and tail match the spec
    for lengths in (first, second):
        n = len(lengths)
        assert lengths[n // 2] == pytest.approx(96, rel=0.1)
        assert lengths[-1] == round(96 * math.exp(0.6 * _z(1 - 0.5 / n)))
    assert [r.offset_s for r in work] == [r.offset_s for r in generate(spec, 9)]  # same arrivals


def _z(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)
