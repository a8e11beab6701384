"""The scheduler's whole state as msgspec structs, so a checkpoint is one encode and a
restore one decode (a restarting scheduler starts from a checkpoint plus the tail: docs/design.md,
"Hazards designed for", stream limits)."""

from __future__ import annotations

import msgspec

from laswrr.scheduler.config import SchedulerConfig
from laswrr.schemas.outputs import LoadView
from laswrr.schemas.words import DrainCause, EjectCause, NodeRole, NpuHealth, PdProtocol, Phase, PhaseCause


class NodeState(msgspec.Struct, kw_only=True):
    node: str
    url: str
    pool: str
    chip: str
    capacity: int
    max_capacity: int
    registered_ns: int
    phase: Phase = Phase.ACTIVE
    phase_reason: str = "registered"
    phase_cause: PhaseCause = PhaseCause.REGISTERED
    phase_since_ns: int = 0
    drain_cause: DrainCause = DrainCause.NONE
    drain_deadline_ns: int = 0
    remove_pending: bool = False
    eject_cause: EjectCause = EjectCause.NONE
    ejected_until_ns: int = 0
    ejections: int = 0  # consecutive-ejection multiplier (Envoy's ejectTimeBackoff)
    last_decay_ns: int = 0
    slow_start_since_ns: int = 0
    slow_start_floor: float = 0.0
    target: float = 0.0
    effective: float = 0.0
    inflight: int = 0
    running: int | None = None
    waiting: int | None = None
    kv: float | None = None
    engine_ns: int | None = None
    npu_util: float | None = None
    npu_health: NpuHealth | None = None
    ttft_ewma: float | None = None
    probe_failures: int = 0
    consecutive_failures: int = 0
    health: float = 1.0
    load: LoadView | None = None
    npu_ns: int | None = None  # time of the last NPU sample (its signals age on their own)
    queue_evidence: int = 0  # engine samples in a row with a queue and fewer running than capacity
    slots_seen: int | None = None  # the running count of the last such evidence (weights.believed_slots)
    slots_seen_ns: int = 0
    sized_inflight: int = 0  # in-flight requests whose started event carried a prompt-token estimate
    inflight_tokens: int = 0  # their prompt + max_tokens (a prefill leg: its prompt), summed (reweigh.occupancy)
    models: list[str] | None = None  # the engine's model ids (lb.metrics.models); None: never listed
    # What the engine itself reports free (MindIE /v1/status, EngineSampled): its slots believed at once
    # (reweigh.observe_free_slots), its KV load from blocks; None: the engine does not say.
    free_slots: int | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    role: NodeRole = NodeRole.BOTH  # prefill/decode disaggregation (lb.admin.node role): weighed among its role
    pd_protocol: PdProtocol | None = None  # the pool's P/D protocol as this node's registration names it
    # How long the last NPU sample stands for (NpuSampled.max_age_ms, its source's refresh); None:
    # the configuration's stale_after_ms (weights.staleness)
    npu_max_age_ms: int | None = None
    bootstrap_port: int | None = None  # an sglang prefill node's bootstrap server port (lb.admin.node)
    drain_seq: int = 0  # the input seq that put it in draining: each proxy's heartbeat must reach it
    engine_max_age_ms: int | None = None  # how long the last engine sample stands for (EngineSampled.max_age_ms)


class OpenRequest(msgspec.Struct, frozen=True):
    node: str
    proxy: str
    boot: str | None = None  # the boot id of the proxy process that started it
    tokens: int | None = None  # prompt + max_tokens when the started event carried them


class CoreState(msgspec.Struct, kw_only=True):
    config: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    nodes: dict[str, NodeState] = msgspec.field(default_factory=dict)
    open_requests: dict[str, OpenRequest] = msgspec.field(default_factory=dict)
    proxies: dict[str, int] = msgspec.field(default_factory=dict)  # proxy -> last seen (ns)
    now_ns: int = 0
    tick: int = 0
    last_seq: int = 0
    proxy_boots: dict[str, str] = msgspec.field(default_factory=dict)  # proxy -> boot id of its live process
    retired_boots: dict[str, list[str]] = msgspec.field(default_factory=dict)  # proxy -> boot ids it replaced
    # proxy -> the newest snapshot (as_of_seq) its live process said it routes on (ProxyHeartbeat.snapshot_seq)
    proxy_seen: dict[str, int] = msgspec.field(default_factory=dict)
