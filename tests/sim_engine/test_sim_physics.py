"""Unit tests of the pure continuous-batching physics (no clock, no asyncio)."""

from __future__ import annotations

import pytest

from laswrr.services.sim_engine.physics import EngineSim, RequestState, TokenEvent
from laswrr.services.sim_engine.profiles import PROFILES, get_profile


def run_until_idle(sim: EngineSim, limit: int = 1_000_000) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    for _ in range(limit):
        t = sim.next_event_time()
        if t is None:
            return events
        events.extend(sim.advance(t))
    raise AssertionError("engine never went idle")


def makespan(chip: str, capacity: int, n: int, prompt: int = 100, output: int = 50) -> float:
    sim = EngineSim(get_profile(chip), capacity)
    for _ in range(n):
        sim.submit(prompt, output, 0.0)
    events = run_until_idle(sim)
    assert sum(e.finished for e in events) == n
    return max(e.time for e in events)


def test_light_load_anchors_910b() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    req = sim.submit(512, 20, 0.0)
    events = run_until_idle(sim)
    assert req.first_token_at is not None and req.finished_at is not None
    assert 0.3 <= req.first_token_at <= 0.4  # docs/ascend.md §3: TTFT ~0.3 s light
    tpot = (req.finished_at - req.first_token_at) / (req.output_tokens - 1)
    assert 0.030 <= tpot <= 0.040  # TPOT 30-40 ms light
    assert [e.index for e in events] == list(range(20))
    assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_tpot_grows_several_fold_when_saturated() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    light, full = sim.decode_step_s(1), sim.decode_step_s(10)
    assert 0.13 <= full <= 0.2 and full / light >= 4


def test_queue_forms_when_load_exceeds_capacity() -> None:
    sim = EngineSim(get_profile("910B"), 2)
    reqs = [sim.submit(10, 30, 0.0) for _ in range(5)]
    sim.advance(1.0)
    snap = sim.snapshot(1.0)
    assert (snap.running, snap.waiting) == (2, 3)
    run_until_idle(sim)
    assert all(r.state is RequestState.FINISHED for r in reqs)
    admitted = sorted(r.admitted_at or 0.0 for r in reqs)
    assert admitted[2] > admitted[1]  # the third waited for a free slot
    assert [r.req_id for r in sorted(reqs, key=lambda r: (r.admitted_at, r.req_id))] == [r.req_id for r in reqs]


def test_capacity_cut_slows_throughput() -> None:
    # 8 streams at TPOT 3.8x decode ~2.1x the tokens/s of one stream
    assert makespan("910B", 1, 8) > 2 * makespan("910B", 8, 8)
    spans = [makespan("910B", c, 8) for c in (1, 2, 4, 8)]
    assert spans == sorted(spans, reverse=True)  # tokens/s rise with every extra slot


def test_capacity_cut_never_cuts_running_requests() -> None:
    sim = EngineSim(get_profile("910B"), 4)
    reqs = [sim.submit(10, 20, 0.0) for _ in range(6)]
    sim.advance(0.5)
    assert sim.snapshot(0.5).running == 4
    sim.set_capacity(1)
    t = 0.5
    while sim.snapshot(t).running > 1:
        t = sim.next_event_time() or t
        sim.advance(t)
        assert sim.snapshot(t).running <= 4
    run_until_idle(sim)
    assert all(r.generated == 20 for r in reqs)
    # the two queued ones started only after the batch fell below the new capacity
    late = [r for r in reqs if r.admitted_at and r.admitted_at > 0.5]
    assert len(late) == 2
    assert all(r.admitted_at >= max(q.finished_at or 0 for q in reqs[:3]) for r in late)


def test_kv_use_grows_with_tokens_held() -> None:
    sim = EngineSim(get_profile("910B"), 8, kv_tokens=10_000)
    sim.submit(1000, 100, 0.0)
    t = sim.next_event_time() or 0.0
    sim.advance(t)
    first = sim.snapshot(t).kv_tokens_used
    assert first >= 1000
    for _ in range(40):
        t = sim.next_event_time() or t
        sim.advance(t)
    assert sim.snapshot(t).kv_tokens_used > first
    sim.submit(1000, 100, t)
    sim.advance(t + 1.0)
    assert sim.snapshot(t + 1.0).kv_usage > 0.2
    run_until_idle(sim)
    assert sim.kv_tokens_used() == 0


def test_request_that_does_not_fit_kv_waits() -> None:
    sim = EngineSim(get_profile("910B"), 8, kv_tokens=3000)
    a = sim.submit(1500, 100, 0.0)
    b = sim.submit(1500, 100, 0.0)  # 3200 tokens reserved in total > 3000
    sim.advance(0.5)
    assert a.state is RequestState.RUNNING and b.state is RequestState.WAITING
    run_until_idle(sim)
    assert b.admitted_at is not None and a.finished_at is not None and b.admitted_at >= a.finished_at
    with pytest.raises(ValueError, match="KV cache"):
        sim.submit(2990, 20, 0.0)


def test_chip_ordering_910c_faster_than_910b_faster_than_910() -> None:
    spans = {chip: makespan(chip, 8, 16) for chip in ("910", "910B", "910C")}
    assert spans["910C"] < spans["910B"] < spans["910"]
    assert set(PROFILES) >= {"910", "910B", "910C", "910B4", "910C-die"}


def test_cancel_frees_slot_and_kv() -> None:
    sim = EngineSim(get_profile("910B"), 1)
    a = sim.submit(100, 1000, 0.0)
    b = sim.submit(100, 5, 0.0)
    sim.advance(1.0)
    assert a.state is RequestState.RUNNING and b.state is RequestState.WAITING
    assert sim.cancel(a.req_id) is a and a.state is RequestState.CANCELLED
    assert sim.cancel(a.req_id) is None
    run_until_idle(sim)
    assert b.state is RequestState.FINISHED and sim.kv_tokens_used() == 0


def test_speed_and_slowdown_scale_time() -> None:
    base = makespan("910B", 4, 4)
    fast = EngineSim(get_profile("910B"), 4, speed=10.0)
    slow = EngineSim(get_profile("910B"), 4)
    slow.set_slowdown(3.0)
    for sim in (fast, slow):
        for _ in range(4):
            sim.submit(100, 50, 0.0)
    fast_end = max(e.time for e in run_until_idle(fast))
    slow_end = max(e.time for e in run_until_idle(slow))
    assert fast_end == pytest.approx(base / 10, rel=1e-6)
    assert slow_end > 2.5 * base


def test_bad_knobs_rejected() -> None:
    profile = get_profile("910b")
    with pytest.raises(ValueError):
        EngineSim(profile, -1)
    with pytest.raises(ValueError):
        EngineSim(profile, 1, speed=0)
    with pytest.raises(ValueError):
        EngineSim(profile, 1).set_slowdown(0)
    with pytest.raises(ValueError, match="unknown chip"):
        get_profile("A100")
