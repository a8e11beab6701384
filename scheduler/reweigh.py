"""From a node's observed state to its signals, target and effective weight (one pool at a time).

``scheduler.weights`` holds the formulas (signals, dead band, target, easing, slow start); this
module applies them to the core's ``NodeState``s: it folds samples into the per-node beliefs
(latency EWMA, believed slots), builds each node's ``Signals`` and ``LoadView``, and reweighs a
pool. The core (``scheduler.core``) decides phases and calls ``reweigh_pool`` when a phase change
or a tick asks for new targets; nothing here changes a phase.

Reweighing one pool, in order:
  1. best = the lowest TTFT EWMA among the routable members (the latency signal's reference);
  2. per member: its believed slots (weights.believed_slots; held at the evidence while its
     latency signal is above ``slots_hold_latency``), its signals and load view, its health
     factor; a member that is not routable gets target = effective = 0;
  3. the routable members' loads move ``load_deadband`` toward their mean (weights.shrink_loads);
  4. target = weights.target_weight(slots, health, load), times the slow-start factor while
     recovering; effective eases one step toward it (on a tick; ``ease=False`` after a phase
     change, which re-targets without easing).
Same rules as the core: pure, no clock or IO; members are visited in the order given.
"""

from __future__ import annotations

from laswrr.scheduler import weights
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.phases import ROUTABLE, Phase
from laswrr.scheduler.state import NodeState
from laswrr.scheduler.weights import MS, Signals, round_milli
from laswrr.schemas.outputs import LoadView
from laswrr.schemas.words import NpuHealth


def routable(node: NodeState, panic: bool) -> bool:
    """Whether proxies may send ``node`` traffic: capacity above 0 and a routable phase, or
    ejected while its pool is in panic."""
    if node.capacity <= 0:
        return False
    return node.phase in ROUTABLE or (panic and node.phase == Phase.EJECTED)


def in_panic(members: list[NodeState], config: SchedulerConfig) -> bool:
    """Envoy's panic rail: too few routable nodes -> ejected ones take traffic again."""
    considered = [n for n in members if n.capacity > 0 and n.phase not in (Phase.DRAINING, Phase.DRAINED)]
    routable_count = sum(1 for n in considered if n.phase in ROUTABLE)
    return bool(considered) and routable_count < config.panic_threshold * len(considered)


# -- beliefs folded from samples ---------------------------------------------------------------


def observe_slots(node: NodeState, running: int, waiting: int, now_ns: int, config: SchedulerConfig) -> None:
    """Queue evidence of a silent capacity loss (weights.believed_slots): a queue beside free
    slots, ``slots_evidence`` samples in a row, sets the belief to the running count; running
    above the belief without a queue raises it to that count."""
    if waiting > 0 and running < node.capacity:
        node.queue_evidence += 1
        if node.queue_evidence >= config.slots_evidence:
            node.slots_seen, node.slots_seen_ns = max(running, 1), now_ns
        return
    node.queue_evidence = 0
    believed = weights.believed_slots(node.capacity, node.slots_seen, node.slots_seen_ns, now_ns, config)
    if believed is not None and running > believed:
        node.slots_seen, node.slots_seen_ns = running, now_ns


def observe_free_slots(node: NodeState, running: int, free_slots: int, now_ns: int) -> None:
    """The engine said how many slots it has free (MindIE ``availSlotsNum``): it runs ``running +
    free_slots`` slots, believed at once, with no queue evidence to wait for. Fewer than the capacity
    is a silent loss (the belief, confirmed by every such sample, regains as in
    ``weights.believed_slots`` only once samples stop); as many or more ends any belief."""
    engine_slots = running + free_slots
    node.queue_evidence = 0
    if engine_slots < node.capacity:
        node.slots_seen, node.slots_seen_ns = max(engine_slots, 1), now_ns
    else:
        node.slots_seen = None


def block_usage(free_blocks: int | None, total_blocks: int | None) -> float | None:
    """KV use from the engine's own block counts (1 - free / total); None without a total."""
    if free_blocks is None or not total_blocks:
        return None
    return round_milli(min(1.0, max(0.0, 1.0 - free_blocks / total_blocks)))


def observe_latency(node: NodeState, ttft_ms: float, config: SchedulerConfig) -> None:
    """Fold one TTFT into the node's EWMA (``latency_alpha``); the first one sets it."""
    alpha = config.latency_alpha
    previous = node.ttft_ewma
    node.ttft_ewma = round_milli(ttft_ms if previous is None else previous + alpha * (ttft_ms - previous))


# -- signals -------------------------------------------------------------------------------------


def health_factor(node: NodeState, config: SchedulerConfig) -> float:
    """1 when healthy, ``warning_health`` on an NPU Warning, 0 on failed probes or worse NPU health."""
    if node.probe_failures >= config.health_fail_threshold:
        return 0.0
    if node.npu_health in (None, NpuHealth.OK):
        return 1.0
    return config.warning_health if node.npu_health == NpuHealth.WARNING else 0.0


def token_mean(members: list[NodeState]) -> float | None:
    """Mean tokens (prompt + max_tokens) of the pool's sized requests in flight; None without any."""
    sized = sum(n.sized_inflight for n in members)
    return sum(n.inflight_tokens for n in members) / sized if sized else None


def occupancy(node: NodeState, mean_tokens: float | None) -> float:
    """The node's requests in flight, each sized one counted as its tokens over the pool's mean:
    one 100k-token prompt beside 100-token ones weighs what it holds, not one request. Without
    sized requests (events that carry no estimate) it is exactly the in-flight count."""
    if not node.sized_inflight or not mean_tokens:
        return node.inflight
    return node.inflight - node.sized_inflight + node.inflight_tokens / mean_tokens


def node_signals(node: NodeState, latency: float, slots: float | None, now_ns: int,
                 config: SchedulerConfig, mean_tokens: float | None = None) -> Signals:
    """The node's signals at ``now_ns``: occupancy (``occupancy``) against its believed slots (or
    its capacity), engine and NPU samples aged by their own sample times."""
    age = None if node.engine_ns is None else now_ns - node.engine_ns
    stale = weights.staleness(age, config, node.engine_max_age_ms)
    sampled = None if node.running is None else node.running + (node.waiting or 0)
    capacity = node.capacity if slots is None else max(1, round(slots))
    queue, running = weights.occupancy_signals(capacity, sampled, stale, occupancy(node, mean_tokens),
                                               config.unknown_load,
                                               node.waiting or 0)
    npu_stale = weights.staleness(None if node.npu_ns is None else now_ns - node.npu_ns, config, node.npu_max_age_ms)
    return Signals(
        queue=queue, running=running,
        kv=weights.blend(node.kv, stale, config.unknown_load),
        npu=weights.blend(node.npu_util, npu_stale, config.unknown_load),
        latency=latency,
        staleness=stale, sample_age_ms=None if age is None else age // MS,
    )


def load_view(signals: Signals | None, config: SchedulerConfig, slots: float | None = None,
              free: tuple[int | None, int | None] = (None, None)) -> LoadView:
    """The rounded signals a snapshot shows; ``None`` (never reweighed) shows as stale zeros."""
    if signals is None:
        return LoadView(queue=0.0, running=0.0, kv=0.0, npu=0.0, latency=0.0, load=0.0,
                        sample_age_ms=None, stale=True)
    return LoadView(queue=round_milli(signals.queue), running=round_milli(signals.running),
                    kv=round_milli(signals.kv), npu=round_milli(signals.npu),
                    latency=round_milli(signals.latency), load=round_milli(signals.load(config)),
                    sample_age_ms=signals.sample_age_ms, stale=signals.staleness >= 1.0, slots=slots,
                    free_slots=free[0], free_blocks=free[1])


# -- one pool ------------------------------------------------------------------------------------


def reweigh_pool(members: list[NodeState], now_ns: int, config: SchedulerConfig, ease: bool = True) -> None:
    """Recompute the members' targets from their signals; with ``ease`` also move each effective
    weight one easing step toward its target (see the module header for the steps)."""
    panic = in_panic(members, config)
    latencies = [n.ttft_ewma for n in members if n.ttft_ewma is not None and n.phase in ROUTABLE]
    best = min(latencies) if latencies else None
    mean_tokens = token_mean(members)
    routed: list[tuple[NodeState, float, float]] = []  # (node, believed slots, load)
    for node in members:
        latency = weights.latency_signal(node.ttft_ewma, best)
        slots = weights.believed_slots(node.capacity, node.slots_seen, node.slots_seen_ns, now_ns, config)
        if slots is None:
            node.slots_seen = None
        elif latency > config.slots_hold_latency:
            node.slots_seen_ns = now_ns  # still slow: the evidence holds
            slots = float(node.slots_seen or 0)
        signals = node_signals(node, latency, slots, now_ns, config, mean_tokens)
        node.load = load_view(signals, config, slots, (node.free_slots, node.free_blocks))
        node.health = health_factor(node, config)
        if not routable(node, panic):
            node.target = node.effective = 0.0
            continue
        routed.append((node, node.capacity if slots is None else slots, signals.load(config)))
    loads = weights.shrink_loads([load for _, _, load in routed], config.load_deadband)
    for (node, slots, _), load in zip(routed, loads):
        # In panic an ejected node is routed to regardless of its health (Envoy's panic mode).
        health = 1.0 if node.phase == Phase.EJECTED else node.health
        target = weights.target_weight(slots, health, load, config)
        if node.phase == Phase.RECOVERING:
            factor = weights.slow_start_factor(now_ns - node.slow_start_since_ns, node.slow_start_floor, config)
            target = round_milli(target * factor)
        node.target = target
        if node.phase == Phase.EJECTED and node.effective <= 0:
            node.effective = target  # routable only through the panic rail: spread at once
        elif ease:
            node.effective = weights.ease(node.effective, target, node.max_capacity, config)
