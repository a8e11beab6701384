"""Load -> target weight, easing, and slow start: the arithmetic of LA-SWRR.

Signals, each normalised to 0..1 (docs/algorithm.md §1):
  queue    = waiting / (waiting + capacity)      waiting beyond the decode slots
  running  = min(running, capacity) / capacity   slot occupancy
  kv       = KV-cache use reported by the engine
  npu      = mean AICore (or NPU) utilisation of the node's chips
  latency  = 1 - best_ewma / own_ewma            TTFT EWMA against the pool's fastest node
Occupancy is dead-reckoned: each of queue and running is the larger of the engine's sampled
value and the value the in-flight count (from request events) implies, so a burst admitted since
the last scrape already counts. Sampled signals (queue, running, kv from the engine; npu from
npu-smi, each aged by its own sample time) decay toward ``unknown_load`` between
``stale_after_ms`` and ``stale_full_ms``; a node never sampled counts as unknown. A node whose
samples stopped is therefore not mistaken for an idle one.

  load   = Σ w_k·signal_k / Σ w_k
  load'  = mean + sign(d)·max(0, |d| - load_deadband),  d = load - mean   (mean over the pool's
           routable nodes): differences within the dead band are noise, not a reason to move weight
  target = clamp(slots · health · (1 - max_load_cut·load'), floor_fraction·slots, slots)

``slots`` is the registered capacity, unless the engine showed a queue while running fewer
requests than that (``slots_evidence`` samples in a row): then it runs only that many slots (a
silent capacity loss), and the belief climbs back linearly to the capacity over
``slots_regain_ms`` unless a new sample confirms it (AIMD: cut at once to the evidence, probe back
slowly; a node kept light by its low weight shows no queue, so only time can restore it). While
the node's latency signal stays above ``slots_hold_latency`` the climb waits at the evidence.

Easing, once per tick (time-driven, unlike nginx's traffic-driven +1 per pass):
  eff ← eff + clip(ease_alpha·(target - eff), -step, +step),  step = ease_max_step·max_capacity
  snapped to target inside the dead band. Worked example (defaults, max capacity 10, target 1):
  10 → 7.5 → 5 → 3 → 2 → 1.5 → 1.25 → 1.125 → ... → 1.007 → 1 (12 ticks): the step cap binds
  while far away, then the gap halves each tick; a ramp, never a cliff.

Slow start (Envoy): factor = max(min_pct, (t / window)^(1/aggression)); 2.5 s into a 5 s window
with aggression 1 → 0.5. Values are rounded to 1e-3 so snapshots are short and exact.
"""

from __future__ import annotations

import functools
import math

from laswrr.scheduler.config import SchedulerConfig

MS = 1_000_000
MILLI = 3  # digits every weight and signal is rounded to


_WHOLE = 6_755_399_441_055_744.0  # 1.5 x 2^52: (x + _WHOLE) - _WHOLE is x rounded to a whole number, |x| < 2^51


def round_milli(value: float) -> float:
    """``round(value, 3)``: the same float (or int) for every input, at about two thirds of its cost.

    ``round(x, 3)`` writes x's exact binary value out to 3 decimals and reads that back (about
    2,700 instructions; the core rounds every signal of every node on every tick). For a float
    with ``|x·1000| < 1e12`` the product ``s = x * 1000.0`` is within 1e-4 of the exact ``x·1000``,
    so when ``s`` is not within 0.0002 of a half, the whole number ``k`` nearest to ``s`` is also
    nearest to ``x·1000``: round writes ``k`` thousandths and reads back the float nearest to
    ``k / 1000``, which is what the division ``k / 1000.0`` gives (a zero keeps x's sign, as round's
    does). Anything else (near a half, an int, nan, inf, huge) goes to ``round`` itself.
    tests/scheduler/test_round_milli.py compares the two bit for bit."""
    if type(value) is float:
        scaled = value * 1000.0
        if -1e12 < scaled < 1e12:
            whole = scaled + _WHOLE - _WHOLE
            if -0.4998 < scaled - whole < 0.4998:
                return whole / 1000.0 if whole else value * 0.0
    return round(value, MILLI)


def combined_load(queue: float, running: float, kv: float, npu: float, latency: float,
                  config: SchedulerConfig) -> float:
    """load = Σ w_k·signal_k / Σ w_k (the module header)."""
    weights = (config.w_queue, config.w_running, config.w_kv, config.w_npu, config.w_latency)
    return sum((weights[0] * queue, weights[1] * running, weights[2] * kv, weights[3] * npu,
                weights[4] * latency)) / sum(weights)


def staleness(age_ns: int | None, config: SchedulerConfig, max_age_ms: int | None = None) -> float:
    """0 while fresh, rising linearly to 1 between stale_after_ms and stale_full_ms. A sample whose
    source says how long it stands for (``max_age_ms``, its own refresh) is fresh until the larger
    of that and stale_after_ms, then ages over the same span (stale_full_ms - stale_after_ms)."""
    if age_ns is None:
        return 1.0
    after = fresh_ns(config, max_age_ms)
    if age_ns <= after:
        return 0.0
    span = (config.stale_full_ms - config.stale_after_ms) * MS
    if age_ns >= after + span or span == 0:
        return 1.0
    return (age_ns - after) / span


def fresh_ns(config: SchedulerConfig, max_age_ms: int | None = None) -> int:
    """The age up to which a sample is fresh (``staleness`` 0): stale_after_ms, or the sample's
    own ``max_age_ms`` when larger. Its staleness then rises over stale_full_ms - stale_after_ms."""
    after_ms = config.stale_after_ms
    if max_age_ms is not None and max_age_ms > after_ms:
        after_ms = max_age_ms
    return after_ms * MS


def blend(value: float | None, stale: float, unknown: float) -> float:
    if value is None:
        return unknown
    return (1.0 - stale) * value + stale * unknown


def split_occupancy(capacity: int, occupancy: float) -> tuple[float, float]:
    """(queue, running) of ``occupancy`` requests on ``capacity`` decode slots."""
    running = min(occupancy, capacity)
    waiting = occupancy - running
    return waiting / (waiting + capacity), running / capacity


def occupancy_signals(capacity: int, sampled: int | None, stale: float, inflight: float,
                      unknown: float, sampled_waiting: int = 0) -> tuple[float, float]:
    """(queue, running): the engine's sampled occupancy aged toward ``unknown``, but never below
    what the in-flight count (dead reckoning from request events, never stale) already shows.

    An engine that reports a waiting queue is full at its *real* slot count, whatever the
    registered capacity says: a silent slowdown (slots lost without an announcement) shows up as
    running 2, waiting 3 on a node registered with 10. Its queue is then measured against the
    slots it actually runs and its running signal is saturated."""
    if capacity <= 0:
        return 1.0, 1.0
    queue_i, running_i = split_occupancy(capacity, inflight)
    if sampled is None:
        queue_s = running_s = unknown
    else:
        queue_s, running_s = split_occupancy(capacity, sampled)
        if sampled_waiting > 0:
            slots = max(sampled - sampled_waiting, 1)
            queue_s, running_s = max(queue_s, sampled_waiting / (sampled_waiting + slots)), 1.0
        queue_s, running_s = blend(queue_s, stale, unknown), blend(running_s, stale, unknown)
    return max(queue_s, queue_i), max(running_s, running_i)


def latency_signal(own_ewma: float | None, best_ewma: float | None) -> float:
    if own_ewma is None or best_ewma is None or own_ewma <= 0:
        return 0.0
    return max(0.0, 1.0 - best_ewma / own_ewma)


def shrink_loads(loads: list[float], band: float) -> list[float]:
    """Each load moved ``band`` toward the mean of ``loads`` (never past it)."""
    if band <= 0 or len(loads) < 2:
        return loads
    mean = sum(loads) / len(loads)
    return [mean + math.copysign(max(0.0, abs(load - mean) - band), load - mean) for load in loads]


def believed_slots(capacity: int, seen: int | None, seen_ns: int, now_ns: int, config: SchedulerConfig) -> float | None:
    """The slots a node is believed to run after its engine showed only ``seen`` with a queue at
    ``seen_ns``: ``seen`` climbing back to ``capacity`` over ``slots_regain_ms``; None once there."""
    if seen is None or seen >= capacity:
        return None
    regain = config.slots_regain_ms * MS
    if regain <= 0:
        return None
    believed = seen + capacity * max(0, now_ns - seen_ns) / regain
    return None if believed >= capacity else round_milli(believed)


def target_weight(capacity: float, health: float, load: float, config: SchedulerConfig) -> float:
    if capacity <= 0 or health <= 0:
        return 0.0
    raw = capacity * health * (1.0 - config.max_load_cut * min(max(load, 0.0), 1.0))
    return round_milli(min(float(capacity), max(config.floor_fraction * capacity, raw)))


def ease(effective: float, target: float, max_capacity: int, config: SchedulerConfig) -> float:
    delta = target - effective
    if abs(delta) <= config.ease_deadband:
        return target
    step_cap = config.ease_max_step * max(max_capacity, 1)
    step = max(-step_cap, min(step_cap, config.ease_alpha * delta))
    return round_milli(max(0.0, effective + step))


def slow_start_factor(elapsed_ns: int, floor: float, config: SchedulerConfig) -> float:
    """Envoy: max(min_pct, (max(t, 1 ms) / window)^(1/aggression)), here with a floor >= min_pct."""
    window = config.slow_start_window_ms * MS
    if window <= 0:
        return 1.0
    time_factor = min(1.0, max(elapsed_ns, MS) / window)
    if config.slow_start_aggression != 1.0 and time_factor < 1.0:
        time_factor = time_factor ** (1.0 / config.slow_start_aggression)
    return max(config.slow_start_min_pct, floor, time_factor)


@functools.lru_cache(maxsize=1024)  # a pure function of two numbers, asked for every node on every snapshot
def concurrency_limit(slots: float, factor: float) -> int:
    """A node's slot limit for flow control (``NodeView.concurrency_limit``; the rule is in
    ``scheduler.routing.flow``'s docstring): ``max(1, ceil(factor x slots))``; 0 (no limit) when
    ``factor`` is 0 or the node has no slots."""
    if factor <= 0 or slots <= 0:
        return 0
    return max(1, math.ceil(round(factor * slots, 9)))
