"""Start and stop the real stack for one benchmark run (one policy of one scenario).

Uses ``services.up.Stack`` piece by piece, so every part is a real child process: the embedded
nats-server, ``laswrr scheduler`` (with the scenario's ``--config`` file, if any), ``laswrr
recorder`` writing ``<run_dir>/data/events.duckdb``, one ``laswrr sim-engine`` per node (the
scenario's chips, capacities and ``--speed``; ``--node-id`` = node), registration by publishing
``lb.admin.node.<id>`` (as an operator would), ``laswrr collector`` polling every engine, and one
``laswrr proxy --policy P`` on a free port (``proxies`` > 1: that many replicas, each on its own
port with its own ``--proxy-id`` ``proxy``, ``proxy-2``, ..., all on the one bus; the load
alternates among them). Logs: ``<run_dir>/data/logs/<name>.log``.

The collector also samples every engine's simulated ``npu-smi info`` (AICore %, HBM, Health: the
Ascend signals LA-SWRR reads) at its default 2 s interval, with ``curl`` of the engine's GET
/sim/npu-smi (``services.up.sim_npu_smi_command``), which costs little CPU, unlike the Python
``sim-npu-smi`` fallback when curl is missing (the figures: docs/evidence/code-choices.md).

**Peers.** A policy named ``<router>:<its policy>`` (``vllm-router:power_of_two``,
``sglang-router:cache_aware``, ...) runs the same stack and engines but sends the load through
that router (``vllm-router`` or SGLang's ``sglang-router``, PyPI, Rust; the ``peers`` extra)
instead of our proxy: it knows nothing of the bus, so capacity announcements do not reach it,
exactly as in a deployment. Its responses carry the engine's ``x-sim-node``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from laswrr.bench.load import keys_file_text
from laswrr.bench.scenarios import Scenario
from laswrr.collectors.nodes import Node
from laswrr.schemas.words import NodeRole, PdProtocol
from laswrr.services.children import preexec
from laswrr.services.nats_server import free_port, free_ports
from laswrr.services.up import SIM_MODEL, Stack

log = logging.getLogger("laswrr.bench.stack")


class PeerUnavailable(RuntimeError):
    """A peer router that is not installed, exited or never answered: its row is left out of the
    run with this reason, and the other policies still run."""

PEER_PREFIX = "vllm-router:"  # the default peer
# router -> (the arguments before the common ones, its --log-level word for warnings, whether the
# requests must name the model: sglang-router routes a request without one to model "unknown")
PEER_ROUTERS: dict[str, tuple[tuple[str, ...], str, bool]] = {"vllm-router": ((), "warning", False),
                                                               "sglang-router": (("launch",), "warn", True)}
PEER_START_TIMEOUT_S = 60.0

# ``<policy>+<variant>``: our proxy with extra flags, a row of its own (the overload scenario's
# comparison of flow control against today's default and today's cap).
# ``no-status``: the same proxy, on MindIE engines whose status the collector is not told about
# (no status_url): what la-swrr knows without the status source (docs/ascend.md §5).
# ``flow-noreserve``: flow control without the interactive reserve (an interactive request then
# waits for a release: where the proxies' sharing of freed slots shows, docs/evidence/flow-control.md).
# ``events``: the exact cache view: the proxy with ``--tokenizer`` (the engines' model directory)
# and the nodes registered with their engines' KV event endpoints, ``laswrr kv-events`` running;
# every other row registers the same engines without them (the estimated view). Simulated engines
# publish theirs (``sim-engine --kv-events``) in the tiny model's tokens (``sim_tokenizer``).
# ``decode-only``: a ``vllm`` P/D pool's prompts of at most 512 tokens go whole to a decode node,
# whose engine then prefills them itself (``--pd-local-prefill``; docs/proxy.md, "Short prompts: the decode node alone").
VARIANTS: dict[str, tuple[str, ...]] = {"flow": ("--flow-control",), "cap": ("--inflight-cap-per-capacity", "1"),
                                        "flow-noreserve": ("--flow-control", "--interactive-reserve", "0"),
                                        "no-status": (), "events": (), "decode-only": ("--pd-decode-only-tokens", "512"),
                                        "events-in-flight": ("--kv-in-flight",)}
EXACT_VIEW = ("events", "events-in-flight")  # the variants with the exact cache view (the engines' KV events)


def exact_view(policy: str) -> bool:
    """The row routes on the engines' KV events: ``+events``, or ``+events-in-flight`` (which also
    counts the blocks of the proxy's requests in flight as held, ``--kv-in-flight``)."""
    return policy.partition("+")[2] in EXACT_VIEW


def sim_tokenizer(out: Path) -> Path:
    """The tiny model's tokenizer (bench/tiny_model.py, trained on docs/algorithm.md) in ``out``:
    what a ``+events`` row's simulated engines and proxy count a prompt's tokens with."""
    from laswrr.bench.real_vllm import TRAINING_TEXT
    from laswrr.bench.tiny_model import tokenizer

    if not TRAINING_TEXT.exists():
        raise ValueError(f"the tiny tokenizer's training text {TRAINING_TEXT} is missing (run from a checkout)")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer(TRAINING_TEXT.read_text(encoding="utf-8"), out)
    return out


def split_variant(policy: str) -> tuple[str, tuple[str, ...]]:
    """(the policy, the proxy flags of its variant) for ``la-swrr+flow`` and the like."""
    base, plus, variant = policy.partition("+")
    if not plus:
        return policy, ()
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} of {base!r}; choose from {', '.join(VARIANTS)}")
    return base, VARIANTS[variant]


def peer_of(policy: str) -> tuple[str, str] | None:
    """(router, its policy) for a peer policy name, else None."""
    router, sep, router_policy = policy.partition(":")
    return (router, router_policy) if sep and router in PEER_ROUTERS else None


def is_peer(policy: str) -> bool:
    return peer_of(policy) is not None


def request_model(policy: str, model: str = SIM_MODEL) -> str | None:
    """The ``model`` the load must send through this policy's router (None: send none); ``model``:
    the id the engines serve."""
    peer = peer_of(policy)
    return model if peer is not None and PEER_ROUTERS[peer[0]][2] else None


def peer_binary(router: str) -> str | None:
    candidate = Path(sys.executable).parent / router
    return str(candidate) if candidate.exists() else shutil.which(router)


def vllm_router_binary() -> str | None:
    return peer_binary("vllm-router")


@dataclass
class RunningStack:
    stack: Stack
    proxy_url: str
    engine_urls: dict[str, str]
    db_path: Path
    peers: list[asyncio.subprocess.Process] = field(default_factory=list)
    proxy_urls: list[str] = field(default_factory=list)  # every replica's (the first is ``proxy_url``)
    model: str = SIM_MODEL  # the model id the engines serve
    metrics_urls: list[str] = field(default_factory=list)  # where each replica's (each worker's) /metrics is

    def __post_init__(self) -> None:
        self.proxy_urls = self.proxy_urls or [self.proxy_url]
        self.metrics_urls = self.metrics_urls or self.proxy_urls

    @property
    def nats_url(self) -> str:
        return self.stack.nats_url

    def role_url(self, role: str) -> str:
        """The bus as one of the stack's roles (services/accounts.py): what it may read."""
        return self.stack.role_url(role)


async def start(scenario: Scenario, policy: str, run_dir: Path, config_path: Path | None,
                proxy_args: Sequence[str] = (), proxies: int = 1, engines: Sequence[Node] | None = None,
                model: str = SIM_MODEL, workers: int = 1, tokenizer: str | None = None) -> RunningStack:
    """``engines``: running engines (real vLLM) to register instead of starting simulated ones;
    ``model``: the id they serve; ``workers``: each replica's ``--workers`` (their /metrics on
    consecutive admin ports); ``tokenizer``: their model's directory, for a ``+events`` row.
    A peer router runs the scenario's ``proxies`` instances (the load's entries), which share nothing."""
    events = exact_view(policy)
    if events and tokenizer is None and engines is not None:
        raise ValueError(f"{policy}: the exact cache view needs the engines' tokenizer")
    if events and engines is None:  # simulated engines publish their KV events in the tiny model's tokens
        tokenizer = tokenizer or str(sim_tokenizer(run_dir / "tokenizer"))
    data_dir = run_dir / "data"
    stack = Stack(data_dir, proxy_port=0, config=str(config_path) if config_path else None, proxy_workers=workers)
    peers: list[asyncio.subprocess.Process] = []
    metrics: list[str] = []
    try:
        await stack.start_nats()
        await stack.start_core()
        if engines is None:
            sims = [e.sim for e in scenario.engines]
            protocol = pd_protocol_for(scenario, policy)
            # a proxy that sends short prompts to a decode node alone needs decode engines that prefill
            local = "--pd-decode-only-tokens" in split_variant(policy)[1]
            roles, args = pd_engine_args(scenario, protocol, local_prefill=local)
            nodes = await stack.start_sim_engines(sims, speed=scenario.speed, kv_tokens=scenario.kv_tokens,
                                                  engine_args=args, tokenizer=tokenizer if events else None)
            nodes = [replace(n, **roles[n.id]) if n.id in roles else n for n in nodes]
        else:
            nodes = [n if events else replace(n, extra={k: v for k, v in n.extra.items()
                                                        if k not in ("kv_events", "kv_events_replay")})
                     for n in engines]
        if policy.endswith("+no-status"):  # the engines still serve /v1/status; the collector is not told
            nodes = [replace(n, status_url=None, extra={k: v for k, v in n.extra.items() if k != "status_url"})
                     for n in nodes]
        await stack.register(nodes)
        stack.write_nodes_file(nodes)
        await stack.start_collector()
        await stack.start_kv_events(nodes)
        peer = peer_of(policy)
        if peer is not None:  # instances of a peer router share nothing: each has its own view
            urls = [await start_peer(*peer, nodes, stack.log_dir, peers, model,
                                     name=f"{peer[0]}-{k + 1}" if scenario.proxies > 1 else peer[0])
                    for k in range(scenario.proxies)]
        else:
            base, variant_args = split_variant(policy)
            if events:
                variant_args += ("--tokenizer", str(tokenizer))
            if scenario.tenants:  # each tenant sends its own key: the proxy names them in its events
                keys = run_dir / "keys.txt"
                keys.write_text(keys_file_text([t.name for t in scenario.tenants]))
                variant_args += ("--api-keys", str(keys))
            admins = [free_ports(workers) if workers > 1 else None for _ in range(proxies)]
            urls = list(await asyncio.gather(*(
                stack.start_proxy(port=0, extra_args=("--policy", base, *variant_args, *proxy_args),
                                  name="proxy" if k == 0 else f"proxy-{k + 1}", admin_port=admin)
                for k, admin in enumerate(admins))))
            metrics = [f"http://127.0.0.1:{admin + w}" for admin in admins if admin is not None for w in range(workers)]
    except BaseException:
        await _stop_peers(peers)
        await stack.stop()
        raise
    return RunningStack(stack, urls[0], {n.id: n.url for n in nodes}, stack.data_dir / "events.duckdb", peers,
                        proxy_urls=urls, model=model, metrics_urls=metrics)


# a peer router's prefill/decode mode, and the protocol it speaks (the engines of its row speak it)
PEER_PD: dict[str, tuple[str, str]] = {"vllm-router": ("--vllm-pd-disaggregation", "vllm"),
                                       "sglang-router": ("--pd-disaggregation", "sglang")}


def pd_protocol_for(scenario: Scenario, policy: str) -> str | None:
    """The P/D protocol a row's engines speak: the scenario's, or the peer router's own."""
    if scenario.pd_protocol is None:
        return None
    peer = peer_of(policy)
    return PEER_PD[peer[0]][1] if peer is not None else scenario.pd_protocol


def pd_engine_args(scenario: Scenario, protocol: str | None,
                   local_prefill: bool = False) -> tuple[dict[str, dict[str, object]], dict[str, tuple[str, ...]]]:
    """Per P/D node: its registration's role keys and its sim-engine flags (an sglang prefill
    engine's bootstrap server on a free port; with ``local_prefill``, a vllm decode engine
    serves a request without KV params whole)."""
    roles: dict[str, dict[str, object]] = {}
    args: dict[str, tuple[str, ...]] = {}
    if protocol is None:
        return roles, args
    for engine in scenario.engines:
        if engine.role == NodeRole.BOTH:
            continue
        port = free_port() if protocol == PdProtocol.SGLANG and engine.role == NodeRole.PREFILL else None
        roles[engine.node] = {"role": engine.role, "pd_protocol": protocol, "bootstrap_port": port}
        args[engine.node] = ("--pd-role", engine.role, "--pd-protocol", protocol,
                             *(("--bootstrap-port", str(port)) if port is not None else ()),
                             *(("--pd-local-prefill",) if local_prefill and engine.role == NodeRole.DECODE
                               and protocol == PdProtocol.VLLM else ()))
    return roles, args


def peer_workers(router: str, nodes: list[Node]) -> list[str]:
    """A peer router's worker flags: ``--worker-urls``, or in its P/D mode its prefill nodes (with
    their bootstrap ports) and decode nodes."""
    if all(n.role == NodeRole.BOTH for n in nodes):
        return ["--worker-urls", *[n.url for n in nodes]]
    flags = [PEER_PD[router][0]]
    for node in nodes:
        if node.role == NodeRole.PREFILL:
            flags += ["--prefill", node.url, *([str(node.bootstrap_port)] if node.bootstrap_port else [])]
        elif node.role == NodeRole.DECODE:
            flags += ["--decode", node.url]
    return flags


async def start_peer(router: str, router_policy: str, nodes: list[Node], log_dir: Path,
                     peers: list[asyncio.subprocess.Process], model: str = SIM_MODEL, name: str = "") -> str:
    binary = peer_binary(router)
    if binary is None:
        raise PeerUnavailable(f"{router} is not installed (pip install 'laswrr[peers]')")
    lead, log_level, _ = PEER_ROUTERS[router]
    port = free_port()
    log_path = log_dir / f"{name or router}.log"
    with open(log_path, "ab") as sink:
        proc = await asyncio.create_subprocess_exec(
            binary, *lead, "--host", "127.0.0.1", "--port", str(port), "--policy", router_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *peer_workers(router, nodes), "--log-level", log_level,
            stdin=asyncio.subprocess.DEVNULL, stdout=sink, stderr=sink, start_new_session=True,
            preexec_fn=preexec())
    peers.append(proc)
    url = f"http://127.0.0.1:{port}"
    await _wait_answering(url, proc, router, model, log_path)
    return url


async def _wait_answering(url: str, proc: asyncio.subprocess.Process, router: str, model: str,
                          log_path: Path) -> None:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    if PEER_ROUTERS[router][2]:
        body["model"] = model
    deadline = time.monotonic() + PEER_START_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise PeerUnavailable(f"{router} exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise PeerUnavailable(f"{router} did not answer within {PEER_START_TIMEOUT_S:.0f}s; see {log_path}")


async def _stop_peers(peers: list[asyncio.subprocess.Process]) -> None:
    for proc in peers:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def stop(running: RunningStack) -> None:
    await _stop_peers(running.peers)
    await running.stack.stop()
