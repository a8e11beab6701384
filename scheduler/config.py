"""Scheduler configuration: every coefficient, step, window and threshold of the core.

The configuration is part of the event log: the scheduler service publishes the file it was
started with as an ``lb.admin.config`` event, and operators may change single keys the same way,
so a replay always runs with the configuration that was in force. Unknown keys are rejected
(a typo must not pass silently). Durations are in milliseconds of event time.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from laswrr.schemas.codec import SchemaError
from laswrr.schemas.words import RejectCause
from laswrr.schemas.events import MAX_INT
from laswrr.scheduler.upstreams import PatternError, check_pattern, upstream_patterns


def _key(description: str, unit: str = "") -> msgspec.Meta:
    """A key's text and unit, for the docs table (laswrr/docgen.py); no constraint: ``_check`` checks."""
    return msgspec.Meta(description=description, extra={"unit": unit} if unit else None)


# A key's unit is also its range (``_check``): a share is within 0..1, a duration >= 0, a count >= 1.
MS = "ms"  # every ``*_ms`` key: milliseconds of event time
SHARE = "share"  # 0..1
COUNTS = ("samples", "probes", "errors", "slots")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Load -> target weight. load = Σ w_k·signal_k / Σ w_k, each signal in 0..1.
    w_queue: Annotated[float, _key("weight of the queue signal in a node's load")] = 0.35
    w_running: Annotated[float, _key("weight of the running (busy slots) signal in a node's load")] = 0.25
    w_kv: Annotated[float, _key("weight of the KV-cache usage signal in a node's load")] = 0.15
    w_npu: Annotated[float, _key("weight of the NPU signal (utilisation, health) in a node's load")] = 0.05
    w_latency: Annotated[float, _key("weight of the latency signal in a node's load")] = 0.20
    max_load_cut: Annotated[float, _key("a fully loaded node keeps (1 - max_load_cut) of its capacity", SHARE)] = 0.9
    floor_fraction: Annotated[float, _key("a routable node never drops below this share of its capacity",
                                          SHARE)] = 0.05
    unknown_load: Annotated[float, _key("what a missing or stale signal counts as (never idle)", SHARE)] = 0.5
    stale_after_ms: Annotated[int, _key("samples older than this start decaying toward unknown_load", MS)] = 3_000
    stale_full_ms: Annotated[int, _key("... and count as fully unknown at this age", MS)] = 10_000
    latency_alpha: Annotated[float, _key("EWMA factor of TTFT and end-to-end latency", SHARE)] = 0.2
    warning_health: Annotated[float, _key("health factor of an NPU reporting Warning", SHARE)] = 0.7
    # Differences of a node's load from its pool's mean smaller than this are noise: each load is
    # moved this much toward the mean before it sets the target (identical nodes then get identical
    # weights, and the proxies' exact in-flight counts settle the small imbalances).
    load_deadband: Annotated[float, _key("differences of a node's load from its pool's mean below this are noise: "
                                         "each load moves this much toward the mean", SHARE)] = 0.05
    # An engine seen twice in a row (``slots_evidence`` samples) with a queue while running fewer
    # requests than its capacity runs only that many slots (a silent capacity loss); that belief
    # climbs back to the full capacity over ``slots_regain_ms`` unless the engine confirms it, and
    # is held at the evidence while the node's latency signal stays above ``slots_hold_latency``
    # (still answering that much slower than the pool's fastest node: it has not recovered).
    slots_evidence: Annotated[int, _key("samples in a row with a queue while running fewer requests than its "
                                        "capacity before an engine is believed to run only that many slots",
                                        "samples")] = 2
    slots_regain_ms: Annotated[int, _key("that belief climbs back to the full capacity over this, unless the "
                                         "engine confirms it", MS)] = 10_000
    slots_hold_latency: Annotated[float, _key("... and is held while the node's latency signal stays above this",
                                              SHARE)] = 0.5
    # Easing of effective toward target, once per tick.
    ease_alpha: Annotated[float, _key("easing of the effective weight toward the target, per tick", SHARE)] = 0.5
    ease_max_step: Annotated[float, _key("largest easing step per tick, as a share of the node's largest "
                                         "capacity", SHARE)] = 0.25
    ease_deadband: Annotated[float, _key("an effective weight this close to its target takes it", "weight")] = 0.01
    capacity_ramp_ratio: Annotated[float, _key("capacity raised by this factor or more: slow start", "ratio")] = 1.5
    # Phases.
    drain_deadline_ms: Annotated[int, _key("a draining node counts as drained this long after the drain at "
                                           "the latest, requests in flight or not", MS)] = 60_000
    slow_start_window_ms: Annotated[int, _key("slow start's length", MS)] = 5_000
    slow_start_aggression: Annotated[float, _key("slow start's curve, Envoy's aggression A: (t / window)^(1/A); 1: "
                                                "linear")] = 1.0
    slow_start_min_pct: Annotated[float, _key("slow start's first share of the node's weight", SHARE)] = 0.1
    health_fail_threshold: Annotated[int, _key("consecutive failed probes: ejected until a probe passes",
                                               "probes")] = 3
    consecutive_failures: Annotated[int, _key("consecutive upstream errors: outlier ejection", "errors")] = 5
    base_ejection_ms: Annotated[int, _key("an ejection lasts this x the node's ejection count", MS)] = 30_000
    max_ejection_ms: Annotated[int, _key("the longest ejection", MS)] = 300_000
    max_ejection_percent: Annotated[float, _key("of a pool's nodes; at least one may always be ejected",
                                                "percent")] = 10.0
    backoff_decay_ms: Annotated[int, _key("each such period out of ejection takes one off a node's ejection "
                                          "count", MS)] = 10_000
    panic_threshold: Annotated[float, _key("fewer routable nodes than this share: route to ejected ones too",
                                           SHARE)] = 0.5
    proxy_timeout_ms: Annotated[int, _key("a proxy silent this long has its open requests expired", MS)] = 15_000
    # Flow control's slot limit, published per node in snapshots (NodeView.concurrency_limit):
    # ceil(concurrency_limit_factor x believed slots), at least 1; 0 publishes no limit.
    concurrency_limit_factor: Annotated[float, _key("flow control's limit per node, published in snapshots: "
                                                    "ceil(F x believed slots), at least 1; 0: no limit",
                                                    "factor")] = 1.0
    # Hosts an ``lb.admin.node`` URL may name: comma-separated host, host:port or CIDR patterns
    # (scheduler/upstreams.py); empty: any host. User info, a query or a fragment is refused
    # whatever the list says. A string, not a list, so ``lb.admin.config`` keeps its scalar values.
    allow_upstream: Annotated[str, _key("hosts an lb.admin.node URL may name: comma-separated host, host:port or "
                                        "CIDR patterns; empty: any host")] = ""
    # The largest capacity ``lb.admin.capacity`` or ``lb.admin.node`` may announce (a sanity limit:
    # ``999999999999`` for ``8`` must not pull every request onto one node). 4096 is four times
    # the largest default batch of the engines laswrr serves (vLLM's max_num_seqs is 256, 1024 on
    # large GPUs; MindIE's maxBatchSize is typically 200-1000): a real engine fits, a typo with
    # three extra digits does not. Raise it for a bigger engine (docs/configuration.md).
    max_capacity: Annotated[int, _key("the largest capacity lb.admin.capacity or lb.admin.node may announce",
                                      "slots")] = 4096


def keys() -> list[tuple[str, Any, str, str]]:
    """(key, default, unit, description) of every key, in declaration order (the docs' table)."""
    out = []
    info = msgspec.inspect.type_info(SchedulerConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        meta = field.type
        assert isinstance(meta, msgspec.inspect.Metadata), f"{field.name}: declare it with _key(...)"
        out.append((field.name, field.default, (meta.extra or {}).get("unit", ""),
                    (meta.extra_json_schema or {})["description"]))
    return out


_DECODER = msgspec.json.Decoder(SchedulerConfig)
_FIELDS = set(SchedulerConfig.__struct_fields__)
_SHARES = tuple(key for key, _, unit, _ in keys() if unit == SHARE)
_DURATIONS = tuple(key for key, _, unit, _ in keys() if unit == MS)
_COUNTED = tuple(key for key, _, unit, _ in keys() if unit in COUNTS)


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
    for name in _SHARES:
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
    for name in _DURATIONS:
        if getattr(config, name) < 0:
            raise _invalid(f"invalid configuration: {name}={getattr(config, name)} must be >= 0")
    for name in _COUNTED:
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
    """Read a TOML file of configuration keys (a ``[scheduler]`` table or top-level keys; a
    ``[proxy]`` table beside them is the proxy's, ``laswrr up --config``, and not read here)."""
    import tomllib

    with open(path, "rb") as handle:
        raw = tomllib.load(handle)
    return with_changes(SchedulerConfig(), raw["scheduler"] if "scheduler" in raw else
                        {key: value for key, value in raw.items() if key != "proxy"})


def encode(config: SchedulerConfig) -> bytes:
    return msgspec.json.encode(config)


def decode(data: bytes) -> SchedulerConfig:
    return _DECODER.decode(data)
