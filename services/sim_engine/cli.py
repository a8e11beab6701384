"""`laswrr sim-engine` (run a simulated Ascend engine) and `laswrr sim-npu-smi` (its npu-smi).

``sim-engine`` binds, prints ``sim-engine listening on http://HOST:PORT`` as its first stdout
line (flushed, so a parent process can read the port when --port 0), then serves until
SIGINT/SIGTERM. Runnable without the dispatcher too: ``python -m laswrr.services.sim_engine.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from laswrr.services import settings
from laswrr.services.sim_engine import npu_smi
from laswrr.services.sim_engine.app import start_server
from laswrr.services.sim_engine.config import FLAVOURS, PD_PROTOCOLS, PD_ROLES, SimConfig
from laswrr.services.sim_engine.profiles import PROFILES

LISTEN_PREFIX = "sim-engine listening on "
_DEFAULTS = SimConfig()  # every default below is the dataclass's


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    engine = subparsers.add_parser("sim-engine", help="run a simulated Ascend inference engine (HTTP)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    engine.add_argument("--chip", default=_DEFAULTS.chip, choices=list(PROFILES),
                        help="chip profile (default %(default)s)")
    engine.add_argument("--capacity", type=int, default=_DEFAULTS.capacity,
                        help="concurrent decode slots (default %(default)s)")
    engine.add_argument("--host", default=_DEFAULTS.host, help="listen address (default %(default)s)")
    engine.add_argument("--model", default=_DEFAULTS.model, help="served model id (default sim-<chip>)")
    engine.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the filler text")
    engine.add_argument("--node-id", default=_DEFAULTS.node_id, help="x-sim-node header value (default <chip>-<port>)")
    engine.add_argument("--speed", type=float, default=_DEFAULTS.speed, help="multiplies every speed (tests: 20)")
    engine.add_argument("--kv-tokens", type=int, default=_DEFAULTS.kv_tokens,
                        help="KV-cache room in tokens (default: profile)")
    engine.add_argument("--pd-role", choices=PD_ROLES, default=_DEFAULTS.pd_role,
                        help="prefill/decode disaggregation: play the prefill or the decode side of "
                             "--pd-protocol (default %(default)s: whole requests)")
    engine.add_argument("--pd-protocol", choices=PD_PROTOCOLS, default=_DEFAULTS.pd_protocol,
                        help="vllm: a prefill answers kv_transfer_params do_remote_decode after its prefill, a "
                             "decode serves only requests carrying a prefill's kv_transfer_params; sglang: both "
                             "legs get bootstrap_host/port/room, the decode pulls the KV from the prefill's "
                             "bootstrap port (default %(default)s)")
    engine.add_argument("--pd-local-prefill", action="store_true",
                        help="a vllm decode instance serves a request without kv_transfer_params whole, "
                             "prefilling it itself (a vLLM decode engine with a kv_both connector); default: "
                             "refused with 400")
    engine.add_argument("--bootstrap-port", type=int, default=_DEFAULTS.bootstrap_port,
                        help="an sglang prefill instance's bootstrap server port (required for one)")
    engine.add_argument("--bootstrap-timeout-s", type=settings.duration("s"), default=_DEFAULTS.bootstrap_timeout_s,
                        help="sglang: how long a decode waits for its bootstrap room and a prefill for its "
                             "decode to take the KV, then fails (default %(default)s)")
    engine.add_argument("--flavour", choices=FLAVOURS, default=_DEFAULTS.flavour,
                        help="vllm, or mindie: MindIE's /metrics names, /v1/status, /v2/status, /metrics-json "
                             "(default %(default)s)")
    engine.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes, metavar="N",
                        help="the largest request body read (default %(default)s: the proxy's --max-body-bytes default)")
    engine.add_argument("--exporter-update-s", type=settings.duration("s"), default=_DEFAULTS.exporter_update_s,
                        help="refresh of the simulated npu-exporter's cache, GET /sim/npu-exporter "
                             "(default %(default)s)")
    engine.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish the prefix cache's KV events on vLLM's wire: the ZMQ PUB endpoint to bind, "
                             "e.g. tcp://127.0.0.1:5557 (default: none)")
    engine.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                        help="the ZMQ ROUTER endpoint replaying the last 10,000 batches (with --kv-events)")
    engine.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="the model's tokenizer directory (tokenizer.json, tokenizer_config.json): chat and "
                             "completion prompts are counted and cached in its tokens, as the proxy's --tokenizer "
                             "computes them (default: the simulator's 4 characters a token)")
    settings.add_logging(engine)
    engine.set_defaults(func=run_engine)

    smi = subparsers.add_parser("sim-npu-smi", help="print `npu-smi info` for a running sim-engine")
    smi.add_argument("--url", required=True, help="sim-engine base URL, e.g. http://127.0.0.1:8001")
    smi.add_argument("--npu-id", type=int, default=0, help="NPU id to print (default 0)")
    smi.set_defaults(func=run_npu_smi)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(chip=args.chip, capacity=args.capacity, host=args.host, port=args.port, model=args.model,
                     seed=args.seed, node_id=args.node_id, speed=args.speed, kv_tokens=args.kv_tokens,
                     flavour=args.flavour, exporter_update_s=args.exporter_update_s, pd_role=args.pd_role,
                     pd_protocol=args.pd_protocol, bootstrap_port=args.bootstrap_port,
                     pd_local_prefill=args.pd_local_prefill,
                     bootstrap_timeout_s=args.bootstrap_timeout_s, max_body_bytes=args.max_body_bytes,
                     kv_events=args.kv_events, kv_events_replay=args.kv_events_replay, tokenizer=args.tokenizer)


async def serve(config: SimConfig) -> None:
    server = await start_server(config)
    print(f"{LISTEN_PREFIX}{server.url}", flush=True)
    stop = settings.stop_event()
    try:
        await stop.wait()
    finally:
        await server.close()


def run_engine(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "sim-engine")
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"sim-engine: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"sim-engine: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def run_npu_smi(args: argparse.Namespace) -> int:
    return npu_smi.run(args.url, args.npu_id)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sim-engine")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
