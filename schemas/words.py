"""The shared words of the wire contract (v1, docs/wire.md): one definition each.

Request outcomes, why a request was refused or held and its priority band, node phases and the
triggers between them, why a node is drained, ejected or changed phase, NPU health levels, and
why an input was rejected. Each is a ``StrEnum``, so a member is its string on the wire, in
checkpoints and in SQL (``RequestOutcome.COMPLETED == "completed"``), and a typed msgspec field
decodes only the listed values: a ``lb.req.finished`` with an unknown outcome is a recorded
rejection on ``lb.out.rejected``, not a silent new category. Adding a word is one line here; readers that list every word (``laswrr report``, the
metrics, the views' checks in tests/schemas/test_words_spelled_once.py) iterate the enum.

Reasons (``Rejected.reason``, ``PhaseChanged.reason``) are text for people; what a machine
reads is the cause code beside them (``RejectCause``, ``PhaseCause``).
"""

from __future__ import annotations

from enum import StrEnum


class RequestOutcome(StrEnum):
    """How one proxy attempt ended (``lb.req.finished`` ``outcome``; docs/analysts.md, "Views")."""

    COMPLETED = "completed"  # a 2xx answer, and the whole of it reached the client
    CLIENT_CANCELLED = "client_cancelled"  # the client went away; the upstream request was cancelled
    UPSTREAM_ERROR = "upstream_error"  # connection failure, timeout, 5xx, or a stream cut after its first byte
    ROUTER_ABORTED = "router_aborted"  # still running when the proxy's shutdown grace period ended
    CONTINUED = "continued"  # a stream broke after its first byte and went on at next_attempt, on another node
    # The engine answered with a status that is neither 2xx nor 5xx (a 4xx such as 400 or 404, a 3xx), and that
    # answer reached the client whole: not a cut, not a failure of the node (no outlier ejection), but not a
    # success either; ``status`` says which. (A 5xx is upstream_error: retried, and counted against the node.)
    ENGINE_ERROR = "engine_error"


class FailureKind(StrEnum):
    """How a proxy attempt failed before any byte of it reached the client (services/proxy/exchange.py
    ``Failed``): what the proxy answers when no attempt is left (502, 504, or the engine's own answer) and
    whether another node may be tried (scheduler/routing/attempts.py). Not on the wire: the finished
    event's ``error`` is the failure's text for people."""

    UNREACHABLE = "engine_unreachable"  # connection refused or reset, an engine that hung up, a bad node URL: 502
    TIMED_OUT = "timed_out"  # no byte within the transport's timeout: 504
    ENGINE_5XX = "engine_5xx"  # the engine answered a 5xx: its answer passes through when no retry is left
    ENGINE_REFUSED = "engine_refused"  # a prefill leg answered below 500 but not 2xx: the client's answer, not retried
    NOT_SSE = "not_sse"  # a continuation answered with anything but SSE (an engine without the options): not retried
    NO_KV_PARAMS = "no_kv_params"  # a vllm prefill answer without kv_transfer_params (no KV connector): 502
    LEG_CANCELLED = "leg_cancelled"  # an sglang prefill leg cancelled: its decode leg ended or failed
    PARTNER_FAILED = "partner_failed"  # a decode leg cancelled because its pair's prefill leg failed


class RefusalCause(StrEnum):
    """Why a proxy answered a request itself, before binding it to any node (``lb.req.refused``
    ``cause``; docs/wire.md, "Engine errors and the router's own answers"). Each is also the ``reason``
    label of ``laswrr_proxy_rejected_total``; ``schemas.refusals.ANSWERS`` gives each its HTTP
    status, OpenAI error type and ``code`` (the cause's own word where OpenAI has none). Flow
    control (held requests) adds its causes here."""

    INVALID_API_KEY = "invalid_api_key"  # 401: no key, or not one of --api-keys
    KEY_MAX_INFLIGHT = "key_max_inflight"  # 429: the key's requests in flight reached its maximum
    INVALID_JSON = "invalid_json"  # 400: the body is not a JSON object (or not UTF-8); "bad_json" in older logs
    BODY_TIMEOUT = "body_timeout"  # 408: the body did not arrive within --body-timeout-s
    REQUEST_TOO_LARGE = "request_too_large"  # 413: over --max-body-bytes; "body_too_large" in older logs
    UNKNOWN_MODEL = "unknown_model"  # 404: no pool of that name, and no node of the pool serves that model id
    NO_SNAPSHOT = "no_snapshot"  # 503: no routing snapshot yet
    NO_ROUTABLE_NODE = "no_routable_node"  # 503: no node of the pool (serving the model) can take it now
    STOPPING = "stopping"  # 503: the proxy is shutting down
    # flow control (services/proxy/flow.py, scheduler/routing/flow.py)
    INVALID_HEADER = "invalid_header"  # 400: x-laswrr-priority or x-laswrr-ttl-ms not understood; "bad_flow_header" in older logs
    QUEUE_FULL = "queue_full"  # 429: the (pool, band) queue is at its bound
    QUEUE_TIMEOUT = "queue_timeout"  # 429: held past its time to live
    RATE_LIMIT_REQUESTS = "rate_limit_requests"  # 429: the key's requests per minute
    RATE_LIMIT_TOKENS = "rate_limit_tokens"  # 429: the key's tokens per minute
    CLIENT_DISCONNECTED = "client_disconnected"  # 499 (nginx's word): the client left while its request was held
    # latency objectives (scheduler/routing/latency.py)
    SLO_UNMEETABLE = "slo_unmeetable"  # 429: no node is predicted to meet the request's TTFT/TPOT target

    @classmethod
    def _missing_(cls, value: object) -> RefusalCause | None:
        """A log recorded before the log's words and the clients' codes became one word each
        (CHANGELOG.md) still reads: its old word is the new one."""
        return _OLD_REFUSAL_WORDS.get(value) if isinstance(value, str) else None


_OLD_REFUSAL_WORDS = {"bad_json": RefusalCause.INVALID_JSON, "body_too_large": RefusalCause.REQUEST_TOO_LARGE,
                      "bad_flow_header": RefusalCause.INVALID_HEADER}


class Band(StrEnum):
    """A request's priority band under flow control (``x-laswrr-priority``, a key's
    ``max_priority``, ``lb.req.queued`` ``band``, the peers' held counts, the ``band`` label of
    the queue metrics; docs/design.md, "Flow control"). Declaration order is urgency order, most
    urgent first (``Band.rank``): a band is served only when every more urgent one is empty."""

    INTERACTIVE = "interactive"
    DEFAULT = "default"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 for the most urgent band, then 1, 2 (declaration order)."""
        return BAND_RANK[self]

    def at_least_as_urgent(self) -> tuple[Band, ...]:
        """This band and the more urgent ones, most urgent first."""
        return BANDS[:BAND_RANK[self] + 1]


BANDS: tuple[Band, ...] = tuple(Band)
BAND_RANK: dict[Band, int] = {band: rank for rank, band in enumerate(Band)}


class HoldCause(StrEnum):
    """Why flow control held a request (``lb.req.queued`` ``cause``; docs/design.md, "Flow control")."""

    SATURATED = "saturated"  # every routable node (serving its model) at its limit
    BEHIND = "behind"  # requests of the pool were held already, or the other proxies hold more urgent ones
    NO_ROUTABLE_NODE = "no_routable_node"  # no routable node (serving its model) for now: it waits a short while


class Phase(StrEnum):
    """A node's phase (scheduler/phases.py holds the transitions between them)."""

    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    RECOVERING = "recovering"
    EJECTED = "ejected"
    REMOVED = "removed"
    NEW = "new"  # only as ``PhaseChanged.from_`` of a node's registration: it had no phase before


class Trigger(StrEnum):
    """What moves a node from one phase to another (scheduler/phases.py, ``TRANSITIONS``)."""

    DRAIN = "drain"
    DRAINED = "drained"
    UNDRAIN = "undrain"
    FORGET = "forget"
    EJECT = "eject"
    UNEJECT = "uneject"
    WARMED = "warmed"
    RAMP = "ramp"


class DrainCause(StrEnum):
    """Why the scheduler is draining a node (``NodeState.drain_cause``); NONE while not draining."""

    NONE = ""
    CAPACITY = "capacity"  # lb.admin.capacity set it to 0
    OPERATOR = "operator"  # lb.admin.drain
    REMOVE = "remove"  # lb.admin.remove: drain, then forget
    NPU = "npu"  # npu-smi reported Alarm


class VoidCause(StrEnum):
    """Why the scheduler stopped counting requests a proxy had open (``RequestsVoided.cause``,
    ``lb.out.voided.<proxy>``; docs/analysts.md, ``interruptions``)."""

    PROXY_STOPPED = "proxy_stopped"  # lb.proxy.stopped: the proxy announced its stop with them open
    PROXY_SILENT = "proxy_silent"  # no heartbeat nor request event for proxy_timeout_ms: the proxy is gone
    PROXY_REPLACED = "proxy_replaced"  # a new process (boot id) of the same proxy id: the old one died with them
    FINISH_LOST = "finish_lost"  # the live proxy's heartbeat counts fewer in flight: their finished events were lost


class EjectCause(StrEnum):
    """Why the scheduler ejected a node (``NodeState.eject_cause``); NONE while not ejected."""

    NONE = ""
    OUTLIER = "outlier"  # consecutive upstream errors (for a growing time)
    PROBE = "probe"  # failed health probes
    NPU = "npu"  # npu-smi reported Critical or an unknown health


class NodeRole(StrEnum):
    """What a node does in its pool (``lb.admin.node`` ``role``; docs/proxy.md, "Prefill/decode
    pairs"). ``both``, the default, is a node that serves a whole request, as every
    node did before roles; a pool with ``prefill`` and ``decode`` nodes is a P/D pool: a proxy
    picks one node of each role per request and runs its ``pd_protocol`` between them."""

    BOTH = "both"
    PREFILL = "prefill"  # computes the prompt's KV and hands it over (vLLM: kv_producer)
    DECODE = "decode"  # takes the KV and generates (vLLM: kv_consumer)


class PdProtocol(StrEnum):
    """How a P/D pool's prefill and decode engines hand a request over (``lb.admin.node``
    ``pd_protocol``): every node of a pool that names one names the same (the scheduler rejects
    a registration that disagrees, docs/proxy.md)."""

    VLLM = "vllm"  # sequential: prefill leg (max_tokens=1, kv_transfer_params), then decode leg
    SGLANG = "sglang"  # concurrent legs joined by bootstrap_host/port/room, sent to both at once


class PhaseCause(StrEnum):
    """Why a node changed phase (``PhaseChanged.cause``, ``NodeView.phase_cause``): one code per
    kind of report, so the views tell a deadline drain from a drain that ran to in-flight 0
    without reading the reason."""

    REGISTERED = "registered"  # lb.admin.node of a new node
    REGISTERED_AGAIN = "registered_again"  # lb.admin.node of a node being removed: the removal is off
    CAPACITY_ZERO = "capacity_zero"  # lb.admin.capacity 0
    CAPACITY_RESTORED = "capacity_restored"  # lb.admin.capacity above 0 after 0
    CAPACITY_RAISED = "capacity_raised"  # a capacity rise by capacity_ramp_ratio or more: slow start
    OPERATOR_DRAIN = "operator_drain"  # lb.admin.drain
    OPERATOR_UNDRAIN = "operator_undrain"  # lb.admin.undrain
    REMOVE_REQUESTED = "remove_requested"  # lb.admin.remove
    REMOVED = "removed"  # drained while a removal was pending: forgotten
    INFLIGHT_ZERO = "inflight_zero"  # a draining node's last request ended
    DRAIN_DEADLINE = "drain_deadline"  # the drain deadline cut a drain short
    SLOW_START_ELAPSED = "slow_start_elapsed"
    NPU_UNHEALTHY = "npu_unhealthy"  # npu health Critical or unknown: ejected
    NPU_ALARM = "npu_alarm"  # npu health Alarm: drained
    NPU_RECOVERED = "npu_recovered"  # npu health back to OK, Warning or unreported
    PROBE_FAILED = "probe_failed"  # health_fail_threshold failed probes in a row
    PROBE_PASSED = "probe_passed"
    UPSTREAM_ERRORS = "upstream_errors"  # consecutive upstream errors: outlier ejection
    EJECTION_ELAPSED = "ejection_elapsed"  # an outlier ejection's time is over


class NpuHealth(StrEnum):
    """An NPU chip's health as ``npu-smi info`` prints it, from best to worst (declaration order
    is severity order: ``NPU_SEVERITY``). A chip health outside these words counts as UNKNOWN."""

    OK = "OK"
    WARNING = "Warning"
    ALARM = "Alarm"
    CRITICAL = "Critical"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def of(cls, text: str | None) -> NpuHealth:
        """The level ``text`` names; UNKNOWN for None or any other text (a look-up in a dict of
        the members by value: ``cls(text)`` costs about 6,000 instructions, and every NPU sample
        asks for each chip)."""
        try:
            return _NPU_HEALTH_BY_TEXT.get(text, _NPU_UNKNOWN)  # type: ignore[arg-type]
        except TypeError:  # not hashable: not a value
            return _NPU_UNKNOWN


_NPU_HEALTH_BY_TEXT: dict[str, NpuHealth] = {health.value: health for health in NpuHealth}
_NPU_UNKNOWN = NpuHealth.UNKNOWN
NPU_SEVERITY: dict[NpuHealth, int] = {health: rank for rank, health in enumerate(NpuHealth)}


class RejectCause(StrEnum):
    """Why the core did not apply an input (``Rejected.cause``; the ``reason`` label of
    ``laswrr_scheduler_rejections_total``)."""

    UNKNOWN_SUBJECT = "unknown_subject"  # no event kind is published on the subject
    INVALID_NAME = "invalid_name"  # a node id, pool or proxy name that is not one subject token
    PAYLOAD_TOO_LARGE = "payload_too_large"  # over schemas.codec.MAX_PAYLOAD_BYTES
    NOT_JSON = "not_json"
    INVALID_PAYLOAD = "invalid_payload"  # JSON that does not satisfy the event's struct
    INVALID_BATCH_ITEM = "invalid_batch_item"  # not [kind, key, event], a kind that cannot be batched, a wrong key
    INVALID_CONFIG = "invalid_config"  # lb.admin.config with an unknown key or a bad value
    UPSTREAM_NOT_ALLOWED = "upstream_not_allowed"  # a registered URL outside allow_upstream
    UNKNOWN_NODE = "unknown_node"
    DUPLICATE_REQUEST = "duplicate_request"  # a request_id already in flight
    UNKNOWN_REQUEST = "unknown_request"  # a finished request never started, already finished or expired
    CAPACITY_ZERO = "capacity_zero"  # undrain of a node at capacity 0
    CAPACITY_ABOVE_LIMIT = "capacity_above_limit"  # a capacity above the scheduler's max_capacity
    PD_PROTOCOL = "pd_protocol_mismatch"  # a prefill/decode node without its pool's pd_protocol, or naming another one
    ILLEGAL_TRANSITION = "illegal_transition"  # a trigger not legal in the node's phase
    INTERNAL_ERROR = "internal_error"  # the core broke an invariant on this input (core.apply_guarded)
    UNPUBLISHABLE_OUTPUT = "unpublishable_output"  # an output over the bus's payload limit (codec.publishable)
