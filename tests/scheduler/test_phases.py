"""Node phases through events: every legal transition, the illegal ones, drains, slow start,
outlier ejection with its rails, NPU health, probes, and phantom in-flight expiry.

Each scenario drives a fresh core with real events (sched_feed.Feed) and asserts on the phase
outputs, the state and the snapshot, never on private helpers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
from sched_feed import Feed, phase_changes, rejections, warm_pool

from laswrr.scheduler.config import SchedulerConfig, with_changes
from laswrr.scheduler.phases import RELEASES, TRANSITIONS, Phase, PhaseError, Trigger, next_phase, release_trigger
from laswrr.scheduler.state import CoreState
from laswrr.schemas import subjects as sj
from laswrr.schemas.words import DrainCause, EjectCause

# With no engine samples every load signal is "unknown"; for arithmetic on slow start we want
# the unloaded target to be exactly the capacity, so unknown counts as 0 in those tests.
IDLE_UNKNOWN = with_changes(SchedulerConfig(), {"unknown_load": 0.0})


def _transitions(outputs) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(frm, to) for _, frm, to, _ in phase_changes(outputs)]


def _state_but_position(feed: Feed) -> bytes:
    """The checkpoint with the log position (last_seq, now_ns) zeroed: everything else."""
    state = msgspec.msgpack.decode(feed.checkpoint(), type=CoreState)
    state.last_seq, state.now_ns = 0, 0
    return msgspec.msgpack.encode(state)


def _errors(feed: Feed, node: str, count: int, proxy: str = "p1") -> list[tuple[str, str, str, str]]:
    changes = []
    for _ in range(count):
        rid = feed.start(node, proxy)
        changes += phase_changes(feed.finish(node, rid, "upstream_error", proxy))
    return changes


# -- every legal transition, reached through events -------------------------------------------


def _active_drain_drained_undrain_warmed(feed: Feed) -> list[tuple[str, str]]:
    seen = _transitions(feed.drain("n1"))  # no in-flight: draining then drained at once
    seen += _transitions(feed.undrain("n1"))
    for _ in range(60):
        seen += _transitions(feed.tick())
    return seen


def _draining_undrain(feed: Feed) -> list[tuple[str, str]]:
    feed.start("n1")
    return _transitions(feed.drain("n1")) + _transitions(feed.undrain("n1"))


def _recovering_drain_and_forget(feed: Feed) -> list[tuple[str, str]]:
    seen = _transitions(feed.capacity("n1", 30))  # 3x: active -> recovering (ramp)
    return seen + _transitions(feed.remove("n1"))  # recovering -> draining -> drained -> removed


def _ramp(feed: Feed) -> list[tuple[str, str]]:
    return _transitions(feed.capacity("n1", 20))


def _eject_uneject_and_eject_while_recovering(feed: Feed) -> list[tuple[str, str]]:
    seen = [(f, t) for _, f, t, _ in _errors(feed, "n1", 5)]
    for _ in range(31):
        seen += _transitions(feed.tick(period_ms=1000))
    seen += [(f, t) for _, f, t, _ in _errors(feed, "n1", 5)]  # still in slow start
    return seen


def _ejected_drain(feed: Feed) -> list[tuple[str, str]]:
    feed.npu("n1", "Critical")
    return _transitions(feed.drain("n1"))


SCENARIOS: list[Callable[[Feed], list[tuple[str, str]]]] = [
    _active_drain_drained_undrain_warmed, _draining_undrain, _recovering_drain_and_forget, _ramp,
    _eject_uneject_and_eject_while_recovering, _ejected_drain,
]


def test_every_legal_transition_is_reached_through_events() -> None:
    seen: set[tuple[str, str]] = set()
    for scenario in SCENARIOS:
        seen.update(scenario(warm_pool("n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10")))
    legal = {(frm.value, to.value) for (frm, _), to in TRANSITIONS.items()}
    assert legal <= seen, f"never reached: {sorted(legal - seen)}"
    assert seen <= legal | {("new", "active"), ("new", "recovering")}, sorted(seen - legal)


def test_table_rejects_every_pair_it_does_not_list() -> None:
    for phase in Phase:
        for trigger in Trigger:
            if (phase, trigger) in TRANSITIONS:
                assert next_phase(phase, trigger) == TRANSITIONS[(phase, trigger)]
            else:
                try:
                    next_phase(phase, trigger)
                except PhaseError as exc:
                    assert f"cannot {trigger.value} a node that is {phase.value}" in str(exc)
                else:
                    raise AssertionError((phase, trigger))


def test_every_release_is_a_legal_move_and_only_its_own_kind_of_recovery_fires_it() -> None:
    for (phase, cause), trigger in RELEASES.items():
        assert (phase, trigger) in TRANSITIONS
        assert release_trigger(phase, cause, cause) == trigger
        others = [c for c in (*DrainCause, *EjectCause) if c is not cause]
        assert [c for c in others if release_trigger(phase, cause, c) is not None] == []
    # "npu" holds a node in both kinds; each kind's recovery releases only its own hold
    assert release_trigger(Phase.EJECTED, EjectCause.NPU, DrainCause.NPU) is None
    assert release_trigger(Phase.DRAINED, DrainCause.NPU, EjectCause.NPU) is None
    assert release_trigger(Phase.DRAINING, DrainCause.OPERATOR, DrainCause.OPERATOR) is None  # operator only
    assert release_trigger(Phase.ACTIVE, DrainCause.NONE, DrainCause.NONE) is None


def test_an_unknown_outcome_is_rejected_and_the_request_stays_in_flight() -> None:
    feed = warm_pool("n1", "n2")
    rid = feed.start("n1")
    before = _state_but_position(feed)
    outputs = feed.finish("n1", rid, "teleported")
    assert [o.subject for o in outputs] == [sj.OUT_REJECTED]
    assert rejections(outputs) == ["invalid lb.req.finished payload: Invalid enum value 'teleported' - at `$.outcome`"]
    assert _state_but_position(feed) == before and feed.node("n1").inflight == 1


def _illegal(setup: Callable[[Feed], object], act: Callable[[Feed], list], expect: str) -> None:  # type: ignore[type-arg]
    feed = warm_pool("n1", "n2", "n3")
    setup(feed)
    before = _state_but_position(feed)
    outputs = act(feed)
    assert [o.subject for o in outputs] == [sj.OUT_REJECTED]
    assert expect in rejections(outputs)[0]
    assert _state_but_position(feed) == before  # nothing but the log position moved


def test_illegal_transitions_are_rejected_and_change_nothing() -> None:
    _illegal(lambda f: None, lambda f: f.undrain("n1"), "cannot undrain a node that is active")
    _illegal(lambda f: (f.start("n1"), f.drain("n1")), lambda f: f.drain("n1"),
             "cannot drain a node that is draining")
    _illegal(lambda f: f.drain("n1"), lambda f: f.drain("n1"), "cannot drain a node that is drained")
    _illegal(lambda f: f.capacity("n1", 20), lambda f: f.undrain("n1"), "cannot undrain a node that is recovering")
    _illegal(lambda f: f.npu("n1", "Critical"), lambda f: f.undrain("n1"), "cannot undrain a node that is ejected")
    _illegal(lambda f: f.capacity("n1", 0), lambda f: f.undrain("n1"), "has capacity 0")


def test_events_for_an_unknown_node_are_rejected() -> None:
    feed = warm_pool("n1")
    before = _state_but_position(feed)
    for outputs in (feed.drain("ghost"), feed.capacity("ghost", 3), feed.engine("ghost", 1, 0),
                    feed.probe("ghost", False), feed.send(sj.req_started("ghost"), {"request_id": "x", "proxy": "p"})):
        assert "unknown node 'ghost'" in rejections(outputs)[0]
    assert _state_but_position(feed) == before


# -- draining -------------------------------------------------------------------------------


def test_drain_waits_for_inflight_to_reach_zero() -> None:
    feed = warm_pool("n1", "n2")
    r1, r2 = feed.start("n1"), feed.start("n1")
    out = feed.drain("n1")
    assert _transitions(out) == [("active", "draining")]
    snap = [o for o in out if o.subject == sj.out_snapshot("default")]
    assert snap, "a drain is published at once, not at the next tick"
    view = feed.view("n1")
    assert (view["routable"], view["effective_weight"], view["inflight"]) == (False, 0.0, 2)
    assert phase_changes(feed.finish("n1", r1)) == []
    assert phase_changes(feed.finish("n1", r2)) == [("n1", "draining", "drained", "in-flight reached 0")]


def test_drain_ends_at_the_deadline_and_says_so() -> None:
    feed = warm_pool("n1", "n2", config=with_changes(SchedulerConfig(), {"drain_deadline_ms": 1_000}))
    rid = feed.start("n1")
    feed.drain("n1")
    changes = []
    for _ in range(10):
        assert feed.phase("n1") == "draining"
        changes += phase_changes(feed.tick())
    assert changes == [("n1", "draining", "drained", "drain deadline reached with 1 in flight")]
    assert feed.node("n1").inflight == 1
    assert phase_changes(feed.finish("n1", rid)) == [] and feed.node("n1").inflight == 0


def test_remove_drains_then_forgets() -> None:
    feed = warm_pool("n1", "n2")
    rid = feed.start("n1")
    assert phase_changes(feed.remove("n1")) == [("n1", "active", "draining", "remove requested")]
    assert feed.view("n1")["routable"] is False
    out = feed.finish("n1", rid)
    assert _transitions(out) == [("draining", "drained"), ("drained", "removed")]
    assert "n1" not in feed.scheduler.state.nodes
    assert [n["node"] for n in feed.snap()["nodes"]] == ["n2"]
    assert "unknown node" in rejections(feed.drain("n1"))[0]


def test_capacity_zero_drains_and_a_positive_capacity_returns_via_recovering() -> None:
    feed = warm_pool("n1", "n2")
    assert _transitions(feed.capacity("n1", 0)) == [("active", "draining"), ("draining", "drained")]
    assert feed.view("n1")["routable"] is False
    assert phase_changes(feed.capacity("n1", 4)) == [("n1", "drained", "recovering", "capacity restored to 4")]
    assert feed.view("n1")["routable"] is True
    assert feed.view("n1")["effective_weight"] > 0


def test_operator_drain_survives_capacity_changes() -> None:
    feed = warm_pool("n1", "n2")
    feed.drain("n1")
    feed.capacity("n1", 0)
    feed.capacity("n1", 10)
    assert feed.phase("n1") == "drained"  # only an undrain returns an operator drain


# -- slow start (Envoy's formula) ----------------------------------------------------------


def _slow_start_pool(config: SchedulerConfig = IDLE_UNKNOWN) -> Feed:
    """n1, n2 registered long ago; n3 joins later, so it starts in slow start."""
    feed = Feed(config)
    feed.register("n1")
    feed.register("n2")
    feed.ticks_until(config.slow_start_window_ms + 1_000, period_ms=1_000)  # the pool is no longer new
    assert _transitions(feed.register("n3")) == [("new", "recovering")]
    return feed


def _target_after(feed: Feed, ms: int) -> float:
    feed.ticks_until(ms, period_ms=50)
    return feed.node("n3").target


def test_slow_start_is_linear_halfway_through_the_window() -> None:
    feed = _slow_start_pool()
    assert _target_after(feed, 2_500) == 5.0  # 2.5 s into a 5 s window -> 0.5 of 10


def test_slow_start_has_the_min_pct_floor() -> None:
    feed = _slow_start_pool()
    assert feed.node("n3").effective == 1.0  # starts at min_pct (10 %) of capacity
    assert _target_after(feed, 300) == 1.0  # 0.3 s / 5 s = 6 % < 10 % floor


def test_slow_start_aggression_two_is_a_square_root() -> None:
    feed = _slow_start_pool(with_changes(IDLE_UNKNOWN, {"slow_start_aggression": 2.0}))
    assert _target_after(feed, 1_250) == 5.0  # (1.25/5)^(1/2) = 0.5
    feed = _slow_start_pool(with_changes(IDLE_UNKNOWN, {"slow_start_aggression": 2.0,
                                                        "slow_start_window_ms": 60_000}))
    # Envoy's own test: 6 s into a 60 s window with aggression 2 -> sqrt(0.1) ≈ 0.316
    assert _target_after(feed, 6_000) == round(10 * math.sqrt(0.1), 3)


def test_slow_start_ends_active_after_the_window() -> None:
    feed = _slow_start_pool()
    changes = []
    for _ in range(50):
        changes += phase_changes(feed.tick())
    assert changes == [("n3", "recovering", "active", "slow start window elapsed")]
    assert feed.node("n3").target == 10.0


def test_a_cold_pool_starts_active_without_slow_start() -> None:
    feed = Feed()
    for name in ("n1", "n2", "n3"):
        assert _transitions(feed.register(name, dt_ms=100)) == [("new", "active")]


# -- outlier ejection -----------------------------------------------------------------------


def test_consecutive_upstream_errors_eject() -> None:
    feed = warm_pool("n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10")
    assert _errors(feed, "n1", 4) == []
    rid = feed.start("n1")
    feed.finish("n1", rid)  # a success resets the run
    assert _errors(feed, "n1", 4) == []
    assert _errors(feed, "n1", 1) == [("n1", "active", "ejected", "5 consecutive upstream errors; ejected for 30 s")]
    assert feed.view("n1")["routable"] is False


def test_other_outcomes_neither_count_nor_reset() -> None:
    feed = warm_pool(*[f"n{i}" for i in range(10)])
    _errors(feed, "n1", 3)
    rid = feed.start("n1")
    feed.finish("n1", rid, "client_cancelled")
    assert _errors(feed, "n1", 2)[0][2] == "ejected"


def _eject_and_wait(feed: Feed) -> str:
    reason = _errors(feed, "n1", 5)[0][3]
    while feed.phase("n1") == "ejected":
        feed.tick(period_ms=1000)
    return reason


def test_ejection_time_grows_with_repeated_ejections_and_is_capped() -> None:
    config = with_changes(SchedulerConfig(), {"max_ejection_ms": 100_000, "backoff_decay_ms": 1_000_000})
    feed = warm_pool(*[f"n{i}" for i in range(1, 11)], config=config)
    reasons = [_eject_and_wait(feed) for _ in range(6)]
    assert [r.split("ejected for ")[1] for r in reasons] == ["30 s", "60 s", "90 s", "100 s", "100 s", "100 s"]
    # Envoy bumps the multiplier while base·k < max + base: 30·4 = 120 < 130 -> 5, then stops
    assert feed.node("n1").ejections == 5


def test_ejection_backoff_decays_while_healthy() -> None:
    feed = warm_pool(*[f"n{i}" for i in range(1, 11)])
    _eject_and_wait(feed)
    _eject_and_wait(feed)
    assert feed.node("n1").ejections == 2
    feed.ticks_until(10_000, period_ms=1000)
    assert feed.node("n1").ejections == 1
    feed.ticks_until(10_000, period_ms=1000)
    assert feed.node("n1").ejections == 0
    assert _eject_and_wait(feed).endswith("ejected for 30 s")


def test_max_ejected_rail_keeps_a_second_node_in_a_four_node_pool() -> None:
    feed = warm_pool("n1", "n2", "n3", "n4")  # 10 % of 4 -> 0, but one ejection is always allowed
    assert _errors(feed, "n1", 5)[0][2] == "ejected"
    assert _errors(feed, "n2", 5) == []
    assert feed.phase("n2") == "active"
    assert feed.node("n2").consecutive_failures == 5  # detected, not enforced


def test_panic_rail_routes_to_ejected_nodes_when_too_few_are_healthy() -> None:
    feed = warm_pool("n1", "n2", "n3", "n4")
    feed.npu("n1", "Critical")
    assert feed.snap()["panic"] is False
    feed.npu("n2", "Critical")
    assert feed.snap()["panic"] is False  # 2 of 4 routable: not below 50 %
    out = feed.npu("n3", "Critical")
    snapshot = [o for o in out if o.subject == sj.out_snapshot("default")]
    assert snapshot, "entering panic is published at once"
    snap = msgspec.json.decode(snapshot[-1].data)
    assert snap["panic"] is True
    views = {n["node"]: n for n in snap["nodes"]}
    assert all(views[n]["routable"] and views[n]["effective_weight"] > 0 for n in ("n1", "n2", "n3", "n4")), views
    feed.npu("n1", "OK")
    assert feed.snap()["panic"] is False
    assert feed.view("n2")["routable"] is False and feed.view("n2")["effective_weight"] == 0.0


# -- NPU health and probes ------------------------------------------------------------------


def test_npu_critical_ejects_and_ok_recovers() -> None:
    feed = warm_pool("n1", "n2", "n3")
    assert phase_changes(feed.npu("n1", "Critical")) == [("n1", "active", "ejected", "npu health Critical")]
    assert phase_changes(feed.npu("n1", "Critical")) == []
    assert phase_changes(feed.npu("n1", "OK")) == [("n1", "ejected", "recovering", "npu health back to OK")]


def test_npu_worst_chip_counts() -> None:
    feed = warm_pool("n1", "n2", "n3")
    feed.send(sj.metrics_npu("n1"), {"chips": [{"npu_id": 0, "chip_id": 0, "health": "OK"},
                                               {"npu_id": 0, "chip_id": 1, "health": "Critical"}]})
    assert feed.phase("n1") == "ejected"


def test_npu_unrecognised_health_is_treated_as_absent() -> None:
    feed = warm_pool("n1", "n2", "n3")
    assert phase_changes(feed.npu("n1", "NOT_SUPPORT")) == [("n1", "active", "ejected", "npu health UNKNOWN")]


def test_npu_alarm_drains_and_ok_returns() -> None:
    feed = warm_pool("n1", "n2", "n3")
    rid = feed.start("n1")
    assert phase_changes(feed.npu("n1", "Alarm")) == [("n1", "active", "draining", "npu health Alarm")]
    feed.finish("n1", rid)
    assert feed.phase("n1") == "drained"
    assert phase_changes(feed.npu("n1", "OK")) == [("n1", "drained", "recovering", "npu health back to OK")]


def test_npu_warning_lowers_the_weight_but_keeps_routing() -> None:
    feed = warm_pool("n1", "n2")
    feed.npu("n1", "Warning")
    feed.npu("n2", "OK")
    feed.tick()
    assert feed.phase("n1") == "active"
    assert feed.view("n1")["health"] == 0.7
    assert feed.node("n1").target < feed.node("n2").target


def test_failed_probes_eject_and_a_passing_probe_recovers() -> None:
    feed = warm_pool("n1", "n2", "n3")
    feed.probe("n1", False)
    feed.probe("n1", False)
    feed.probe("n1", True)  # the run is broken
    feed.probe("n1", False)
    feed.probe("n1", False)
    assert feed.phase("n1") == "active"
    assert phase_changes(feed.probe("n1", False, "connection refused")) == [
        ("n1", "active", "ejected", "3 failed health probes: connection refused")]
    assert phase_changes(feed.probe("n1", True)) == [("n1", "ejected", "recovering", "health probe passed")]


# -- phantom in-flight (docs/algorithm.md §4) --------------------------------------------------------


def test_a_silent_proxy_has_its_requests_expired_after_the_timeout() -> None:
    feed = warm_pool("n1", "n2")
    feed.start("n1", proxy="dead")
    live = feed.start("n1", proxy="alive")
    feed.drain("n1")
    changes = []
    for _ in range(20):  # 20 s of ticks; the live proxy keeps heartbeating
        feed.heartbeat("alive")
        changes += phase_changes(feed.tick(period_ms=1000))
    assert changes == [] and feed.node("n1").inflight == 1  # the live request holds the drain
    assert "dead" not in feed.scheduler.state.proxies
    assert phase_changes(feed.finish("n1", live, proxy="alive")) == [
        ("n1", "draining", "drained", "in-flight reached 0")]


def test_expiry_happens_only_after_proxy_timeout() -> None:
    feed = warm_pool("n1", "n2")
    feed.start("n1", proxy="dead")
    feed.drain("n1")
    changes: list[tuple[str, str, str, str]] = []
    elapsed = 0
    while not changes:
        changes = phase_changes(feed.tick(period_ms=1000))
        elapsed += 1000
    assert elapsed == 16_000  # first tick strictly after proxy_timeout_ms = 15 s
    assert changes == [("n1", "draining", "drained", "in-flight reached 0")]


def test_proxy_stopped_expires_its_requests_at_once() -> None:
    feed = warm_pool("n1", "n2")
    rid = feed.start("n1", proxy="p9")
    feed.start("n2", proxy="p9")
    feed.drain("n1")
    out = feed.send(sj.proxy_stopped("p9"), {})
    assert phase_changes(out) == [("n1", "draining", "drained", "in-flight reached 0")]
    assert feed.node("n2").inflight == 0
    assert "unknown request_id" in rejections(feed.finish("n1", rid, proxy="p9"))[0]


def test_duplicate_and_unknown_request_ids_are_rejected() -> None:
    feed = warm_pool("n1")
    feed.start("n1", request_id="r1")
    assert "duplicate request_id 'r1'" in rejections(feed.send(sj.req_started("n1"),
                                                              {"request_id": "r1", "proxy": "p1"}))[0]
    assert feed.node("n1").inflight == 1
    assert "unknown request_id 'zz'" in rejections(feed.finish("n1", "zz"))[0]


def test_forgotten_node_does_not_leak_inflight_into_a_new_registration() -> None:
    feed = warm_pool("n1", "n2", config=with_changes(SchedulerConfig(), {"drain_deadline_ms": 1_000}))
    rid = feed.start("n1")
    feed.remove("n1")
    feed.ticks_until(1_000)  # deadline: drained with 1 in flight, then forgotten
    assert "n1" not in feed.scheduler.state.nodes
    feed.register("n1")
    feed.finish("n1", rid)
    assert feed.node("n1").inflight == 0


def test_time_only_moves_forward() -> None:
    feed = warm_pool("n1")
    now = feed.scheduler.state.now_ns
    feed.send(sj.CLOCK_TICK, {"tick": 999}, dt_ms=-5_000)  # an out-of-order producer clock
    assert feed.scheduler.state.now_ns == now
    assert feed.scheduler.state.tick == 999
