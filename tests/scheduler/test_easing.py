"""Easing of the effective weight toward the target: bounded step, convergence, no cliff.

Rule (scheduler/weights.py): each tick eff += clip(α·(target − eff), ±step) with
step = ease_max_step × the node's largest capacity, snapped to target inside the dead band.
Defaults α = 0.5, step = 0.25 × 10 = 2.5 for a capacity-10 node, dead band 0.01.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_feed import warm_pool

from laswrr.scheduler import weights
from laswrr.scheduler.config import SchedulerConfig

CFG = SchedulerConfig()
ROUNDING = 0.0005  # values are rounded to 1e-3


@settings(max_examples=500, deadline=None)
@given(st.floats(0, 100), st.floats(0, 100), st.integers(1, 100))
def test_one_ease_step_is_bounded_and_never_overshoots(effective: float, target: float, max_capacity: int) -> None:
    effective, target = round(effective, 3), round(target, 3)
    new = weights.ease(effective, target, max_capacity, CFG)
    assert new >= 0
    assert abs(new - effective) <= max(CFG.ease_max_step * max_capacity, CFG.ease_deadband) + ROUNDING
    assert min(effective, target) - ROUNDING <= new <= max(effective, target) + ROUNDING


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 100), st.floats(0, 100), st.integers(1, 100))
def test_easing_converges_within_a_bounded_number_of_ticks(effective: float, target: float, cap: int) -> None:
    effective, target = round(effective, 3), round(target, 3)
    step = CFG.ease_max_step * cap
    # linear phase while α·Δ exceeds the step, then halving down to the dead band
    bound = math.ceil(abs(target - effective) / step) + math.ceil(math.log2(max(step, 1) / CFG.ease_deadband)) + 2
    for _ in range(bound):
        effective = weights.ease(effective, target, cap, CFG)
    assert effective == target


def _trace(feed, node: str, ticks: int) -> list[float]:  # type: ignore[no-untyped-def]
    values = []
    for _ in range(ticks):
        feed.tick()
        values.append(feed.node(node).effective)
    return values


def test_capacity_drop_10_to_1_is_a_ramp_of_several_ticks_never_one_jump() -> None:
    feed = warm_pool("n1", "n2", "n3")
    before = feed.node("n2").effective
    other = feed.node("n1").effective
    feed.capacity("n2", 1)
    target = feed.node("n2").target
    assert math.isclose(target, other / 10, abs_tol=0.001)  # same load, a tenth of the capacity
    assert feed.node("n2").effective == before  # the admin event re-targets, only ticks move eff
    trace = _trace(feed, "n2", 20)
    steps = [a - b for a, b in zip([before, *trace], trace)]
    assert all(0 <= s <= 2.5 + ROUNDING for s in steps), steps  # ≤ ease_max_step × max capacity
    assert trace[0] == round(before - 2.5, 3)  # first tick: the step cap binds, not the target
    first_close = next(i for i, v in enumerate(trace) if abs(v - target) <= CFG.ease_deadband) + 1
    assert 4 <= first_close <= 14, trace  # several ticks, bounded
    assert trace[-1] == target


def test_recovery_is_a_ramp_too() -> None:
    feed = warm_pool("n1", "n2", "n3")
    feed.capacity("n2", 1)
    feed.tick(30)
    low = feed.node("n2").effective
    feed.capacity("n2", 10)  # a 10x rise: slow start, then easing
    trace = _trace(feed, "n2", 80)
    steps = [a - b for a, b in zip(trace, [low, *trace])]
    assert all(0 <= s <= 2.5 + ROUNDING for s in steps), steps
    assert trace[4] < 2 * low + 0.5  # half a second in, still near the floor
    assert trace[-1] == feed.node("n1").effective  # back with the others after the window


def test_a_rise_below_the_ramp_ratio_eases_without_slow_start() -> None:
    feed = warm_pool("n1", "n2")
    feed.capacity("n2", 12)  # 1.2x < capacity_ramp_ratio 1.5
    assert feed.phase("n2") == "active"
    trace = _trace(feed, "n2", 10)
    assert trace == sorted(trace)
    assert trace[-1] == feed.node("n2").target
