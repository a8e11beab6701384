"""From a node's observed state to its signals, target and effective weight (one pool at a time).

``scheduler.weights`` holds the formulas (signals, dead band, target, easing, slow start); this
module applies them to the core's ``NodeState``s: it folds samples into the per-node beliefs
(latency EWMA, believed slots), and reweighs a pool: each node's signals, its ``LoadView``, health
factor, target and effective weight. The core (``scheduler.core``) decides phases and calls ``reweigh_pool`` when a phase change
or a tick asks for new targets; nothing here changes a phase.

Reweighing one pool, in order:
  1. best = the lowest TTFT EWMA among the routable members (the latency signal's reference);
  2. per member: its believed slots (weights.believed_slots; held at the evidence while its
     latency signal is above ``slots_hold_latency``), its signals (the engine's and the NPU's
     samples aged by their own times, weights.staleness and weights.blend; occupancy, each sized
     request counted as its tokens over the pool's mean, against the believed slots,
     weights.occupancy_signals; weights.latency_signal) and their load (weights.combined_load),
     rounded to 1e-3 in its load view, its health factor (1; ``warning_health`` on an NPU Warning;
     0 on failed probes or worse NPU health); a member that is not routable gets target =
     effective = 0;
  3. the routable members' loads move ``load_deadband`` toward their mean (weights.shrink_loads);
  4. target = weights.target_weight(slots, health, load), times the slow-start factor while
     recovering; effective eases one step toward it (on a tick; ``ease=False`` after a phase
     change, which re-targets without easing).
Same rules as the core: pure, no clock or IO; members are visited in the order given.
"""

from __future__ import annotations

from laswrr.scheduler import weights
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.phases import EJECTED, LEAVING, RECOVERING, ROUTABLE
from laswrr.scheduler.state import NodeState
from laswrr.scheduler.weights import MS, round_milli
from laswrr.schemas.outputs import LoadView
from laswrr.schemas.words import NpuHealth


def routable(node: NodeState, panic: bool) -> bool:
    """Whether proxies may send ``node`` traffic: capacity above 0 and a routable phase, or
    ejected while its pool is in panic."""
    if node.capacity <= 0:
        return False
    return node.phase in ROUTABLE or (panic and node.phase == EJECTED)


def in_panic(members: list[NodeState], config: SchedulerConfig) -> bool:
    """Envoy's panic rail: too few routable nodes -> ejected ones take traffic again."""
    considered = [n for n in members if n.capacity > 0 and n.phase not in LEAVING]
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


_HEALTHY, _WARNING = frozenset({None, NpuHealth.OK}), NpuHealth.WARNING  # module constants: see scheduler.phases


def token_mean(members: list[NodeState]) -> float | None:
    """Mean tokens (prompt + max_tokens) of the pool's sized requests in flight; None without any."""
    sized = sum(n.sized_inflight for n in members)
    return sum(n.inflight_tokens for n in members) / sized if sized else None


UNWEIGHED = LoadView(queue=0.0, running=0.0, kv=0.0, npu=0.0, latency=0.0, load=0.0, sample_age_ms=None, stale=True)
"""What a snapshot shows for a node never reweighed: stale zeros."""


# -- one pool ------------------------------------------------------------------------------------


def _staleness(age: int, max_age_ms: int | None, stale_after_ms: int, span: int) -> float:
    """``weights.staleness`` of a sample ``age`` ns old, ``span`` the ns from fresh to fully stale
    (the same arithmetic, so the same float)."""
    after_ms = max_age_ms if max_age_ms is not None and max_age_ms > stale_after_ms else stale_after_ms
    after = after_ms * MS
    if age <= after:
        return 0.0
    if age >= after + span or span == 0:
        return 1.0
    return (age - after) / span


def reweigh_pool(members: list[NodeState], now_ns: int, config: SchedulerConfig, ease: bool = True) -> None:
    """Recompute the members' targets from their signals; with ``ease`` also move each effective
    weight one easing step toward its target (see the module header for the steps).

    This runs for every node on every tick, so the formulas of ``scheduler.weights`` (and
    ``routable``) are written out here, each operation in the same order on the same types,
    ``min``/``max`` of two as the comparison they make (``max(a, b)`` is ``b if b > a else a``),
    and the configuration read once per pool (docs/evidence/code-choices.md has what it saves).
    tests/scheduler/test_reweigh_fused.py checks it, bit for bit, against those formulas composed
    call by call on random pools and configurations.
    """
    panic = in_panic(members, config)
    latencies = [n.ttft_ewma for n in members if n.ttft_ewma is not None and n.phase in ROUTABLE]
    best = min(latencies) if latencies else None
    mean_tokens = token_mean(members)
    unknown, hold, regain = config.unknown_load, config.slots_hold_latency, config.slots_regain_ms * MS
    stale_after_ms = config.stale_after_ms
    span = (config.stale_full_ms - stale_after_ms) * MS
    w_queue, w_running, w_kv, w_npu, w_latency = (config.w_queue, config.w_running, config.w_kv, config.w_npu,
                                                  config.w_latency)
    w_sum = sum((w_queue, w_running, w_kv, w_npu, w_latency))
    fail_threshold, warning_health = config.health_fail_threshold, config.warning_health
    routed: list[tuple[NodeState, float, float]] = []  # (node, believed slots, load)
    for node in members:
        own, capacity = node.ttft_ewma, node.capacity
        if own is None or best is None or own <= 0:  # weights.latency_signal
            latency = 0.0
        else:
            latency = 1.0 - best / own
            latency = latency if latency > 0.0 else 0.0
        seen = node.slots_seen  # weights.believed_slots
        slots: float | None = None
        if seen is not None and seen < capacity and regain > 0:
            elapsed = now_ns - node.slots_seen_ns
            believed = seen + capacity * (elapsed if elapsed > 0 else 0) / regain
            if believed < capacity:
                slots = round_milli(believed)
        if slots is None:
            node.slots_seen = None
        elif latency > hold:
            node.slots_seen_ns = now_ns  # still slow: the evidence holds
            slots = float(node.slots_seen or 0)
        # node_signals: the engine's sample aged by its own time (weights.staleness)
        engine_ns = node.engine_ns
        if engine_ns is None:
            age, stale = None, 1.0
        else:
            age = now_ns - engine_ns
            stale = _staleness(age, node.engine_max_age_ms, stale_after_ms, span)
        waiting = node.waiting or 0
        sampled = None if node.running is None else node.running + waiting
        if slots is not None:
            rounded = round(slots)
            capacity = rounded if rounded > 1 else 1
        sized = node.sized_inflight  # occupancy
        occupied = node.inflight if not sized or not mean_tokens else \
            node.inflight - sized + node.inflight_tokens / mean_tokens
        if capacity <= 0:  # weights.occupancy_signals
            queue, running = 1.0, 1.0
        else:
            busy = capacity if capacity < occupied else occupied
            over = occupied - busy
            queue, running = over / (over + capacity), busy / capacity
            if sampled is None:
                queue_s = running_s = unknown
            else:
                busy = capacity if capacity < sampled else sampled
                over = sampled - busy
                queue_s, running_s = over / (over + capacity), busy / capacity
                if waiting > 0:
                    slots_run = sampled - waiting
                    slots_run = 1 if 1 > slots_run else slots_run
                    queue_w = waiting / (waiting + slots_run)
                    queue_s, running_s = queue_w if queue_w > queue_s else queue_s, 1.0
                queue_s = (1.0 - stale) * queue_s + stale * unknown
                running_s = (1.0 - stale) * running_s + stale * unknown
            queue = queue if queue > queue_s else queue_s
            running = running if running > running_s else running_s
        npu_ns = node.npu_ns
        npu_stale = 1.0 if npu_ns is None else _staleness(now_ns - npu_ns, node.npu_max_age_ms, stale_after_ms, span)
        kv = unknown if node.kv is None else (1.0 - stale) * node.kv + stale * unknown
        npu = unknown if node.npu_util is None else (1.0 - npu_stale) * node.npu_util + npu_stale * unknown
        # weights.combined_load: sum() of floats adds them in order onto 0
        load = (0 + w_queue * queue + w_running * running + w_kv * kv + w_npu * npu + w_latency * latency) / w_sum
        node.load = LoadView(queue=round_milli(queue), running=round_milli(running), kv=round_milli(kv),
                             npu=round_milli(npu), latency=round_milli(latency), load=round_milli(load),
                             sample_age_ms=None if age is None else age // MS, stale=stale >= 1.0, slots=slots,
                             free_slots=node.free_slots, free_blocks=node.free_blocks)
        if node.probe_failures >= fail_threshold:  # health_factor
            node.health = 0.0
        else:
            npu_health = node.npu_health
            node.health = 1.0 if npu_health in _HEALTHY else warning_health if npu_health == _WARNING else 0.0
        phase = node.phase
        if node.capacity <= 0 or not (phase in ROUTABLE or (panic and phase == EJECTED)):  # routable
            node.target = node.effective = 0.0
            continue
        routed.append((node, node.capacity if slots is None else slots, load))
    loads = weights.shrink_loads([load for _, _, load in routed], config.load_deadband)
    max_cut, floor_fraction = config.max_load_cut, config.floor_fraction
    ease_deadband, ease_max_step, ease_alpha = config.ease_deadband, config.ease_max_step, config.ease_alpha
    for (node, slots, _), load in zip(routed, loads):
        # In panic an ejected node is routed to regardless of its health (Envoy's panic mode).
        phase = node.phase
        health = 1.0 if phase == EJECTED else node.health
        if slots <= 0 or health <= 0:  # weights.target_weight
            target = 0.0
        else:
            load = 0.0 if 0.0 > load else load
            raw = slots * health * (1.0 - max_cut * (1.0 if 1.0 < load else load))
            floor = floor_fraction * slots
            raw = raw if raw > floor else floor
            whole = float(slots)
            target = round_milli(raw if raw < whole else whole)
        if phase == RECOVERING:
            factor = weights.slow_start_factor(now_ns - node.slow_start_since_ns, node.slow_start_floor, config)
            target = round_milli(target * factor)
        node.target = target
        effective = node.effective
        if phase == EJECTED and effective <= 0:
            node.effective = target  # routable only through the panic rail: spread at once
        elif ease:  # weights.ease
            delta = target - effective
            if abs(delta) <= ease_deadband:
                node.effective = target
                continue
            max_capacity = node.max_capacity
            step_cap = ease_max_step * (1 if 1 > max_capacity else max_capacity)
            step = ease_alpha * delta
            step = step if step < step_cap else step_cap
            step = step if step > -step_cap else -step_cap
            eased = effective + step
            node.effective = round_milli(eased if eased > 0.0 else 0.0)
