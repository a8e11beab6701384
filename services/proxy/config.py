"""The proxy's configuration: one frozen value built by the CLI (or a test) and handed to ``app.start``.

Every setting is declared once, here: each field of ``ProxyConfig`` carries its default, its help
text, its unit and its flag (``setting(...)``, read back with ``settings_of``). From that one
declaration come ``laswrr proxy``'s flags and their defaults (``cli.add_arguments``), the
config from the parsed flags (``cli.config_from_args``), the environment variables (every flag is
also ``LASWRR_<FLAG>``, laswrr/cli.py; a setting may name one more, ``env``), the options of
``laswrr up`` that reach the proxy (``up``: a flag of its own; any other through ``--proxy-arg``
or a ``[proxy]`` table of its ``--config`` file) and the table of docs/configuration.md
(``python -m laswrr.services.docgen``).

Defaults are what an operator gets from a bare ``laswrr proxy``. ``proxy_id`` names this replica
on the bus (``lb.proxy.heartbeat.<proxy_id>``, ``RequestStarted.proxy``) and seeds its pick policy,
so two replicas started side by side do not send their first picks to the same node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from laswrr.schemas import subjects as sj
from laswrr.schemas.events import MAX_BATCH_EVENTS
from laswrr.scheduler.policies import POLICIES, canonical_policy
from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE
from laswrr.scheduler.routing.latency import SloDefaults
from laswrr.services.natsbus import MAX_REPLICAS, NatsAuth, StreamLimits
from laswrr.services.settings import DEFAULT_NATS_URL, DEFAULT_PROXY_PORT, duration, port_number, replicas

AFFINITY_MODES = ("prefix", "none")
DEFAULT_HOST = "127.0.0.1"  # this machine only: 0.0.0.0 (every interface) is asked for, never assumed

MIB = 1 << 20
SAME: Any = type("Same", (), {"__repr__": lambda self: "SAME"})()  # a Setting's default: the field's own

FLOW_GROUP = "flow control (docs/proxy.md, \"Flow control\")"
PEERS_GROUP = "the channel between proxies (docs/proxy.md, \"The channel between proxies\")"
SLO_GROUP = "latency objectives (docs/proxy.md, \"Latency objectives\")"
KEYS_GROUP = "client API keys and upstream credentials (services/proxy/keys.py)"



def parse_slo_defaults(text: str) -> tuple[str, ...]:
    """``interactive=1000/50,batch=10000/`` -> its specs, each checked (``SloDefaults.parse``)."""
    specs = tuple(spec.strip() for spec in text.split(",") if spec.strip())
    SloDefaults.parse(specs)
    return specs

@dataclass(frozen=True, slots=True)
class Setting:
    """What a ``ProxyConfig`` field says about itself (``setting``)."""

    help: str
    unit: str = ""  # "s" and "ms" make the flag a duration in that unit; others are for the docs
    flag: str | None = ""  # "": --<field name with dashes>; None: no flag (fixed, or built from others)
    parse: Callable[[str], Any] | None = None  # the flag's text -> value (ValueError: a usage error)
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    group: str = ""  # the --help section
    default_text: str | None = None  # the default as --help and the docs say it, when not the value
    negatable: bool = False  # a switch with its --no-<flag>
    cli_default: Any = SAME  # the flag's default, when not the field's (then resolved later)
    env: str | None = None  # one more variable read as the flag's default, besides LASWRR_<FLAG>
    shared: bool = False  # the flag is added by a helper every service shares (services/settings.py)
    up: str | None = None  # `laswrr up`'s own flag for it (see services/up.py); others: --proxy-arg
    up_default: Any = SAME  # `laswrr up`'s default, when not the proxy's


def setting(default: Any, help: str, **how: Any) -> Any:
    """A ``ProxyConfig`` field: its default, and a ``Setting`` in its metadata."""
    return dataclasses.field(default=default, repr=how.pop("repr", True), metadata={"setting": Setting(help, **how)})


def settings_of() -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """Every field of ``ProxyConfig`` (in declaration order) with its ``Setting``."""
    for field in dataclasses.fields(ProxyConfig):
        yield field, field.metadata["setting"]


def flag_of(field: dataclasses.Field[Any], how: Setting) -> str | None:
    if how.flag is None:
        return None
    return how.flag or "--" + field.name.replace("_", "-")


def default_proxy_id() -> str:
    """``<hostname>-<pid>``, squeezed into one subject token (dots and the like become '-')."""
    host = re.sub(r"[^A-Za-z0-9_\-]+", "-", socket.gethostname()).strip("-")[:100] or "proxy"
    return f"{host}-{os.getpid()}"


def seed_of(proxy_id: str) -> int:
    """A stable 64-bit seed from the proxy id (same id -> same seed, on every host and run)."""
    return int.from_bytes(hashlib.blake2b(proxy_id.encode(), digest_size=8).digest(), "big")


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


def parse_paths(text: str) -> tuple[str, ...]:
    """``/a, /b`` -> ``("/a", "/b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server(s) (--nats-url, shared by every service)", shared=True,
                            default_text=f"$NATS_URL or {DEFAULT_NATS_URL}")
    host: str = setting(DEFAULT_HOST, "listen address; 0.0.0.0 for every interface", metavar="ADDR",
                        up="--proxy-host")
    port: int = setting(DEFAULT_PROXY_PORT, "listen port; 0 picks a free one", metavar="PORT",
                        up="--proxy-port")
    proxy_id: str = setting("proxy", "replica name on the bus and policy seed", cli_default=None,
                            default_text="hostname-pid")
    policy: str = setting("la-swrr", f"pick policy: {', '.join(POLICIES)}; the peers' round_robin, power_of_two "
                          "and least_request name the same ones", parse=canonical_policy, metavar="NAME")
    max_retries: int = setting(2, "retries on another node before the first byte", unit="retries")
    max_body_bytes: int = setting(4 * MIB, "request body limit, e.g. 4MiB", unit="bytes", parse=parse_size,
                                  default_text="4194304 bytes, 4MiB")
    grace_s: float = setting(30.0, "on SIGTERM, time in-flight requests get to finish", unit="s")
    upstream_timeout_s: float = setting(300.0, "longest silence on an upstream read, not the stream length", unit="s")
    connect_timeout_s: float = setting(3.0, "upstream TCP connect timeout", unit="s")
    inflight_cap_per_capacity: float | None = setting(
        None, "a node's in-flight may not exceed ceil(F x capacity)", metavar="F", default_text="off")
    event_buffer: int = setting(100_000, "events held while NATS is slow or away; the oldest drop beyond",
                                unit="events")
    event_flush_ms: int = setting(5, "publish a batch of request events this long after its first event at the "
                                  "latest", unit="ms", up="--event-flush-ms")
    event_batch_max: int = setting(512, "publish a batch of request events as soon as N wait, before "
                                   "--event-flush-ms", unit="events", metavar="N", up="--event-batch-max")
    heartbeat_s: float = setting(2.0, "the proxy's heartbeat period", unit="s", flag=None)
    stale_after_s: float = setting(10.0, "a snapshot older than this (or NATS down): /healthz says stale",
                                   unit="s", flag=None)
    models_ttl_s: float = setting(5.0, "GET /v1/models answers are cached this long", unit="s", flag=None)
    reuse_port: bool = setting(False, "SO_REUSEPORT: replicas may share --port")
    extra_routes: tuple[str, ...] = setting(
        (), "more POST paths to route by the body's model, beside the OpenAI ones (e.g. /v1/classify,/pooling)",
        parse=parse_paths, metavar="PATH[,PATH...]", default_text="none")
    continue_limit: int = setting(1, "continue a stream broken after its first byte on up to N other nodes; 0: off",
                                  unit="nodes", metavar="N")
    pd_decode_only_tokens: int = setting(
        0, "a vllm prefill/decode pool: a request whose prompt is at most N tokens (estimated) goes to its decode "
        "node alone, no prefill leg; 0: off", unit="tokens", metavar="N")
    stall_timeout_s: float = setting(30.0, "a continuable stream silent this long has broken", unit="s")
    affinity: str = setting("prefix", "la-swrr: send a prompt to the node that holds its prefix while the load "
                            "guard allows (prefix), or never (none)", choices=AFFINITY_MODES)
    affinity_blocks: int = setting(BLOCKS_PER_NODE, "prefix-index keys kept per node, 512 characters (~128 tokens) "
                                   "each; set it to the engines' KV room (16384: ~2 M tokens)", unit="keys",
                                   metavar="N")
    tokenizer: str | None = setting(
        None, "the exact cache view: the model's tokenizer directory (tokenizer.json, tokenizer_config.json); the "
        "nodes whose engines publish KV events (laswrr kv-events) are matched on its tokens", metavar="DIR",
        default_text="none: the estimated view alone")
    kv_in_flight: bool = setting(False, "the exact cache view counts the prompt blocks of this proxy's requests in "
                                 "flight on a node as held there until they end (the engine stores them when it "
                                 "prefills); measured no better on this project's real-vLLM scenarios "
                                 "(docs/evidence/cache-view.md, Requests in flight)", negatable=True)
    nats_auth: NatsAuth | None = setting(None, "NATS credential files (--nats-creds, --nats-nkey, --nats-tls-*, "
                                         "shared by every service)", flag=None, default_text="$NATS_CREDS, ...")
    api_keys_file: str | None = setting(
        None, "clients must send Authorization: Bearer <one of its keys>; one key per line, optionally name:key",
        flag="--api-keys", metavar="FILE", group=KEYS_GROUP, env="LASWRR_API_KEYS_FILE",
        default_text="$LASWRR_API_KEYS_FILE; none: open", up="--api-keys")
    key_max_inflight: int | None = setting(None, "requests in flight per key; beyond, 429 with Retry-After",
                                           unit="requests", metavar="N", group=KEYS_GROUP, default_text="no limit")
    forward_authorization: bool = setting(False, "pass the client's Authorization header on to the engines",
                                          group=KEYS_GROUP, default_text="dropped")
    upstream_api_key: str | None = setting(
        None, "send Authorization: Bearer KEY to the engines (prefer $LASWRR_UPSTREAM_API_KEY: argv is public)",
        metavar="KEY", group=KEYS_GROUP, default_text="none, or $LASWRR_UPSTREAM_API_KEY", repr=False)
    admin_port: int | None = setting(None, "serve /metrics, /health, /healthz and /readiness on this port only",
                                     parse=port_number, metavar="PORT", default_text="on --port, open")
    stream_replicas: int = setting(StreamLimits.replicas, f"copies of the streams and buckets it creates where "
                                   f"missing, on a NATS cluster (1..{MAX_REPLICAS})", parse=replicas, shared=True)
    idle_timeout_s: float = setting(60.0, "close a client connection that has not sent a complete request head for "
                                    "this long (idle between requests, or its headers trickling in)", unit="s")
    body_timeout_s: float = setting(60.0, "answer 408 to a request whose body has not arrived within this", unit="s")
    workers: int = setting(1, "N proxy processes on one port (SO_REUSEPORT), supervised; worker k is proxy "
                           "<proxy-id>-<k> with its own in-flight counts; with --admin-port P, its /metrics on P+k",
                           unit="processes", metavar="N", default_text="1: this process serves, as <proxy-id>",
                           up="--proxy-workers")
    # Flow control (services/proxy/flow.py, scheduler/routing/flow.py): hold what no node can take yet.
    flow_control: bool = setting(False, "hold requests no node can take yet (each node's concurrency_limit from the "
                                 "snapshot), by priority band and fair between API keys", negatable=True,
                                 group=FLOW_GROUP, up="--flow-control", up_default=True)
    queue_bound: int = setting(1024, "requests held per pool and band; beyond it 429 queue_full", unit="requests",
                               metavar="N", group=FLOW_GROUP)
    queue_ttl_ms: int = setting(30_000, "a held request's time to live without x-laswrr-ttl-ms; "
                                "then 429 queue_timeout", unit="ms", metavar="MS", group=FLOW_GROUP)
    queue_ttl_max_ms: int = setting(300_000, "the most x-laswrr-ttl-ms may ask for", unit="ms", metavar="MS",
                                    group=FLOW_GROUP)
    no_node_wait_ms: int = setting(2_000, "no routable node in a pool this long: 503 no_routable_node", unit="ms",
                                   metavar="MS", group=FLOW_GROUP)
    flow_batch_every: int = setting(10, "starvation guard: 1 dispatch in N goes to the waiting batch band",
                                    unit="dispatches", metavar="N", group=FLOW_GROUP)
    flow_quantum: int = setting(1024, "deficit round robin between API keys: work a key gains per turn",
                                unit="tokens", metavar="TOKENS", group=FLOW_GROUP)
    retry_after_cap_s: float = setting(60.0, "the largest Retry-After flow control sends", unit="s", metavar="S",
                                       group=FLOW_GROUP)
    interactive_reserve: float = setting(0.1, "share of each node's limit only interactive requests may use: default "
                                         "and batch see limit - floor(F x limit), or limit - 1 when F x limit is "
                                         "at least 0.5", unit="share", metavar="F",
                                         group=FLOW_GROUP)
    # The channel between proxies (lb.peer.<pool>.<proxy>, docs/proxy.md): 0 turns it off.
    peer_interval_ms: int = setting(
        20, "share this proxy's in-flight counts, prefill backlog and prefix records with the other "
        "proxies on lb.peer.<pool>.<proxy>: at each pick within --peer-pick-ms, otherwise at most once per MS when they "
        "changed; 0: off", unit="ms", metavar="MS", group=PEERS_GROUP)
    peer_stale_ms: int = setting(
        2000, "a peer's message is used this long after it arrived (each proxy's heartbeat is half of it); silent "
        "longer, the snapshot's counts of it are used", unit="ms", metavar="MS", group=PEERS_GROUP)
    peer_stagger_ms: int = setting(
        10, "wait MS per proxy ranked before this one (by proxy id, among those it hears; at most 3) before each "
        "pick, so replicas pick a burst of requests in turn and each hears the others' picks first; 0: no wait",
        unit="ms", metavar="MS", group=PEERS_GROUP)
    peer_pick_ms: int = setting(
        1, "tell the peers a pick MS after it, with every other pick of those MS in the one message (a burst's "
        "picks together; at most one pick message per MS at any rate); 0: each event-loop turn's picks at once",
        unit="ms", metavar="MS", group=PEERS_GROUP)
    # Latency objectives (scheduler/routing/latency.py; docs/proxy.md, "Latency objectives")
    slo_defaults: tuple[str, ...] = setting(
        (), "targets (ms) of a request without x-laswrr-ttft-slo-ms / x-laswrr-tpot-slo-ms, per band or API key: "
        "interactive=1000/50,batch=10000/,key:etl=/200", parse=parse_slo_defaults,
        metavar="SCOPE=TTFT/TPOT[,...]", default_text="none", group=SLO_GROUP)
    slo_serve_late: bool = setting(False, "when no node is predicted to meet a request's objective, serve it anyway "
                                   "instead of 429 slo_unmeetable", negatable=True, group=SLO_GROUP)
    share_latency: bool = setting(False, "learn the latency estimate from every proxy's attempts (LB_EVENTS' request "
                                  "events), one estimate shared by the replicas; off: from this proxy's own",
                                  negatable=True, group=SLO_GROUP)

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
        SloDefaults.parse(self.slo_defaults)  # SloError (a ValueError) names the bad target
        return self

    @property
    def seed(self) -> int:
        return seed_of(self.proxy_id)


def parser_of(field: dataclasses.Field[Any], how: Setting) -> Callable[[str], Any]:
    """The flag's text -> the field's value: ``parse``, a duration in ``unit``, or the field's type."""
    if how.parse is not None:
        return how.parse
    if how.unit in ("s", "ms"):
        return duration(how.unit)
    kind = str(field.type)
    if "float" in kind:
        return float
    if "int" in kind:
        return int
    return str
