"""``reweigh.reweigh_pool`` writes the formulas of ``scheduler.weights`` out in one loop (it runs for
every node on every tick): it must leave every node exactly as those formulas composed do.

The reference below is the composition the core used before (one call per formula). Both run on
copies of the same random pool and configuration; the nodes are compared as their msgpack bytes,
so a float that differs in its last bit, in the sign of a zero, or an int where a float was
(``1`` against ``1.0`` on the wire) fails.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.scheduler import weights
from laswrr.scheduler.config import SchedulerConfig, with_changes
from laswrr.scheduler.phases import EJECTED, RECOVERING, ROUTABLE
from laswrr.scheduler.reweigh import in_panic, reweigh_pool, routable, token_mean
from laswrr.scheduler.state import NodeState
from laswrr.schemas.outputs import LoadView
from laswrr.schemas.words import NpuHealth, Phase

MS = 1_000_000
NOW = 1_700_000_000_000_000_000


class Signals(NamedTuple):
    queue: float
    running: float
    kv: float
    npu: float
    latency: float
    load: float
    staleness: float
    sample_age_ms: int | None


def health_factor(node: NodeState, config: SchedulerConfig) -> float:
    if node.probe_failures >= config.health_fail_threshold:
        return 0.0
    if node.npu_health in (None, NpuHealth.OK):
        return 1.0
    return config.warning_health if node.npu_health == NpuHealth.WARNING else 0.0


def occupancy(node: NodeState, mean_tokens: float | None) -> float:
    if not node.sized_inflight or not mean_tokens:
        return node.inflight
    return node.inflight - node.sized_inflight + node.inflight_tokens / mean_tokens


def node_signals(node: NodeState, latency: float, slots: float | None, now_ns: int,
                 config: SchedulerConfig, mean_tokens: float | None) -> Signals:
    age = None if node.engine_ns is None else now_ns - node.engine_ns
    stale = weights.staleness(age, config, node.engine_max_age_ms)
    sampled = None if node.running is None else node.running + (node.waiting or 0)
    capacity = node.capacity if slots is None else max(1, round(slots))
    queue, running = weights.occupancy_signals(capacity, sampled, stale, occupancy(node, mean_tokens),
                                               config.unknown_load, node.waiting or 0)
    npu_stale = weights.staleness(None if node.npu_ns is None else now_ns - node.npu_ns, config, node.npu_max_age_ms)
    kv = weights.blend(node.kv, stale, config.unknown_load)
    npu = weights.blend(node.npu_util, npu_stale, config.unknown_load)
    return Signals(queue, running, kv, npu, latency, weights.combined_load(queue, running, kv, npu, latency, config),
                   stale, None if age is None else age // MS)


def load_view(signals: Signals, slots: float | None, free: tuple[int | None, int | None]) -> LoadView:
    r = weights.round_milli
    return LoadView(queue=r(signals.queue), running=r(signals.running), kv=r(signals.kv), npu=r(signals.npu),
                    latency=r(signals.latency), load=r(signals.load), sample_age_ms=signals.sample_age_ms,
                    stale=signals.staleness >= 1.0, slots=slots, free_slots=free[0], free_blocks=free[1])


def reference(members: list[NodeState], now_ns: int, config: SchedulerConfig, ease: bool) -> None:
    panic = in_panic(members, config)
    latencies = [n.ttft_ewma for n in members if n.ttft_ewma is not None and n.phase in ROUTABLE]
    best = min(latencies) if latencies else None
    mean_tokens = token_mean(members)
    routed: list[tuple[NodeState, float, float]] = []
    for node in members:
        latency = weights.latency_signal(node.ttft_ewma, best)
        slots = weights.believed_slots(node.capacity, node.slots_seen, node.slots_seen_ns, now_ns, config)
        if slots is None:
            node.slots_seen = None
        elif latency > config.slots_hold_latency:
            node.slots_seen_ns = now_ns
            slots = float(node.slots_seen or 0)
        signals = node_signals(node, latency, slots, now_ns, config, mean_tokens)
        node.load = load_view(signals, slots, (node.free_slots, node.free_blocks))
        node.health = health_factor(node, config)
        if not routable(node, panic):
            node.target = node.effective = 0.0
            continue
        routed.append((node, node.capacity if slots is None else slots, signals.load))
    loads = weights.shrink_loads([load for _, _, load in routed], config.load_deadband)
    for (node, slots, _), load in zip(routed, loads):
        health = 1.0 if node.phase == EJECTED else node.health
        target = weights.target_weight(slots, health, load, config)
        if node.phase == RECOVERING:
            factor = weights.slow_start_factor(now_ns - node.slow_start_since_ns, node.slow_start_floor, config)
            target = weights.round_milli(target * factor)
        node.target = target
        if node.phase == EJECTED and node.effective <= 0:
            node.effective = target
        elif ease:
            node.effective = weights.ease(node.effective, target, node.max_capacity, config)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


_share = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))
_ago_ns = st.one_of(st.integers(-5 * MS, 30_000 * MS), st.sampled_from([0, 3_000 * MS, 10_000 * MS]))


@st.composite
def _node(draw: st.DrawFn, index: int) -> NodeState:
    capacity = draw(st.integers(0, 40))
    inflight = draw(st.integers(0, 80))
    sized = draw(st.integers(0, inflight))
    return NodeState(
        node=f"n{index}", url="http://n", pool="p", chip="910B", capacity=capacity,
        max_capacity=capacity + draw(st.integers(0, 20)), registered_ns=0,
        phase=draw(st.sampled_from([Phase.ACTIVE, Phase.ACTIVE, Phase.RECOVERING, Phase.DRAINING, Phase.DRAINED,
                                    Phase.EJECTED])),
        slow_start_since_ns=NOW - draw(_ago_ns), slow_start_floor=draw(_share),
        target=draw(st.floats(0, 60)), effective=draw(st.one_of(st.just(0.0), st.floats(0, 60))),
        inflight=inflight, sized_inflight=sized, inflight_tokens=draw(st.integers(0, 10**6)) if sized else 0,
        running=draw(_maybe(st.integers(0, 60))), waiting=draw(_maybe(st.integers(0, 30))),
        kv=draw(_maybe(_share)), engine_ns=draw(_maybe(_ago_ns.map(lambda ago: NOW - ago))),
        engine_max_age_ms=draw(_maybe(st.integers(1, 20_000))),
        npu_util=draw(_maybe(_share)), npu_ns=draw(_maybe(_ago_ns.map(lambda ago: NOW - ago))),
        npu_max_age_ms=draw(_maybe(st.integers(1, 20_000))),
        npu_health=draw(_maybe(st.sampled_from(list(NpuHealth)))),
        ttft_ewma=draw(_maybe(st.one_of(st.just(0.0), st.floats(0, 10_000)))),
        probe_failures=draw(st.integers(0, 4)),
        slots_seen=draw(_maybe(st.integers(0, 45))), slots_seen_ns=NOW - draw(_ago_ns),
        free_slots=draw(_maybe(st.integers(0, 20))), free_blocks=draw(_maybe(st.integers(0, 5000))),
    )


_CONFIG_KEYS = {
    "w_queue": st.floats(0, 3), "w_running": st.floats(0, 3), "w_kv": st.floats(0, 3), "w_npu": st.floats(0, 3),
    "w_latency": st.floats(0, 3), "max_load_cut": _share, "floor_fraction": _share, "unknown_load": _share,
    "stale_after_ms": st.integers(0, 5_000), "warning_health": _share, "load_deadband": _share,
    "slots_regain_ms": st.integers(0, 20_000), "slots_hold_latency": _share, "ease_alpha": _share,
    "ease_max_step": st.floats(0.001, 1.0), "ease_deadband": st.floats(0, 2), "slow_start_window_ms": st.integers(0, 9_000),
    "slow_start_aggression": st.floats(0.1, 3), "slow_start_min_pct": _share, "health_fail_threshold": st.integers(1, 4),
    "panic_threshold": _share,
}


@st.composite
def _config(draw: st.DrawFn) -> SchedulerConfig:
    changes = {key: draw(value) for key, value in _CONFIG_KEYS.items() if draw(st.booleans())}
    changes["stale_full_ms"] = changes.get("stale_after_ms", 3_000) + draw(st.sampled_from([0, 1, 7_000, 20_000]))
    if sum(changes.get(k, 1.0) for k in ("w_queue", "w_running", "w_kv", "w_npu", "w_latency")) <= 0:
        changes["w_queue"] = 1.0
    return with_changes(SchedulerConfig(), changes)


@settings(max_examples=600, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(*[_node(i) for i in range(n)])), _config(), st.booleans())
def test_the_fused_reweigh_leaves_every_node_as_the_formulas_do(nodes: tuple[NodeState, ...],
                                                                 config: SchedulerConfig, ease: bool) -> None:
    expected, got = copy.deepcopy(list(nodes)), copy.deepcopy(list(nodes))
    reference(expected, NOW, config, ease)
    reweigh_pool(got, NOW, config, ease)
    assert [msgspec.msgpack.encode(n) for n in got] == [msgspec.msgpack.encode(n) for n in expected]


def test_a_config_built_with_ints_keeps_the_reference_types() -> None:
    """A configuration constructed in code is not converted: ints stay ints and reach the signals."""
    config = SchedulerConfig(unknown_load=1, w_queue=1, w_running=0, w_kv=0, w_npu=0, w_latency=0)  # type: ignore[arg-type]
    node = NodeState(node="n", url="u", pool="p", chip="c", capacity=4, max_capacity=4, registered_ns=0, inflight=2)
    expected, got = [copy.deepcopy(node)], [copy.deepcopy(node)]
    reference(expected, NOW, config, True)
    reweigh_pool(got, NOW, config, True)
    assert msgspec.msgpack.encode(got[0]) == msgspec.msgpack.encode(expected[0])
    assert got[0].load is not None and got[0].load.queue == 1 and isinstance(got[0].load.queue, int)
