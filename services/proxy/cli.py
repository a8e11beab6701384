"""`laswrr proxy`: run one OpenAI-compatible proxy replica.

Prints ``proxy listening on http://HOST:PORT`` as its first stdout line (flushed, so a parent
can read the port chosen for --port 0), then serves until SIGINT/SIGTERM: the listening socket
closes at once, in-flight requests get --grace-s to finish, events are flushed,
``lb.proxy.stopped.<proxy-id>`` is published, and the process exits 0. Several replicas may run
side by side (distinct --proxy-id; --reuse-port lets them share one port). --workers N runs N
such processes on one port under a supervising parent, worker k with the proxy id
<proxy-id>-<k> (services/proxy/workers.py); with --admin-port P, worker k serves /metrics and the
probes on P+k.
Runnable without the dispatcher too: ``python -m laswrr.services.proxy.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from laswrr.scheduler.policies import POLICIES, canonical_policy
from laswrr.services.proxy.app import start
from laswrr.services import settings
from laswrr.services.proxy.keys import keys_file_problem
from laswrr.services.proxy.config import AFFINITY_MODES, ProxyConfig, default_proxy_id, parse_size

LISTEN_PREFIX = "proxy listening on "
DEFAULTS = ProxyConfig()  # a slots dataclass: its class attributes are descriptors, not defaults
GC_GEN0_THRESHOLD = 10_000  # CPython's 700 runs a young collection every few requests


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _paths(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_DEFAULTS = ProxyConfig()  # every default below is the dataclass's


def _policy(text: str) -> str:
    try:
        return canonical_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_nats_options(parser)
    settings.add_stream_replicas(parser, default=_DEFAULTS.stream_replicas)
    parser.add_argument("--host", default=_DEFAULTS.host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port,
                        help="listen port; 0 picks a free one (default %(default)s)")
    parser.add_argument("--proxy-id", default=None, help="replica name on the bus and policy seed (default hostname-pid)")
    parser.add_argument("--policy", default=_DEFAULTS.policy, type=_policy, metavar="NAME",
                        help=f"pick policy: {', '.join(POLICIES)}; the peers' round_robin, power_of_two and "
                             "least_request name the same ones (default %(default)s)")
    parser.add_argument("--max-retries", type=int, default=_DEFAULTS.max_retries,
                        help="retries on another node before the first byte (default %(default)s)")
    parser.add_argument("--max-body-bytes", type=_size, default=_DEFAULTS.max_body_bytes,
                        help="request body limit, e.g. 4MiB (default %(default)s bytes)")
    parser.add_argument("--grace-s", type=settings.duration("s"), default=_DEFAULTS.grace_s,
                        help="on SIGTERM, time in-flight requests get to finish (default %(default)s)")
    parser.add_argument("--upstream-timeout-s", type=settings.duration("s"), default=_DEFAULTS.upstream_timeout_s,
                        help="longest silence on an upstream read, not the stream length (default %(default)s)")
    parser.add_argument("--connect-timeout-s", type=settings.duration("s"), default=_DEFAULTS.connect_timeout_s,
                        help="upstream TCP connect timeout (default %(default)s)")
    parser.add_argument("--inflight-cap-per-capacity", type=float, default=_DEFAULTS.inflight_cap_per_capacity,
                        metavar="F", help="a node's in-flight may not exceed ceil(F x capacity); off by default")
    parser.add_argument("--event-buffer", type=int, default=_DEFAULTS.event_buffer,
                        help="events held while NATS is slow or away; the oldest drop beyond (default %(default)s)")
    parser.add_argument("--event-flush-ms", type=settings.duration("ms"), default=_DEFAULTS.event_flush_ms,
                        help="publish a batch of request events this long after its first event at the latest "
                             "(default %(default)s)")
    parser.add_argument("--event-batch-max", type=int, default=_DEFAULTS.event_batch_max, metavar="N",
                        help="publish a batch of request events as soon as N wait, before --event-flush-ms (default "
                             "%(default)s)")
    parser.add_argument("--extra-routes", type=_paths, default=_DEFAULTS.extra_routes, metavar="PATH[,PATH...]",
                        help="more POST paths to route by the body's model, beside the OpenAI ones "
                             "(e.g. /v1/classify,/pooling)")
    parser.add_argument("--continue-limit", type=int, default=DEFAULTS.continue_limit, metavar="N",
                        help="continue a stream broken after its first byte on up to N other nodes; 0: off "
                             "(default %(default)s)")
    parser.add_argument("--pd-decode-only-tokens", type=int, default=DEFAULTS.pd_decode_only_tokens, metavar="N",
                        help="a vllm prefill/decode pool: a request whose prompt is at most N tokens (estimated) "
                             "goes to its decode node alone, no prefill leg; 0: off (default %(default)s)")
    parser.add_argument("--stall-timeout-s", type=settings.duration("s"), default=DEFAULTS.stall_timeout_s,
                        help="a continuable stream silent this long has broken (default %(default)s)")
    parser.add_argument("--idle-timeout-s", type=settings.duration("s"), default=_DEFAULTS.idle_timeout_s,
                        help="close a client connection that has not sent a complete request head for this long "
                             "(idle between requests, or its headers trickling in) (default %(default)s)")
    parser.add_argument("--body-timeout-s", type=settings.duration("s"), default=_DEFAULTS.body_timeout_s,
                        help="answer 408 to a request whose body has not arrived within this (default %(default)s)")
    parser.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT: replicas may share --port")
    parser.add_argument("--workers", type=int, default=_DEFAULTS.workers, metavar="N",
                        help="N proxy processes on one port (SO_REUSEPORT), supervised; worker k is proxy "
                             "<proxy-id>-<k> with its own in-flight counts; with --admin-port P, its /metrics on "
                             "P+k (default %(default)s: this process serves, as <proxy-id>)")
    parser.add_argument("--affinity", default=_DEFAULTS.affinity, choices=list(AFFINITY_MODES),
                        help="la-swrr: send a prompt to the node that holds its prefix while the load guard "
                             "allows (prefix, the default), or never (none)")
    parser.add_argument("--affinity-blocks", type=int, default=_DEFAULTS.affinity_blocks, metavar="N",
                        help="prefix-index keys kept per node, 512 characters (~128 tokens) each; set it to the "
                             "engines' KV room (default %(default)s, ~2 M tokens)")
    flow = parser.add_argument_group("flow control (docs/proxy.md, \"Flow control\")")
    flow.add_argument("--flow-control", action=argparse.BooleanOptionalAction, default=_DEFAULTS.flow_control,
                      help="hold requests no node can take yet (each node's concurrency_limit from the snapshot), "
                           "by priority band and fair between API keys (default: off)")
    flow.add_argument("--queue-bound", type=int, default=_DEFAULTS.queue_bound, metavar="N",
                      help="requests held per pool and band; beyond it 429 queue_full (default %(default)s)")
    flow.add_argument("--queue-ttl-ms", type=settings.duration("ms"), default=_DEFAULTS.queue_ttl_ms, metavar="MS",
                      help="a held request's time to live without x-laswrr-ttl-ms (default %(default)s)")
    flow.add_argument("--queue-ttl-max-ms", type=settings.duration("ms"), default=_DEFAULTS.queue_ttl_max_ms,
                      metavar="MS", help="the most x-laswrr-ttl-ms may ask for (default %(default)s)")
    flow.add_argument("--no-node-wait-ms", type=settings.duration("ms"), default=_DEFAULTS.no_node_wait_ms,
                      metavar="MS", help="no routable node in a pool this long: 503 (default %(default)s)")
    flow.add_argument("--flow-batch-every", type=int, default=_DEFAULTS.flow_batch_every, metavar="N",
                      help="starvation guard: 1 dispatch in N goes to the waiting batch band (default %(default)s)")
    flow.add_argument("--flow-quantum", type=int, default=_DEFAULTS.flow_quantum, metavar="TOKENS",
                      help="deficit round robin between API keys: work a key gains per turn (default %(default)s)")
    flow.add_argument("--retry-after-cap-s", type=settings.duration("s"), default=_DEFAULTS.retry_after_cap_s, metavar="S",
                      help="the largest Retry-After flow control sends (default %(default)s)")
    flow.add_argument("--interactive-reserve", type=float, default=_DEFAULTS.interactive_reserve, metavar="F",
                      help="share of each node's limit only interactive requests may use: default and batch see "
                           "limit - floor(F x limit) (default %(default)s)")
    peers = parser.add_argument_group("the channel between proxies (docs/proxy.md, \"The channel between proxies\")")
    peers.add_argument("--peer-interval-ms", type=settings.duration("ms"), default=_DEFAULTS.peer_interval_ms,
                       metavar="MS", help="share this proxy's in-flight counts, prefill backlog and prefix records "
                                          "with the other proxies on lb.peer.<pool>.<proxy>: at each pick within "
                                          "--peer-pick-ms, otherwise at most once per MS when they changed; 0: off (default "
                                          "%(default)s)")
    peers.add_argument("--peer-stale-ms", type=settings.duration("ms"), default=_DEFAULTS.peer_stale_ms,
                       metavar="MS", help="a peer's message is used this long after it arrived (each proxy's "
                                          "heartbeat is half of it); silent longer, the snapshot's counts of it are "
                                          "used (default %(default)s)")
    peers.add_argument("--peer-stagger-ms", type=settings.duration("ms"), default=_DEFAULTS.peer_stagger_ms,
                       metavar="MS", help="wait MS per proxy ranked before this one (by proxy id, among those it "
                                          "hears; at most 3) before each pick, so replicas pick a burst of requests "
                                          "in turn and each hears the others' picks first; 0: no wait (default "
                                          "%(default)s)")
    peers.add_argument("--peer-pick-ms", type=settings.duration("ms"), default=_DEFAULTS.peer_pick_ms,
                       metavar="MS", help="tell the peers a pick MS after it, with every other pick of those MS in "
                                          "the one message (a burst's picks together; at most one pick message "
                                          "per MS at any rate); 0: each event-loop turn's picks at once (default "
                                          "%(default)s)")
    keys = parser.add_argument_group("client API keys and upstream credentials (services/proxy/keys.py)")
    keys.add_argument("--api-keys", default=os.environ.get("LASWRR_API_KEYS_FILE") or _DEFAULTS.api_keys_file,
                      metavar="FILE", help="clients must send Authorization: Bearer <one of its keys>; one key "
                                           "per line, optionally name:key (default $LASWRR_API_KEYS_FILE; none: open)")
    keys.add_argument("--key-max-inflight", type=int, default=_DEFAULTS.key_max_inflight, metavar="N",
                      help="requests in flight per key; beyond, 429 with Retry-After (default: no limit)")
    keys.add_argument("--forward-authorization", action="store_true",
                      help="pass the client's Authorization header on to the engines (default: dropped)")
    keys.add_argument("--upstream-api-key", default=_DEFAULTS.upstream_api_key, metavar="KEY",
                      help="send Authorization: Bearer KEY to the engines (prefer $LASWRR_UPSTREAM_API_KEY: "
                           "argv is public)")
    parser.add_argument("--admin-port", type=settings.port_number, default=_DEFAULTS.admin_port, metavar="PORT",
                        help="serve /metrics, /health, /healthz and /readiness on this port only (default: "
                             "on --port, open)")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                        help="event loop; auto = uvloop when installed (default %(default)s)")
    settings.add_logging(parser)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("proxy", help="run an OpenAI-compatible LA-SWRR proxy replica",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_proxy)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        nats_url=args.nats_url, host=args.host, port=args.port, proxy_id=args.proxy_id or default_proxy_id(),
        policy=args.policy, max_retries=args.max_retries, max_body_bytes=args.max_body_bytes, grace_s=args.grace_s,
        upstream_timeout_s=args.upstream_timeout_s, connect_timeout_s=args.connect_timeout_s,
        inflight_cap_per_capacity=args.inflight_cap_per_capacity, event_buffer=args.event_buffer,
        event_flush_ms=args.event_flush_ms, event_batch_max=args.event_batch_max,
        reuse_port=args.reuse_port, extra_routes=args.extra_routes, continue_limit=args.continue_limit,
        pd_decode_only_tokens=args.pd_decode_only_tokens,
        stall_timeout_s=args.stall_timeout_s,
        affinity=args.affinity, affinity_blocks=args.affinity_blocks,
        nats_auth=settings.nats_auth(args),
        api_keys_file=args.api_keys, key_max_inflight=args.key_max_inflight,
        forward_authorization=args.forward_authorization, upstream_api_key=args.upstream_api_key,
        admin_port=args.admin_port, stream_replicas=args.stream_replicas, idle_timeout_s=args.idle_timeout_s,
        body_timeout_s=args.body_timeout_s,
        workers=args.workers, flow_control=args.flow_control, queue_bound=args.queue_bound,
        queue_ttl_ms=int(args.queue_ttl_ms), queue_ttl_max_ms=int(args.queue_ttl_max_ms),
        no_node_wait_ms=int(args.no_node_wait_ms), flow_batch_every=args.flow_batch_every,
        flow_quantum=args.flow_quantum, retry_after_cap_s=args.retry_after_cap_s,
        interactive_reserve=args.interactive_reserve,
        peer_interval_ms=int(args.peer_interval_ms), peer_stale_ms=int(args.peer_stale_ms),
        peer_stagger_ms=int(args.peer_stagger_ms), peer_pick_ms=int(args.peer_pick_ms),
    ).validate()


async def serve(config: ProxyConfig) -> None:
    stop = settings.stop_event()  # before the banner: a parent may signal right after it
    proxy = await start(config)
    tune_gc()
    print(f"{LISTEN_PREFIX}{proxy.url}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger("laswrr.proxy").info("signal received: stopping gracefully")
        await proxy.stop()


def tune_gc() -> None:
    """Fewer cyclic-GC passes on the request path (they cost ~5 % of the proxy's CPU at 700).

    Everything alive after start-up (modules, the app) is frozen out of the collector's scans;
    requests free their objects by reference counting, so young collections can be rarer.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def run_proxy(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "proxy")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"proxy: {exc}", file=sys.stderr)
        return 2
    if config.api_keys_file is not None and (problem := keys_file_problem(config.api_keys_file)):
        print(f"proxy: {problem}", file=sys.stderr)
        return 2
    if config.workers > 1:
        if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            print("proxy: --loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
            return 2
        from laswrr.services.proxy.workers import run_group

        return run_group(config, args.loop, args.log_level, args.log_format)
    return serve_config(config, args.loop)


def serve_config(config: ProxyConfig, loop: str) -> int:
    """Serve one proxy on ``config`` until SIGINT/SIGTERM; the exit status."""
    try:
        _run(serve(config), loop)
    except ImportError:
        print("proxy: --loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"proxy: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def _run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """asyncio.run on uvloop when asked (or installed, for ``auto``): it halves the loop's own cost."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                main.close()
                raise
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="laswrr proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_proxy(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
