"""Load signals -> target weight: staleness, queue, dead reckoning, latency, config events.

Defaults: load = Σ w_k·signal_k / Σ w_k with w = queue .35, running .25, kv .15, npu .05,
latency .20; target = clamp(capacity·health·(1 − 0.9·load), 0.05·capacity, capacity);
unknown_load 0.5; samples start ageing at 3 s and are fully unknown at 10 s.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from sched_feed import Feed, idle_pool, rejections, warm_pool

from laswrr.scheduler import weights
from laswrr.scheduler.config import SchedulerConfig, with_changes
from laswrr.schemas import subjects as sj

CFG = SchedulerConfig()


def _load(feed: Feed, node: str) -> dict:  # type: ignore[type-arg]
    return feed.view(node)["load"]


def test_fresh_idle_samples_give_the_full_capacity() -> None:
    feed = idle_pool("n1", "n2")
    load = _load(feed, "n1")
    assert (load["queue"], load["running"], load["kv"], load["npu"], load["load"], load["stale"]) == \
        (0.0, 0.0, 0.0, 0.0, 0.0, False)
    assert feed.node("n1").target == 10.0


def test_stale_samples_decay_toward_unknown_not_idle() -> None:
    feed = idle_pool("n1", "n2")
    loads, targets = [], []
    for _ in range(12):  # 12 s with no new samples
        feed.tick(period_ms=1000)
        loads.append(_load(feed, "n1")["load"])
        targets.append(feed.node("n1").target)
    assert loads[:2] == [0.0, 0.0]  # fresh until 3 s
    assert loads == sorted(loads) and loads[-1] > loads[3] > 0  # then rising
    final = _load(feed, "n1")
    assert final["stale"] is True
    assert (final["queue"], final["running"], final["kv"], final["npu"]) == (0.5, 0.5, 0.5, 0.5)
    assert targets[-1] == round(10 * (1 - 0.9 * final["load"]), 3) < 10.0
    assert final["sample_age_ms"] == 12_100  # the samples came one 100 ms tick before


def test_halfway_through_the_ageing_window_a_sample_is_half_unknown() -> None:
    assert weights.staleness(None, CFG) == 1.0
    assert weights.staleness(3_000 * 1_000_000, CFG) == 0.0
    assert weights.staleness(6_500 * 1_000_000, CFG) == 0.5
    assert weights.blend(0.0, 0.5, 0.5) == 0.25
    assert weights.blend(None, 0.0, 0.5) == 0.5


def test_npu_samples_age_on_their_own_clock() -> None:
    feed = idle_pool("n1", "n2")
    for _ in range(12):  # engine samples keep coming, npu-smi went quiet
        feed.engine("n1")
        feed.tick(period_ms=1000)
    load = _load(feed, "n1")
    assert (load["queue"], load["kv"], load["stale"]) == (0.0, 0.0, False)
    assert load["npu"] == 0.5


def test_a_node_with_a_queue_gets_a_lower_target() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=10, waiting=10, kv=0.6)
    feed.engine("n2", running=2, waiting=0, kv=0.1)
    feed.tick()
    q = _load(feed, "n1")
    assert (q["queue"], q["running"]) == (0.5, 1.0)  # 10 waiting on 10 slots; all slots busy
    assert feed.node("n1").target < feed.node("n2").target < 10.0
    expected = (0.35 * 0.5 + 0.25 * 1.0 + 0.15 * 0.6 + 0.05 * 0.0) / 1.0
    other = 0.25 * 0.2 + 0.15 * 0.1
    assert (q["load"], _load(feed, "n2")["load"]) == (round(expected, 3), round(other, 3))
    # the target moves each load 0.05 toward the pool's mean first (the dead band)
    shrunk = weights.shrink_loads([expected, other], CFG.load_deadband)[0]
    assert shrunk == (expected + other) / 2 + (expected - other) / 2 - 0.05
    assert feed.node("n1").target == round(10 * (1 - 0.9 * shrunk), 3)


def test_an_engine_that_queues_below_its_registered_capacity_is_saturated() -> None:
    # Silent slowdown: registered with 10 slots, the engine now runs only 2 and queues 3.
    # Without looking at the engine's own queue, 5 of 10 would read as half-idle.
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=2, waiting=3, kv=0.1)
    feed.engine("n2", running=5, waiting=0, kv=0.1)
    feed.tick()
    slow, healthy = _load(feed, "n1"), _load(feed, "n2")
    assert (slow["queue"], slow["running"]) == (0.6, 1.0)  # 3 waiting on its 2 real slots
    assert (healthy["queue"], healthy["running"]) == (0.0, 0.5)
    expected = weights.shrink_loads([0.35 * 0.6 + 0.25 * 1.0 + 0.15 * 0.1, 0.25 * 0.5 + 0.15 * 0.1], CFG.load_deadband)[0]
    assert feed.node("n1").target == round(10 * (1 - 0.9 * expected), 3) < 0.75 * feed.node("n2").target
    assert slow.get("slots") is None  # one sample is not yet evidence (a request can wait a step)


def test_inflight_from_request_events_is_dead_reckoned_over_the_last_sample() -> None:
    feed = idle_pool("n1", "n2")
    for _ in range(8):
        feed.start("n1")  # the engine sample (running 0) predates these
    feed.tick()
    assert _load(feed, "n1")["running"] == 0.8
    for _ in range(4):
        feed.start("n1")
    feed.tick()
    load = _load(feed, "n1")
    assert (load["running"], load["queue"]) == (1.0, round(2 / 12, 3))
    assert feed.view("n1")["inflight"] == 12


def test_latency_signal_is_relative_to_the_pools_best() -> None:
    feed = idle_pool("n1", "n2", "n3")
    feed.engine("n1", ttft_ms=100.0)
    feed.engine("n2", ttft_ms=400.0)
    feed.tick()
    assert _load(feed, "n1")["latency"] == 0.0
    assert _load(feed, "n2")["latency"] == 0.75  # 1 − 100/400
    assert _load(feed, "n3")["latency"] == 0.0  # no latency known yet: no penalty
    assert feed.node("n2").target < feed.node("n1").target


def test_latency_is_an_ewma() -> None:
    feed = warm_pool("n1")
    feed.engine("n1", ttft_ms=100.0)
    feed.engine("n1", ttft_ms=200.0)
    assert feed.node("n1").ttft_ewma == 120.0  # 100 + 0.2·(200 − 100)
    rid = feed.start("n1")
    feed.finish("n1", rid, ttft_ms=20.0)  # a finished event without `stream` (an older proxy): as recorded
    assert feed.node("n1").ttft_ewma == 100.0  # 120 + 0.2·(20 − 120)
    rid = feed.start("n1")
    feed.finish("n1", rid, ttft_ms=50.0, stream=True)
    assert feed.node("n1").ttft_ewma == 90.0  # 100 + 0.2·(50 − 100)


def test_a_whole_answer_teaches_the_latency_signal_nothing() -> None:
    """A non-streamed answer's ttft_ms is its first byte, sent with its last token: its whole
    duration, not a time to first token (RequestFinished.first_token_ms)."""
    feed = warm_pool("n1")
    feed.engine("n1", ttft_ms=100.0)
    rid = feed.start("n1")
    feed.finish("n1", rid, ttft_ms=6000.0, stream=False)
    assert feed.node("n1").ttft_ewma == 100.0


def test_the_floor_keeps_a_saturated_node_observed() -> None:
    config = with_changes(CFG, {"max_load_cut": 1.0})
    assert weights.target_weight(10, 1.0, 1.0, config) == 0.5  # floor 5 % of capacity
    assert weights.target_weight(10, 1.0, 0.0, config) == 10.0
    assert weights.target_weight(10, 0.0, 0.0, config) == 0.0  # health 0 is not routable at all


def test_config_event_takes_effect() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", ttft_ms=100.0)
    feed.engine("n2", ttft_ms=400.0)
    feed.tick()
    before = feed.node("n2").target
    out = feed.config(w_latency=0.0)
    assert rejections(out) == []
    assert feed.scheduler.config.w_latency == 0.0
    feed.tick()
    assert feed.node("n2").target == 10.0 > before


def test_config_event_with_bad_keys_or_values_is_rejected_and_changes_nothing() -> None:
    feed = warm_pool("n1")
    for changes, expect in (({"w_latncy": 0.1}, "unknown configuration key(s): w_latncy"),
                            ({"ease_alpha": 2.0}, "ease_alpha=2.0 must be within 0..1"),
                            ({"drain_deadline_ms": "soon"}, "invalid configuration"),
                            ({"drain_deadline_ms": -1}, "drain_deadline_ms"),
                            ({"consecutive_failures": 0}, "consecutive_failures"),
                            ({"max_ejection_percent": 150.0}, "max_ejection_percent"),
                            ({"capacity_ramp_ratio": 0.5}, "capacity_ramp_ratio")):
        reasons = rejections(feed.send(sj.ADMIN_CONFIG, {"set": changes}))
        assert len(reasons) == 1 and expect in reasons[0], (changes, reasons)
        assert feed.scheduler.config == CFG
    assert "invalid lb.admin.config payload" in rejections(feed.send(sj.ADMIN_CONFIG, {"w_kv": 0.1}))[0]


def test_config_integer_for_a_float_key_is_accepted() -> None:
    feed = warm_pool("n1")
    assert rejections(feed.config(ease_alpha=1)) == []
    assert feed.scheduler.config.ease_alpha == 1.0


def test_weights_never_exceed_capacity_or_go_negative() -> None:
    for load in (-1.0, 0.0, 0.3, 1.0, 2.0):
        for health in (0.0, 0.7, 1.0):
            target = weights.target_weight(7, health, load, CFG)
            assert 0.0 <= target <= 7.0
            assert math.isclose(target, round(target, 3))


# -- silent capacity loss: queue evidence -> believed slots (AIMD) ------------------------------


def _slots(feed: Feed, node: str) -> float | None:
    return _load(feed, node).get("slots")


def test_a_queue_beside_free_slots_twice_in_a_row_sets_the_believed_slots() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=2, waiting=3, kv=0.1, dt_ms=500)
    feed.tick()
    assert _slots(feed, "n1") is None  # once could be a request waiting for the next step
    feed.engine("n1", running=2, waiting=3, kv=0.1, dt_ms=500)
    feed.tick()
    assert CFG.slots_regain_ms == 10_000
    assert _slots(feed, "n1") == 2.1  # the tick came 100 ms later: + 10 slots · 0.1 s / 10 s
    assert feed.node("n1").target <= 2.0 < feed.node("n2").target
    # the occupancy is now measured against the 2 slots it runs: 2 in flight fill it
    feed.engine("n1", running=2, waiting=0, dt_ms=100)
    feed.start("n1")
    feed.start("n1")
    feed.tick()
    assert _load(feed, "n1")["running"] == 1.0


def test_the_belief_climbs_back_to_the_capacity_over_slots_regain_ms() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=2, waiting=3)
    feed.engine("n1", running=2, waiting=3)
    believed = []
    for _ in range(20):
        feed.tick(period_ms=1000)
        believed.append(_slots(feed, "n1"))
    assert believed[:3] == [3.0, 4.0, 5.0]  # + capacity / 10 s per second
    assert believed[6] == 9.0
    assert believed[7:] == [None] * 13  # back at 10: the registered capacity rules again
    assert feed.node("n1").slots_seen is None
    assert feed.node("n1").target == feed.node("n2").target  # both merely stale by now


def test_single_or_interleaved_queue_samples_are_not_evidence() -> None:
    feed = idle_pool("n1", "n2")
    for running, waiting in ((3, 1), (3, 0), (2, 1), (4, 0), (10, 5), (10, 5)):
        feed.engine("n1", running=running, waiting=waiting)
        feed.tick()
        assert _slots(feed, "n1") is None  # a queue with every slot busy is just a full node


def test_running_above_the_belief_raises_it_and_an_announced_capacity_replaces_it() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=2, waiting=3)
    feed.engine("n1", running=2, waiting=3)
    feed.tick()
    assert _slots(feed, "n1") == 2.1  # 100 ms later: + 10 slots · 0.1 s / 10 s
    feed.engine("n1", running=6, waiting=0)
    feed.tick()
    assert _slots(feed, "n1") == 6.1
    feed.engine("n1", running=4, waiting=0)  # fewer running without a queue says nothing
    feed.tick()
    assert _slots(feed, "n1") == 6.2
    feed.capacity("n1", 8)
    feed.tick()
    assert _slots(feed, "n1") is None and feed.node("n1").capacity == 8


# -- the load dead band ---------------------------------------------------------------------------


def test_identical_nodes_with_a_little_load_noise_get_identical_targets() -> None:
    feed = idle_pool("n1", "n2", "n3")
    feed.engine("n1", running=1, kv=0.02, ttft_ms=100.0)
    feed.engine("n2", running=2, kv=0.03, ttft_ms=120.0)
    feed.engine("n3", running=1, kv=0.01, ttft_ms=110.0)
    feed.tick()
    loads = [_load(feed, n)["load"] for n in ("n1", "n2", "n3")]
    assert len(set(loads)) == 3 and max(loads) - min(loads) < 0.1
    targets = {feed.node(n).target for n in ("n1", "n2", "n3")}
    assert len(targets) == 1 and targets.pop() < 10.0
    # without the dead band the same signals spread the weights
    feed.config(load_deadband=0.0)
    feed.tick()
    assert len({feed.node(n).target for n in ("n1", "n2", "n3")}) == 3


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), st.floats(0.0, 0.5))
def test_shrink_moves_each_load_at_most_band_toward_the_mean_and_keeps_the_order(loads: list[float],
                                                                                 band: float) -> None:
    out = weights.shrink_loads(loads, band)
    mean = sum(loads) / len(loads)
    for before, after in zip(loads, out):
        assert min(before, mean) - 1e-12 <= after <= max(before, mean) + 1e-12
        assert abs(after - before) <= band + 1e-12
        if len(loads) > 1 and abs(before - mean) <= band:
            assert math.isclose(after, mean)
    order = sorted(range(len(loads)), key=loads.__getitem__)
    assert all(out[a] <= out[b] + 1e-12 for a, b in zip(order, order[1:]))


def test_the_belief_is_held_while_the_node_answers_much_slower_than_the_pool() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n2", ttft_ms=100.0)
    feed.engine("n1", running=2, waiting=3, ttft_ms=400.0)  # latency 1 − 100/400 = 0.75
    feed.engine("n1", running=2, waiting=3, ttft_ms=400.0)
    for _ in range(5):
        feed.tick(period_ms=1000)
        assert _slots(feed, "n1") == 2.0
    for _ in range(12):  # it answers as fast as n2 again: the EWMA falls, the latency signal with it
        feed.engine("n1", running=1, ttft_ms=100.0)
    feed.tick(period_ms=1000)
    assert _load(feed, "n1")["latency"] <= 0.5
    assert _slots(feed, "n1") == 3.0  # climbing again from the last time it was held
