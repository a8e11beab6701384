"""Scheduler configuration: every coefficient, step, window and threshold of the core.

The configuration is part of the event log: the scheduler service publishes the file it was
started with as an ``lb.admin.config`` event, and operators may change single keys the same way,
so a replay always runs with the configuration that was in force. Unknown keys are rejected
(a typo must not pass silently). Durations are in milliseconds of event time.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from laswrr.schemas.codec import SchemaError
from laswrr.schemas.words import RejectCause
from laswrr.schemas.events import MAX_INT
from laswrr.scheduler.upstreams import PatternError, check_pattern, upstream_patterns


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Load -> target weight. load = Σ w_k·signal_k / Σ w_k, each signal in 0..1.
    w_queue: float = 0.35
    w_running: float = 0.25
    w_kv: float = 0.15
    w_npu: float = 0.05
    w_latency: float = 0.20
    max_load_cut: float = 0.9  # a fully loaded node keeps (1 - max_load_cut) of its capacity
    floor_fraction: float = 0.05  # a routable node never drops below this share of its capacity
    unknown_load: float = 0.5  # what a missing or stale signal counts as (never "idle")
    stale_after_ms: int = 3_000  # samples older than this start decaying toward unknown_load
    stale_full_ms: int = 10_000  # ... and count as fully unknown at this age
    latency_alpha: float = 0.2  # EWMA factor for TTFT / end-to-end latency
    warning_health: float = 0.7  # health factor of an NPU reporting Warning
    # Differences of a node's load from its pool's mean smaller than this are noise: each load is
    # moved this much toward the mean before it sets the target (identical nodes then get identical
    # weights, and the proxies' exact in-flight counts settle the small imbalances).
    load_deadband: float = 0.05
    # An engine seen twice in a row (``slots_evidence`` samples) with a queue while running fewer
    # requests than its capacity runs only that many slots (a silent capacity loss); that belief
    # climbs back to the full capacity over ``slots_regain_ms`` unless the engine confirms it, and
    # is held at the evidence while the node's latency signal stays above ``slots_hold_latency``
    # (still answering that much slower than the pool's fastest node: it has not recovered).
    slots_evidence: int = 2
    slots_regain_ms: int = 10_000
    slots_hold_latency: float = 0.5
    # Easing of effective toward target, once per tick.
    ease_alpha: float = 0.5
    ease_max_step: float = 0.25  # per tick, as a fraction of the node's largest capacity
    ease_deadband: float = 0.01
    capacity_ramp_ratio: float = 1.5  # capacity raised by this factor or more -> slow start
    # Phases.
    drain_deadline_ms: int = 60_000
    slow_start_window_ms: int = 5_000
    slow_start_aggression: float = 1.0
    slow_start_min_pct: float = 0.1
    health_fail_threshold: int = 3  # consecutive failed probes -> ejected until a probe passes
    consecutive_failures: int = 5  # consecutive upstream errors -> outlier ejection
    base_ejection_ms: int = 30_000
    max_ejection_ms: int = 300_000
    max_ejection_percent: float = 10.0  # of a pool's nodes; at least one may always be ejected
    backoff_decay_ms: int = 10_000
    panic_threshold: float = 0.5  # fewer routable nodes than this share -> route to ejected too
    proxy_timeout_ms: int = 15_000  # a proxy silent this long has its open requests expired
    # Flow control's slot limit, published per node in snapshots (NodeView.concurrency_limit):
    # ceil(concurrency_limit_factor x believed slots), at least 1; 0 publishes no limit.
    concurrency_limit_factor: float = 1.0
    # Hosts an ``lb.admin.node`` URL may name: comma-separated host, host:port or CIDR patterns
    # (scheduler/upstreams.py); empty: any host. User info, a query or a fragment is refused
    # whatever the list says. A string, not a list, so ``lb.admin.config`` keeps its scalar values.
    allow_upstream: str = ""
    # The largest capacity ``lb.admin.capacity`` or ``lb.admin.node`` may announce (a sanity limit:
    # ``999999999999`` for ``8`` must not pull every request onto one node). 4096 is four times
    # the largest default batch of the engines laswrr serves (vLLM's max_num_seqs is 256, 1024 on
    # large GPUs; MindIE's maxBatchSize is typically 200-1000): a real engine fits, a typo with
    # three extra digits does not. Raise it for a bigger engine (docs/configuration.md).
    max_capacity: int = 4096


_DECODER = msgspec.json.Decoder(SchedulerConfig)
_FIELDS = set(SchedulerConfig.__struct_fields__)


def _invalid(message: str) -> SchemaError:
    return SchemaError(message, RejectCause.INVALID_CONFIG)


def with_changes(config: SchedulerConfig, changes: dict[str, Any]) -> SchedulerConfig:
    """A new configuration with ``changes`` applied; a bad key or value raises SchemaError."""
    unknown = sorted(set(changes) - _FIELDS)
    if unknown:
        raise _invalid(f"unknown configuration key(s): {', '.join(unknown)}")
    merged = msgspec.structs.asdict(config) | changes
    try:
        new = msgspec.convert(merged, SchedulerConfig)
    except msgspec.ValidationError as exc:
        raise _invalid(f"invalid configuration: {exc}") from None
    _check(new)
    return new


def _check(config: SchedulerConfig) -> None:
    for name in config.__struct_fields__:
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise _invalid(f"invalid configuration: {name}={value} must be finite")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise _invalid(f"invalid configuration: {name}={value} is out of range")
    weights = (config.w_queue, config.w_running, config.w_kv, config.w_npu, config.w_latency)
    if min(weights) < 0 or sum(weights) <= 0:
        raise _invalid("invalid configuration: load weights must be >= 0 with a positive sum")
    for name in ("max_load_cut", "floor_fraction", "load_deadband", "slots_hold_latency", "unknown_load",
                 "latency_alpha", "warning_health", "ease_alpha", "ease_max_step", "slow_start_min_pct",
                 "panic_threshold"):
        value = getattr(config, name)
        if not 0.0 <= value <= 1.0:
            raise _invalid(f"invalid configuration: {name}={value} must be within 0..1")
    if not 0.0 <= config.concurrency_limit_factor <= 100.0:
        raise _invalid(f"invalid configuration: concurrency_limit_factor={config.concurrency_limit_factor} "
                       "must be within 0..100")
    if config.slow_start_aggression <= 0:
        raise _invalid("invalid configuration: slow_start_aggression must be > 0")
    if config.stale_full_ms < config.stale_after_ms:
        raise _invalid("invalid configuration: stale_full_ms must be >= stale_after_ms")
    if config.ease_max_step <= 0:
        raise _invalid("invalid configuration: ease_max_step must be > 0")
    for name in ("stale_after_ms", "stale_full_ms", "drain_deadline_ms", "slow_start_window_ms",
                 "base_ejection_ms", "max_ejection_ms", "backoff_decay_ms", "proxy_timeout_ms",
                 "slots_regain_ms"):
        if getattr(config, name) < 0:
            raise _invalid(f"invalid configuration: {name}={getattr(config, name)} must be >= 0")
    for name in ("health_fail_threshold", "consecutive_failures", "slots_evidence", "max_capacity"):
        if getattr(config, name) < 1:
            raise _invalid(f"invalid configuration: {name}={getattr(config, name)} must be >= 1")
    if not 0.0 <= config.max_ejection_percent <= 100.0:
        raise _invalid(f"invalid configuration: max_ejection_percent={config.max_ejection_percent} "
                          "must be within 0..100")
    for pattern in upstream_patterns(config.allow_upstream):
        try:
            check_pattern(pattern)
        except PatternError as exc:
            raise _invalid(f"invalid configuration: allow_upstream: {exc}") from None
    if config.capacity_ramp_ratio <= 1.0:
        raise _invalid(f"invalid configuration: capacity_ramp_ratio={config.capacity_ramp_ratio} must be > 1")


def load_file(path: str) -> SchedulerConfig:
    """Read a TOML file of configuration keys (a ``[scheduler]`` table or top-level keys)."""
    import tomllib

    with open(path, "rb") as handle:
        raw = tomllib.load(handle)
    return with_changes(SchedulerConfig(), raw.get("scheduler", raw))


def encode(config: SchedulerConfig) -> bytes:
    return msgspec.json.encode(config)


def decode(data: bytes) -> SchedulerConfig:
    return _DECODER.decode(data)
