"""Input facts (stream LB_EVENTS), one msgspec struct per subject family.

Every struct carries a stable ``KIND`` tag (a past-tense domain name, never a class or module
name); the subject decides which struct a payload decodes into (see ``schemas.codec``).
Payloads are plain JSON as ``nats pub`` sends them. Unknown extra fields are ignored, so
producers may add fields; new fields here go last and have defaults. Constraints that are part
of the contract (capacity >= 0, kv_cache_usage in 0..1, ...) are declared with ``Meta`` so the
decoder itself rejects bad values with a precise message.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

import msgspec
from msgspec import Meta

from laswrr.schemas.words import RequestOutcome

# Integers are bounded by 2^53: exact in every JSON reader, and storable in the core's msgpack
# checkpoint (an unbounded int would be accepted here and break the checkpoint later).
MAX_INT = 2**53
NonNegInt = Annotated[int, Meta(ge=0, le=MAX_INT)]
PosInt = Annotated[int, Meta(gt=0, le=MAX_INT)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")]
HttpUrl = Annotated[str, Meta(min_length=8, max_length=2048, pattern=r"^https?://[^/\s?#]+")]
# How the collector reads an engine's /metrics: one family's names, or detected per scrape.
EngineName = Literal["auto", "vllm", "mindie", "sglang"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)


class Event(msgspec.Struct, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "event"


class NodeRegistered(Event, frozen=True, kw_only=True):
    """``lb.admin.node.<node>``: register an instance, or update a registered one.

    ``metrics_url``, ``health_url`` and ``engine`` tell the collector how to poll a node
    registered at runtime (None: ``<url>/metrics``, ``<url>/health``, detect the engine, or
    what the collector's nodes.toml says); the scheduler does not use them."""

    KIND: ClassVar[str] = "admin.node_registered"
    url: Annotated[str, Meta(min_length=1, max_length=2048)]
    capacity: PosInt
    pool: Name = "default"
    chip: Annotated[str, Meta(max_length=64)] = "unknown"
    metrics_url: HttpUrl | None = None
    health_url: HttpUrl | None = None
    engine: EngineName | None = None


class NodeRemoveRequested(Event, frozen=True, kw_only=True):
    """``lb.admin.remove.<node>``: drain, then forget the node once drained."""

    KIND: ClassVar[str] = "admin.node_remove_requested"


class CapacitySet(Event, frozen=True, kw_only=True):
    """``lb.admin.capacity.<node>``: the instance's current capacity; 0 drains it."""

    KIND: ClassVar[str] = "admin.capacity_set"
    capacity: NonNegInt


class DrainRequested(Event, frozen=True, kw_only=True):
    """``lb.admin.drain.<node>``: admit no new requests; in-flight ones finish."""

    KIND: ClassVar[str] = "admin.drain_requested"


class UndrainRequested(Event, frozen=True, kw_only=True):
    """``lb.admin.undrain.<node>``: return a draining or drained node, with slow start."""

    KIND: ClassVar[str] = "admin.undrain_requested"


class ConfigChanged(Event, frozen=True, kw_only=True):
    """``lb.admin.config``: a partial scheduler configuration, ``{"set": {"key": value}}``."""

    KIND: ClassVar[str] = "admin.config_changed"
    set: dict[str, float | int | bool | str]


class EngineSampled(Event, frozen=True, kw_only=True):
    """``lb.metrics.engine.<node>``: one scrape of the engine's own metrics."""

    KIND: ClassVar[str] = "metrics.engine_sampled"
    running: NonNegInt
    waiting: NonNegInt
    kv_cache_usage: Fraction
    ttft_ms: NonNegFloat | None = None
    e2e_ms: NonNegFloat | None = None
    engine: str | None = None
    ts_ns: int | None = None


class NpuChip(msgspec.Struct, frozen=True, kw_only=True):
    npu_id: NonNegInt
    chip_id: NonNegInt
    aicore_util: Fraction | None = None
    hbm_used_mb: NonNegInt | None = None
    hbm_total_mb: NonNegInt | None = None
    health: str | None = None
    name: str | None = None
    power_w: float | None = None
    temp_c: float | None = None
    memory_used_mb: NonNegInt | None = None
    memory_total_mb: NonNegInt | None = None


class NpuSampled(Event, frozen=True, kw_only=True):
    """``lb.metrics.npu.<node>``: the chips of ``npu-smi info`` that serve this node."""

    KIND: ClassVar[str] = "metrics.npu_sampled"
    chips: list[NpuChip]
    ts_ns: int | None = None


class HealthProbed(Event, frozen=True, kw_only=True):
    """``lb.health.<node>``: result of one health probe."""

    KIND: ClassVar[str] = "health.probed"
    ok: bool
    latency_ms: NonNegFloat | None = None
    error: str | None = None
    ts_ns: int | None = None


class RequestStarted(Event, frozen=True, kw_only=True):
    """``lb.req.started.<node>``: a proxy admitted a request to this node."""

    KIND: ClassVar[str] = "req.started"
    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    proxy: Name
    pool: Name = "default"
    snapshot_seq: int | None = None
    ts_ns: int | None = None
    boot_id: Name | None = None  # the proxy process (ProxyHeartbeat.boot_id)
    prompt_tokens: NonNegInt | None = None  # the proxy's estimate of the prompt (token-aware load)
    max_tokens: NonNegInt | None = None  # the output the request may generate (its decode reservation)
    key_name: Annotated[str, Meta(max_length=128)] | None = None  # the client's API key, by name (never the key)


class RequestFinished(Event, frozen=True, kw_only=True):
    """``lb.req.finished.<node>``: the request admitted to this node ended."""

    KIND: ClassVar[str] = "req.finished"
    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    proxy: Name
    outcome: RequestOutcome  # an unknown outcome is rejected by the decoder
    pool: Name = "default"
    ttft_ms: NonNegFloat | None = None
    duration_ms: NonNegFloat | None = None
    prompt_tokens: NonNegInt | None = None
    completion_tokens: NonNegInt | None = None
    status: int | None = None
    error: str | None = None
    ts_ns: int | None = None
    next_attempt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None  # continued or retried as
    boot_id: Name | None = None  # the proxy process (ProxyHeartbeat.boot_id)


class ProxyHeartbeat(Event, frozen=True, kw_only=True):
    """``lb.proxy.heartbeat.<proxy>``: a proxy is alive; ``inflight`` is its own count.

    ``boot_id`` names the proxy *process* (random at its start, whatever its ``--proxy-id``),
    on every heartbeat and request event: a new boot id for a proxy id tells the scheduler that
    the process that opened the id's requests is gone. None: a proxy from before boot ids."""

    KIND: ClassVar[str] = "proxy.heartbeat"
    inflight: NonNegInt = 0
    ts_ns: int | None = None
    boot_id: Name | None = None


class ProxyStopped(Event, frozen=True, kw_only=True):
    """``lb.proxy.stopped.<proxy>``: a proxy shut down; its open requests are void."""

    KIND: ClassVar[str] = "proxy.stopped"
    ts_ns: int | None = None
    boot_id: Name | None = None


MAX_BATCH_EVENTS = 10_000  # events in one lb.req.batch message (its bytes are bounded by the payload limit too)


class BatchedEvent(msgspec.Struct, frozen=True, array_like=True):
    """One event of a ``RequestBatch``, on the wire ``[kind, key, event]``: ``kind`` the event's
    ``KIND`` (``req.started``, ``req.finished``, ``proxy.heartbeat`` or ``proxy.stopped``),
    ``key`` the last token its own subject would have (the node of a request event; null for
    the proxy events, whose proxy is the batch's), ``event`` the event's own payload, unchanged."""

    kind: str
    key: str | None
    event: msgspec.Raw


class RequestBatch(Event, frozen=True, kw_only=True):
    """``lb.req.batch.<proxy>``: a proxy's request events and heartbeats, in the order it made
    them, as one message (docs/design.md §6, "Batched request events"). ``events`` are kept
    raw here and decoded one by one (``schemas.codec.unbatch``), so one bad event rejects only
    itself. ``boot_id`` and ``batch`` (the proxy's batch counter, as in its ``Nats-Msg-Id``
    ``<proxy>:<boot_id>:<batch>``) are for readers of the log; the core does not use them."""

    KIND: ClassVar[str] = "req.batch"
    boot_id: Name | None = None
    batch: NonNegInt | None = None
    events: Annotated[list[msgspec.Raw], Meta(min_length=1, max_length=MAX_BATCH_EVENTS)]


class ClockTicked(Event, frozen=True, kw_only=True):
    """``lb.clock.tick``: time passes (one per period, de-duplicated by the stream)."""

    KIND: ClassVar[str] = "clock.ticked"
    tick: NonNegInt
