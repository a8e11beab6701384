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
from msgspec import UNSET, Meta, UnsetType

from laswrr.schemas.words import Band, HoldCause, NodeRole, PdProtocol, RefusalCause, RequestOutcome

# Integers are bounded by 2^53: exact in every JSON reader, and storable in the core's msgpack
# checkpoint (an unbounded int would be accepted here and break the checkpoint later).
MAX_INT = 2**53
NonNegInt = Annotated[int, Meta(ge=0, le=MAX_INT)]
PosInt = Annotated[int, Meta(gt=0, le=MAX_INT)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")]
HttpUrl = Annotated[str, Meta(min_length=8, max_length=2048, pattern=r"^https?://[^/\s?#]+")]
# A ZMQ endpoint to connect to (an engine's KV event publisher): tcp://host:port or ipc://path
ZmqUrl = Annotated[str, Meta(min_length=7, max_length=2048, pattern=r"^(tcp://[^\s/*]+:[0-9]+|ipc://\S+)$")]
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
    status_url: HttpUrl | None = None  # MindIE's management-port /v1/status (docs/ascend.md)
    npu_exporter: HttpUrl | None = None  # the host's npu-exporter /metrics (docs/ascend.md)
    # Prefill/decode disaggregation (docs/proxy.md, "Prefill/decode pairs"): the node's
    # role, and the protocol its pool's engines speak (required for a prefill or decode node; every
    # node of a pool that names one must name the same, else the registration is rejected).
    role: NodeRole = NodeRole.BOTH
    pd_protocol: PdProtocol | None = None
    # an ``sglang`` prefill node's bootstrap server port (SGLang's --disaggregation-bootstrap-port):
    # required for one, refused for any other node; the proxy sends it to both legs of a pair
    bootstrap_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    # the engine's KV event publisher and its replay socket (vLLM's --kv-events-config endpoint and
    # replay_endpoint, as reachable from laswrr kv-events; services/kv_events.py)
    kv_events: ZmqUrl | None = None
    kv_events_replay: ZmqUrl | None = None


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
    # What the engine itself says is free (MindIE /v1/status: availSlotsNum, free NPU KV blocks of
    # totalNpuBlockNums); None: the engine does not say (docs/ascend.md, "Signals in the core").
    free_slots: NonNegInt | None = None
    free_blocks: NonNegInt | None = None
    total_blocks: NonNegInt | None = None
    # The engine's prefix-cache counters as it exposes them (vLLM V1 vllm:prefix_cache_queries_total
    # / _hits_total: prompt tokens looked up / found cached, since the engine started); None: it has none.
    prefix_cache_queries: NonNegFloat | None = None
    prefix_cache_hits: NonNegFloat | None = None
    # How long the sample stands for: the collector publishes an unchanged sample again only this
    # often (its keep-alive), so the scheduler ages it only after that, as NpuSampled.max_age_ms.
    # None (a log written before the field, a sample published by hand): stale_after_ms.
    max_age_ms: PosInt | None = None


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
    # What set ``health`` when it is not OK (npu-exporter: "fault 80E18402 SeparateNPU", "npu_chip_info_health_status
    # 0 (unhealthy)"); the scheduler records it as the cause of a drain or ejection. None: npu-smi, or healthy.
    fault: Annotated[str, Meta(max_length=512)] | None = None


class NpuSampled(Event, frozen=True, kw_only=True):
    """``lb.metrics.npu.<node>``: the chips of ``npu-smi info`` (or the host's npu-exporter) that
    serve this node.

    ``max_age_ms``: how long the sample stands for, from its source's own refresh (the collector
    stamps two of the source's polling periods: 4 s for npu-smi every 2 s, 10 s for npu-exporter's
    5 s cache); the scheduler ages it only after that. None (a log written before the field, a
    sample published by hand): the scheduler's ``stale_after_ms`` (docs/algorithm.md §1, "Age")."""

    KIND: ClassVar[str] = "metrics.npu_sampled"
    chips: list[NpuChip]
    ts_ns: int | None = None
    max_age_ms: PosInt | None = None


ModelId = Annotated[str, Meta(min_length=1, max_length=256)]
MAX_MODELS = 256  # model ids one node may list (a LoRA-serving engine lists each adapter)


class ModelsListed(Event, frozen=True, kw_only=True):
    """``lb.metrics.models.<node>``: the model ids the node's engine lists on ``GET /v1/models``
    (the collector asks every ``--models-interval-ms``). The scheduler keeps the last list and
    puts it in the node's ``NodeView.models``, so a proxy forwards a pool's name as the model id
    of the node it picked, and a model id only to the nodes that serve it (docs/wire.md,
    "Model ids")."""

    KIND: ClassVar[str] = "metrics.models_listed"
    models: Annotated[list[ModelId], Meta(max_length=MAX_MODELS)]
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
    # A P/D pool's leg (prefill or decode: one request, two attempts); absent for a whole request,
    # so a proxy's events without roles keep their bytes (docs/proxy.md, "Prefill/decode pairs")
    role: NodeRole | UnsetType = UNSET
    # the request's latency objectives (x-laswrr-ttft-slo-ms / x-laswrr-tpot-slo-ms or the proxy's
    # --slo-default), absent without one, so a request without objectives keeps its bytes
    ttft_slo_ms: NonNegFloat | UnsetType = UNSET
    tpot_slo_ms: NonNegFloat | UnsetType = UNSET
    # the prompt tokens the router's view predicted cached on this node (the proxy's --tokenizer:
    # its engine's count for a node that publishes KV events, else the estimate's); absent when
    # unknown, so a request without it keeps its bytes
    cached_tokens: NonNegInt | UnsetType = UNSET
    # With the proxy's latency estimate (docs/proxy.md, "Latency objectives"): what the node's
    # prediction for the request is made of, so a refold of the log reproduces it (``laswrr replay
    # --latency``): the node's prefill backlog at the pick (tokens), the request's prompt tokens it
    # must prefill, its batch at the pick (its in-flight, the request included) and the attempts on
    # it the estimate had learned from; and the prediction, when the pick made one (a request with
    # targets). Absent without an estimate, so other events keep their bytes.
    queue_tokens: NonNegInt | UnsetType = UNSET
    uncached_tokens: NonNegInt | UnsetType = UNSET
    batch_size: PosInt | UnsetType = UNSET
    learned: NonNegInt | UnsetType = UNSET
    predicted_ttft_ms: NonNegFloat | UnsetType = UNSET
    predicted_tpot_ms: NonNegFloat | UnsetType = UNSET
    # the node's engine slots at the pick (its believed slots, else its capacity): a batch beyond
    # them waits for a slot (scheduler.routing.latency); absent in a log written before it (no wait)
    slots: NonNegInt | UnsetType = UNSET
    # the LB_EVENTS sequence from which the proxy's estimate learns every proxy's attempts (shared
    # by the replicas: scheduler.routing.latency_fold.SharedLearner); absent: it learned its own only
    learned_from: PosInt | UnsetType = UNSET


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
    role: NodeRole | UnsetType = UNSET  # a P/D pool's leg, as on its started event
    # whether the client's answer is a stream (the engine answered text/event-stream and the proxy
    # opened the SSE stream to the client): only then is ttft_ms a time to first token, else the
    # first byte was the whole answer. Absent in a log written before the field (unknown).
    stream: bool | UnsetType = UNSET

    @property
    def first_token_ms(self) -> float | None:
        """``ttft_ms`` when it is a time to first token: None for an answer that was not streamed
        (``stream`` false), as recorded when the event does not say (``stream`` absent)."""
        return None if self.stream is False else self.ttft_ms
    # the attempt's start, ms after the request's arrival (ttft_ms and duration_ms count from the
    # arrival: the attempt's own TTFT is ttft_ms - started_ms); absent in a log written before it
    started_ms: NonNegFloat | UnsetType = UNSET


class RequestRefused(Event, frozen=True, kw_only=True):
    """``lb.req.refused.<proxy>``: the proxy answered a request itself, with an error status,
    before binding it to any node (no ``lb.req.started`` was or will be published for it).
    ``cause`` is the machine word (schemas.words.RefusalCause), ``error`` the message the
    client got. The first member of the family of a request's life at the proxy before a node:
    flow control adds ``lb.req.queued`` (held), and a held request then ends either as an
    ``lb.req.started`` (dispatched) or as an ``lb.req.refused`` with the same ``request_id``
    (expired, overflow, client gone): docs/wire.md, "Engine errors and the router's own answers"."""

    KIND: ClassVar[str] = "req.refused"
    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    proxy: Name
    status: Annotated[int, Meta(ge=100, le=599)]
    cause: RefusalCause  # an unknown cause is rejected by the decoder
    pool: Name | None = None  # None: refused before a pool was chosen (401, 400, 413, an unknown model, ...)
    model: Annotated[str, Meta(max_length=256)] | None = None  # the body's "model", as the client sent it (cut)
    key_name: Annotated[str, Meta(max_length=128)] | None = None
    error: Annotated[str, Meta(max_length=512)] | None = None
    ts_ns: int | None = None
    boot_id: Name | None = None
    # slo_unmeetable: the request's targets and the best prediction among the pool's nodes (absent otherwise)
    ttft_slo_ms: NonNegFloat | UnsetType = UNSET
    tpot_slo_ms: NonNegFloat | UnsetType = UNSET
    predicted_ttft_ms: NonNegFloat | UnsetType = UNSET
    predicted_tpot_ms: NonNegFloat | UnsetType = UNSET
    # ... the node of that prediction and what it was made of, as on lb.req.started (and the
    # request's max_tokens, for its TPOT), so a refold of the log reproduces it
    predicted_node: Annotated[str, Meta(min_length=1, max_length=256)] | UnsetType = UNSET
    queue_tokens: NonNegInt | UnsetType = UNSET
    uncached_tokens: NonNegInt | UnsetType = UNSET
    batch_size: PosInt | UnsetType = UNSET
    learned: NonNegInt | UnsetType = UNSET
    max_tokens: NonNegInt | UnsetType = UNSET
    slots: NonNegInt | UnsetType = UNSET
    learned_from: PosInt | UnsetType = UNSET


class RequestQueued(Event, frozen=True, kw_only=True):
    """``lb.req.queued.<proxy>``: flow control held a request (docs/proxy.md, "Flow control").
    The request then ends as ``lb.req.started`` with the same ``request_id`` (dispatched to a
    node) or as ``lb.req.refused`` with it (TTL run out, no routable node, client gone: 499), so
    its wait in the queue is the difference of the two events' ``ts_ns``. ``band`` is the
    priority band it was held in (after its key's maximum), ``work`` its prompt plus
    ``max_tokens`` estimate (the DRR measure), ``cause`` why it was held: ``saturated`` (every
    routable node at its limit), ``behind`` (requests of the pool were held already, or the
    other proxies hold more urgent requests than the pool has free slots: docs/proxy.md, "Flow
    control", "Several proxies") or ``no_routable_node``."""

    KIND: ClassVar[str] = "req.queued"
    request_id: Annotated[str, Meta(min_length=1, max_length=256)]
    proxy: Name
    pool: Name = "default"
    band: Band = Band.DEFAULT
    key_name: Annotated[str, Meta(max_length=128)] | None = None
    work: NonNegInt | None = None
    ttl_ms: NonNegInt | None = None
    cause: HoldCause = HoldCause.SATURATED
    ts_ns: int | None = None
    boot_id: Name | None = None


class ProxyHeartbeat(Event, frozen=True, kw_only=True):
    """``lb.proxy.heartbeat.<proxy>``: a proxy is alive; ``inflight`` is its own count;
    ``snapshot_seq`` the newest snapshot it routes on (a draining node waits for it: docs/design.md,
    "Hazards designed for").

    ``boot_id`` names the proxy *process* (random at its start, whatever its ``--proxy-id``),
    on every heartbeat and request event: a new boot id for a proxy id tells the scheduler that
    the process that opened the id's requests is gone. None (an event published by hand): the
    event names no process, and voids nothing."""

    KIND: ClassVar[str] = "proxy.heartbeat"
    inflight: NonNegInt = 0
    ts_ns: int | None = None
    boot_id: Name | None = None
    # the newest LB_WEIGHTS ``as_of_seq`` the proxy has applied (any pool): a node drained at that
    # seq or before has had its last admission from this proxy reported already (the events before
    # this one). None: not said; such a proxy never holds a drain back.
    snapshot_seq: NonNegInt | None = None


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
    them, as one message (docs/wire.md, "Batched request events"). ``events`` are kept
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
