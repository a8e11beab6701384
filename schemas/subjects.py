"""Subject names of the wire contract (docs/wire.md): the one place that spells them.

Inputs live on stream LB_EVENTS (every ``lb.>`` subject except ``lb.out.>``); outputs on
LB_OUT (``lb.out.>``); the latest snapshot of each pool also sits in KV bucket LB_WEIGHTS
under the pool's name. Node ids and pool names are single NATS tokens.
"""

from __future__ import annotations

import re

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

ADMIN_NODE = "lb.admin.node"
ADMIN_REMOVE = "lb.admin.remove"
ADMIN_CAPACITY = "lb.admin.capacity"
ADMIN_DRAIN = "lb.admin.drain"
ADMIN_UNDRAIN = "lb.admin.undrain"
ADMIN_CONFIG = "lb.admin.config"
METRICS_ENGINE = "lb.metrics.engine"
METRICS_NPU = "lb.metrics.npu"
METRICS_MODELS = "lb.metrics.models"
HEALTH = "lb.health"
REQ_STARTED = "lb.req.started"
REQ_FINISHED = "lb.req.finished"
REQ_REFUSED = "lb.req.refused"  # the proxy answered a request itself (keyed by proxy)
REQ_QUEUED = "lb.req.queued"  # flow control held a request (keyed by proxy)
REQ_BATCH = "lb.req.batch"  # one message holding a proxy's request events (and heartbeats) in order
PROXY_HEARTBEAT = "lb.proxy.heartbeat"
PROXY_STOPPED = "lb.proxy.stopped"
CLOCK_TICK = "lb.clock.tick"
PEER = "lb.peer"  # core NATS, no stream: lb.peer.<pool>.<proxy> (schemas.peers)
PEER_ALL = "lb.peer.>"

OUT_SNAPSHOT = "lb.out.snapshot"
OUT_REJECTED = "lb.out.rejected"
OUT_PHASE = "lb.out.phase"
OUT_CONFIG = "lb.out.config"  # the verdict on a valid lb.admin.config: the configuration now in force

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


def admin_node(node: str) -> str:
    return _join(ADMIN_NODE, node, "node id")


def admin_remove(node: str) -> str:
    return _join(ADMIN_REMOVE, node, "node id")


def admin_capacity(node: str) -> str:
    return _join(ADMIN_CAPACITY, node, "node id")


def admin_drain(node: str) -> str:
    return _join(ADMIN_DRAIN, node, "node id")


def admin_undrain(node: str) -> str:
    return _join(ADMIN_UNDRAIN, node, "node id")


def metrics_engine(node: str) -> str:
    return _join(METRICS_ENGINE, node, "node id")


def metrics_npu(node: str) -> str:
    return _join(METRICS_NPU, node, "node id")


def metrics_models(node: str) -> str:
    return _join(METRICS_MODELS, node, "node id")


def health(node: str) -> str:
    return _join(HEALTH, node, "node id")


def req_started(node: str) -> str:
    return _join(REQ_STARTED, node, "node id")


def req_finished(node: str) -> str:
    return _join(REQ_FINISHED, node, "node id")


def req_refused(proxy: str) -> str:
    return _join(REQ_REFUSED, proxy, "proxy name")


def req_queued(proxy: str) -> str:
    return _join(REQ_QUEUED, proxy, "proxy name")


def req_batch(proxy: str) -> str:
    return _join(REQ_BATCH, proxy, "proxy name")


def proxy_heartbeat(proxy: str) -> str:
    return _join(PROXY_HEARTBEAT, proxy, "proxy name")


def proxy_stopped(proxy: str) -> str:
    return _join(PROXY_STOPPED, proxy, "proxy name")


def out_snapshot(pool: str) -> str:
    return _join(OUT_SNAPSHOT, pool, "pool name")


def out_phase(node: str) -> str:
    return _join(OUT_PHASE, node, "node id")


def split(subject: str) -> tuple[str, str | None]:
    """``lb.admin.capacity.n1`` -> (``lb.admin.capacity``, ``n1``); ``lb.clock.tick`` -> (itself, None)."""
    if subject in (CLOCK_TICK, ADMIN_CONFIG, OUT_REJECTED, OUT_CONFIG):
        return subject, None
    prefix, _, last = subject.rpartition(".")
    return prefix, last


def peer(pool: str, proxy: str) -> str:
    """``lb.peer.<pool>.<proxy>``: one proxy's view of one pool for the other proxies (schemas.peers)."""
    return f"{_join(PEER, pool, 'pool')}.{check_token(proxy, 'proxy id')}"


def peer_of(subject: str) -> tuple[str, str] | None:
    """``lb.peer.<pool>.<proxy>`` -> (pool, proxy); None for any other subject."""
    parts = subject.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != PEER or not parts[2] or not parts[3]:
        return None
    return parts[2], parts[3]
