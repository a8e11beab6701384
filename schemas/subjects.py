"""Subject names of the wire contract (docs/wire.md): the streams, the wildcards, and the
facts' subjects and their builders, derived from the fact table (``schemas.facts``, the one place
that spells a fact's subject and what its key names).

Inputs live on stream LB_EVENTS (every ``lb.>`` subject except ``lb.out.>``); outputs on
LB_OUT (``lb.out.>``); the latest snapshot of each pool also sits in KV bucket LB_WEIGHTS
under the pool's name. Node ids and pool names are single NATS tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from laswrr.schemas import events as ev
from laswrr.schemas import facts
from laswrr.schemas import outputs as out

EVENTS_STREAM = "LB_EVENTS"
OUT_STREAM = "LB_OUT"
WEIGHTS_BUCKET = "LB_WEIGHTS"
CHECKPOINT_BUCKET = "LB_CHECKPOINT"  # the scheduler's own state (Scheduler.checkpoint() bytes)

ALL = "lb.>"  # every subject of the contract (LB_EVENTS and LB_OUT)
ADMIN = "lb.admin"
ADMIN_ALL = "lb.admin.>"
METRICS_ALL = "lb.metrics.>"
HEALTH_ALL = "lb.health.>"
REQ_ALL = "lb.req.>"
CLOCK_ALL = "lb.clock.>"
PROXY_ALL = "lb.proxy.>"
OUT = "lb.out"
OUT_ALL = "lb.out.>"
EVENTS_SUBJECTS = [ADMIN_ALL, METRICS_ALL, HEALTH_ALL, REQ_ALL, CLOCK_ALL, PROXY_ALL]
OUT_SUBJECTS = [OUT_ALL]

# The facts' subjects (the whole subject, or the prefix a node, proxy or pool name follows):
# spelled once, in the fact table (schemas.facts), and named here.
ADMIN_NODE = facts.of(ev.NodeRegistered).subject
ADMIN_REMOVE = facts.of(ev.NodeRemoveRequested).subject
ADMIN_CAPACITY = facts.of(ev.CapacitySet).subject
ADMIN_DRAIN = facts.of(ev.DrainRequested).subject
ADMIN_UNDRAIN = facts.of(ev.UndrainRequested).subject
ADMIN_CONFIG = facts.of(ev.ConfigChanged).subject
METRICS_ENGINE = facts.of(ev.EngineSampled).subject
METRICS_NPU = facts.of(ev.NpuSampled).subject
METRICS_MODELS = facts.of(ev.ModelsListed).subject
HEALTH = facts.of(ev.HealthProbed).subject
REQ_STARTED = facts.of(ev.RequestStarted).subject
REQ_FINISHED = facts.of(ev.RequestFinished).subject
REQ_REFUSED = facts.of(ev.RequestRefused).subject  # the proxy answered a request itself
REQ_QUEUED = facts.of(ev.RequestQueued).subject  # flow control held a request
REQ_BATCH = facts.of(ev.RequestBatch).subject  # one message holding a proxy's request events (and heartbeats) in order
PROXY_HEARTBEAT = facts.of(ev.ProxyHeartbeat).subject
PROXY_STOPPED = facts.of(ev.ProxyStopped).subject
CLOCK_TICK = facts.of(ev.ClockTicked).subject
PEER = "lb.peer"  # core NATS, no stream: lb.peer.<pool>.<proxy> (schemas.peers)
PEER_ALL = "lb.peer.>"
KV = "lb.kv"  # core NATS, no stream: lb.kv.<node>, a node's KV cache changes (schemas.kvcache)
KV_ALL = "lb.kv.>"

OUT_SNAPSHOT = facts.of(out.WeightSnapshot).subject
OUT_REJECTED = facts.of(out.Rejected).subject
OUT_PHASE = facts.of(out.PhaseChanged).subject
OUT_CONFIG = facts.of(out.ConfigApplied).subject  # the verdict on a valid lb.admin.config: the configuration now in force
OUT_VOIDED = facts.of(out.RequestsVoided).subject  # requests of a proxy the scheduler stopped counting

# Core NATS request (not in any stream): a reader asks the recorder for a copy of its DuckDB file.
RECORDER_SNAPSHOT = "lb.recorder.snapshot"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


class SubjectError(ValueError):
    """A node id, pool or proxy name that cannot be one NATS subject token."""


def check_token(name: str, what: str = "node id") -> str:
    if not _TOKEN.match(name):
        raise SubjectError(f"invalid {what} {name!r}: use 1-128 letters, digits, '-' or '_'")
    return name


def _join(prefix: str, token: str, what: str) -> str:
    return f"{prefix}.{check_token(token, what)}"


def _builder(struct: type[msgspec.Struct]) -> Callable[[str], str]:
    """``build(token)``: the subject of one ``struct`` fact whose key is ``token`` (checked)."""
    fact = facts.of(struct)
    prefix, what = fact.subject, fact.key.what

    def build(token: str) -> str:
        return f"{prefix}.{check_token(token, what)}"

    build.__doc__ = f"``{fact.pattern}``: the subject of one ``{fact.kind}`` ({struct.__name__})."
    return build


admin_node = _builder(ev.NodeRegistered)
admin_remove = _builder(ev.NodeRemoveRequested)
admin_capacity = _builder(ev.CapacitySet)
admin_drain = _builder(ev.DrainRequested)
admin_undrain = _builder(ev.UndrainRequested)
metrics_engine = _builder(ev.EngineSampled)
metrics_npu = _builder(ev.NpuSampled)
metrics_models = _builder(ev.ModelsListed)
health = _builder(ev.HealthProbed)
req_started = _builder(ev.RequestStarted)
req_finished = _builder(ev.RequestFinished)
req_refused = _builder(ev.RequestRefused)
req_queued = _builder(ev.RequestQueued)
req_batch = _builder(ev.RequestBatch)
proxy_heartbeat = _builder(ev.ProxyHeartbeat)
proxy_stopped = _builder(ev.ProxyStopped)
out_snapshot = _builder(out.WeightSnapshot)
out_phase = _builder(out.PhaseChanged)
out_voided = _builder(out.RequestsVoided)


def split(subject: str) -> tuple[str, str | None]:
    """``lb.admin.capacity.n1`` -> (``lb.admin.capacity``, ``n1``); ``lb.clock.tick`` -> (itself, None)."""
    if subject in facts.WHOLE_SUBJECTS:
        return subject, None
    prefix, _, last = subject.rpartition(".")
    return prefix, last


def peer(pool: str, proxy: str) -> str:
    """``lb.peer.<pool>.<proxy>``: one proxy's view of one pool for the other proxies (schemas.peers)."""
    return f"{_join(PEER, pool, 'pool')}.{check_token(proxy, 'proxy id')}"


def kv(node: str) -> str:
    """``lb.kv.<node>``: the node's KV cache changes from its engine's events (schemas.kvcache)."""
    return _join(KV, node, "node id")


def kv_node(subject: str) -> str | None:
    """``lb.kv.<node>`` -> node; None for any other subject."""
    prefix, _, node = subject.rpartition(".")
    return node if prefix == KV and node else None


def peer_of(subject: str) -> tuple[str, str] | None:
    """``lb.peer.<pool>.<proxy>`` -> (pool, proxy); None for any other subject."""
    parts = subject.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != PEER or not parts[2] or not parts[3]:
        return None
    return parts[2], parts[3]
