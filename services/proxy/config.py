"""The proxy's configuration: one frozen value built by the CLI (or a test) and handed to ``app.start``.

Defaults are what an operator gets from a bare ``laswrr proxy``. ``proxy_id`` names this replica
on the bus (``lb.proxy.heartbeat.<proxy_id>``, ``RequestStarted.proxy``) and seeds its pick policy,
so two replicas started side by side do not send their first picks to the same node.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from dataclasses import dataclass, field

from laswrr.schemas import subjects as sj
from laswrr.schemas.events import MAX_BATCH_EVENTS
from laswrr.scheduler.policies import canonical_policy
from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE
from laswrr.services.natsbus import NatsAuth, StreamLimits
from laswrr.services.settings import DEFAULT_NATS_URL, DEFAULT_PROXY_PORT

AFFINITY_MODES = ("prefix", "none")

MIB = 1 << 20


def default_proxy_id() -> str:
    """``<hostname>-<pid>``, squeezed into one subject token (dots and the like become '-')."""
    host = re.sub(r"[^A-Za-z0-9_\-]+", "-", socket.gethostname()).strip("-")[:100] or "proxy"
    return f"{host}-{os.getpid()}"


def seed_of(proxy_id: str) -> int:
    """A stable 64-bit seed from the proxy id (same id -> same seed, on every host and run)."""
    return int.from_bytes(hashlib.blake2b(proxy_id.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    nats_url: str = DEFAULT_NATS_URL
    host: str = "0.0.0.0"
    port: int = DEFAULT_PROXY_PORT
    proxy_id: str = "proxy"
    policy: str = "la-swrr"
    max_retries: int = 2
    max_body_bytes: int = 4 * MIB
    grace_s: float = 30.0
    upstream_timeout_s: float = 300.0  # longest silence on an upstream read (not the stream length)
    connect_timeout_s: float = 3.0
    inflight_cap_per_capacity: float | None = None  # None: no per-node cap
    event_buffer: int = 100_000  # events held while NATS is slow or away; oldest dropped beyond
    event_flush_ms: int = 5  # a batch of events goes out this long after its first event at the latest
    event_batch_max: int = 512  # ... or as soon as this many events wait
    heartbeat_s: float = 2.0
    stale_after_s: float = 10.0  # snapshot older than this (or NATS down) -> /healthz says "stale"
    models_ttl_s: float = 5.0
    reuse_port: bool = False  # several replicas may share one port (SO_REUSEPORT)
    extra_routes: tuple[str, ...] = ()  # POST paths routed by body ``model`` beside app.OPENAI_POST_ROUTES
    continue_limit: int = 1  # continuations of one broken stream on other nodes; 0 turns them off
    # a vllm P/D pool: a request whose prompt estimate is at most this many tokens goes to its decode
    # node alone (the engine prefills it locally), no prefill leg; 0: off (every request is a pair)
    pd_decode_only_tokens: int = 0
    stall_timeout_s: float = 30.0  # a continuable stream silent this long has broken
    affinity: str = "prefix"  # la-swrr: prefer the node holding the prompt's prefix, under the guard; "none": off
    affinity_blocks: int = BLOCKS_PER_NODE  # prefix-index keys kept per node (512-character blocks)
    nats_auth: NatsAuth | None = None  # credential files beside the URL's; None: from the environment
    api_keys_file: str | None = None  # clients need one of its keys (services/proxy/keys.py); None: open
    key_max_inflight: int | None = None  # per key; beyond it 429
    forward_authorization: bool = False  # pass the client's Authorization header to the engines
    upstream_api_key: str | None = field(default=None, repr=False)  # Authorization: Bearer <it> to engines
    admin_port: int | None = None  # /metrics and the probes on this port instead of ``port``
    stream_replicas: int = StreamLimits.replicas  # of the streams it creates where missing (a cluster)
    idle_timeout_s: float = 60.0  # a connection without a complete request head this long is closed
    body_timeout_s: float = 60.0  # a request body not received within this: 408
    workers: int = 1  # processes on ``port`` (services/proxy/workers.py); each worker's own config says 1
    # Flow control (services/proxy/flow.py, scheduler/routing/flow.py): hold what no node can take yet.
    flow_control: bool = False
    queue_bound: int = 1024  # requests held per pool and band; beyond: 429 queue_full
    queue_ttl_ms: int = 30_000  # a held request's time to live without x-laswrr-ttl-ms; then 429 queue_timeout
    queue_ttl_max_ms: int = 300_000  # the most x-laswrr-ttl-ms may ask for
    no_node_wait_ms: int = 2_000  # no routable node in the pool this long: 503 no_routable_node
    flow_batch_every: int = 10  # starvation guard: 1 dispatch in this many goes to the waiting batch band
    flow_quantum: int = 1024  # DRR: work units (tokens) a tenant gains per turn
    retry_after_cap_s: float = 60.0  # the largest Retry-After flow control sends
    interactive_reserve: float = 0.1  # share of each node's limit only interactive requests may use
    # The channel between proxies (lb.peer.<pool>.<proxy>, docs/proxy.md): 0 turns it off.
    peer_interval_ms: int = 20  # at most one message per pool this often, when something changed
    peer_stale_ms: int = 2000  # a peer's message is used this long; the heartbeat is half of it
    peer_stagger_ms: int = 10  # the wait before a pick per replica ranked before this one, at most 3 (Router.stagger_s)
    peer_pick_ms: int = 1  # a pick is told this long after it, with the window's other picks (Router.peer_pick_s)

    def validate(self) -> "ProxyConfig":
        sj.check_token(self.proxy_id, "proxy name")
        canonical_policy(self.policy)  # ValueError on an unknown name
        checks = [
            (self.max_retries >= 0, "--max-retries must be >= 0"),
            (self.max_body_bytes > 0, "--max-body-bytes must be > 0"),
            (self.grace_s >= 0, "--grace-s must be >= 0"),
            (self.upstream_timeout_s > 0, "--upstream-timeout-s must be > 0"),
            (self.connect_timeout_s > 0, "--connect-timeout-s must be > 0"),
            (self.inflight_cap_per_capacity is None or self.inflight_cap_per_capacity > 0,
             "--inflight-cap-per-capacity must be > 0"),
            (self.event_buffer > 0, "--event-buffer must be > 0"),
            (self.event_flush_ms >= 0, "--event-flush-ms must be >= 0"),
            (1 <= self.event_batch_max <= MAX_BATCH_EVENTS, f"--event-batch-max must be 1..{MAX_BATCH_EVENTS}"),
            (0 <= self.port < 65536, "--port must be 0..65535"),
            (self.continue_limit >= 0, "--continue-limit must be >= 0"),
            (self.pd_decode_only_tokens >= 0, "--pd-decode-only-tokens must be >= 0"),
            (self.stall_timeout_s > 0, "--stall-timeout-s must be > 0"),
            (self.idle_timeout_s > 0, "--idle-timeout-s must be > 0"),
            (self.body_timeout_s > 0, "--body-timeout-s must be > 0"),
            (self.affinity in AFFINITY_MODES, f"--affinity must be one of {', '.join(AFFINITY_MODES)}"),
            (self.affinity_blocks >= 1, "--affinity-blocks must be >= 1"),
            (self.admin_port is None or 0 <= self.admin_port < 65536, "--admin-port must be 0..65535"),
            (self.key_max_inflight is None or self.key_max_inflight > 0, "--key-max-inflight must be > 0"),
            (self.key_max_inflight is None or self.api_keys_file is not None, "--key-max-inflight needs --api-keys"),
            (self.workers >= 1, "--workers must be >= 1"),
            (self.queue_bound >= 1, "--queue-bound must be >= 1"),
            (0 < self.queue_ttl_ms <= self.queue_ttl_max_ms, "--queue-ttl-ms must be > 0 and <= --queue-ttl-max-ms"),
            (self.no_node_wait_ms >= 0, "--no-node-wait-ms must be >= 0"),
            (self.flow_batch_every >= 1, "--flow-batch-every must be >= 1"),
            (self.flow_quantum >= 1, "--flow-quantum must be >= 1"),
            (self.retry_after_cap_s >= 1, "--retry-after-cap-s must be >= 1"),
            (0 <= self.interactive_reserve < 1, "--interactive-reserve must be within 0..1 (1 excluded)"),
            (self.peer_interval_ms >= 0, "--peer-interval-ms must be >= 0"),
            (self.peer_stale_ms > 2 * self.peer_interval_ms, "--peer-stale-ms must exceed 2 x --peer-interval-ms"),
            (self.peer_stagger_ms >= 0, "--peer-stagger-ms must be >= 0"),
            (self.peer_pick_ms >= 0, "--peer-pick-ms must be >= 0"),
        ]
        checks += [(path.startswith("/") and " " not in path, f"--extra-routes: {path!r} is not a path like /v1/x")
                   for path in self.extra_routes]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    @property
    def seed(self) -> int:
        return seed_of(self.proxy_id)


def parse_size(text: str) -> int:
    """``4MiB``, ``512KiB``, ``1MB``, ``1000`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"invalid size {text!r}: use e.g. 4MiB, 512KiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit[0]]
    if "I" not in unit and unit != "B":
        scale = {"K": 1000, "M": 1000**2, "G": 1000**3}[unit[0]]
    return int(number * scale)
