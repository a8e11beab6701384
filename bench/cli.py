"""`laswrr bench`: run a scenario for several policies on the identical workload; table, JSON, PNGs.

  laswrr bench --scenario announced-drop [--policies la-swrr,rr,least-request,p2c] [--seed 1]
               [--out bench-out] [--duration-scale 1.0]
  laswrr bench --scenario all        every scenario in turn (not the tiny test ones)
  laswrr bench --list                the scenarios
  laswrr bench --scenario heterogeneous --proxies 4
                                     through 4 proxy replicas on one bus, the requests
                                     alternating among them (as behind an L4 balancer)
  laswrr bench --scenario trace-mooncake [--affinity none]      a real trace (bench/traces/)
  laswrr bench --scenario trace-mooncake --virtual              the same in virtual time (seconds,
                                     deterministic: routing alone, with an oracle row; writes
                                     <out>/<scenario>/virtual.json and no plots)
  laswrr bench --scenario trace-mooncake --virtual --kv-events   and la-swrr on the engines' exact
                                     KV cache view (their KV events; bench/virtual_kv.py)
  laswrr bench --scenario slo-mixed --virtual          latency objectives on a 910C/910B-like pool
                                     (bench/slo_mixed.py; docs/evidence/slo.md)
  laswrr bench --scenario silent-slowdown-mindie --virtual --policies la-swrr,la-swrr+no-status,p2c
                                     a timeline scenario in virtual time with the scheduler's
                                     core in the loop (bench/virtual_timeline.py)
  laswrr bench --engines vllm --scenario cache,cache-plain --repeats 2
                                     the exact cache view on three real vLLM servers
                                     (docs/evidence/cache-view.md)
  laswrr bench --trace FILE [--speed X] [--start-s S] [--window-s W]
                                     a full trace file: Mooncake .jsonl (trace-mooncake's pool)
                                     or Azure .csv (trace-azure-code's pool)

Writes ``<out>/<scenario>/results.json`` (the summary: per policy P50/P99 TTFT and E2E per phase,
load CoV, max/mean, Jain's index, interruptions, admissions to draining nodes, replay verdict,
goal checks), the PNG plots beside it, and per policy ``runs/<policy>/`` (the recorded DuckDB
log, the client's ``requests.jsonl``, the ``snapshots.jsonl`` seen on the bus, service logs).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laswrr.bench.conversations import generate_chat
from laswrr.bench.report import PolicyRun, print_table, scenario_summary
from laswrr.bench.scenarios import SCENARIOS, TEST_SCENARIOS, Scenario, get_scenario
from laswrr.bench.trace import arrival_bursts, load_workload, trace_format
from laswrr.bench import slo_mixed
from laswrr.bench.virtual import bench_virtual
from laswrr.bench.virtual_peers import PEER_DELAY_MS
from laswrr.scheduler.routing.router import PEER_PICK_S
from laswrr.bench.workload import RequestSpec, assign_tenants, generate
from laswrr.scheduler.policies import POLICIES, canonical_policy
from laswrr.services import settings
from laswrr.services.children import interrupt_on_sigterm

log = logging.getLogger("laswrr.bench")

if TYPE_CHECKING:
    from laswrr.bench.runner import Alongside, Restart
    from laswrr.collectors.nodes import Node

DEFAULT_POLICIES = ("la-swrr", "rr", "least-request", "p2c")
DEFAULT_PEER = "vllm-router:power_of_two"  # an extra row when the `peers` extra is installed
PEER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "sticky_least_loaded")
BENCH_SCENARIOS = tuple(name for name in SCENARIOS if name not in TEST_SCENARIOS)
TRACE_SCENARIO = {"mooncake": "trace-mooncake", "azure": "trace-azure-code"}  # --trace FILE without --scenario


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("bench", help="benchmark policies on a scenario against the real stack",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default=None, metavar="NAME",
                        help=f"one of {', '.join(SCENARIOS)}, or 'all' (default announced-drop; with --trace, "
                             "the trace scenario of the file's format)")
    parser.add_argument("--policies", default=None, metavar="LIST",
                        help=f"comma-separated, from {', '.join(POLICIES)}, or vllm-router:<its policy> or "
                             "sglang-router:<its policy> (e.g. sglang-router:cache_aware) "
                             f"(default: all four, plus {DEFAULT_PEER} when vllm-router is installed, plus "
                             "the scenario's own rows: overload adds la-swrr+flow and la-swrr+cap, our proxy "
                             "with --flow-control and with --inflight-cap-per-capacity 1); a row <policy>+<variant> "
                             "is our proxy with a variant's flags (bench/stack_adapter.py, VARIANTS; e.g. "
                             "la-swrr+decode-only on a P/D scenario)")
    parser.add_argument("--no-peers", action="store_true", help="no vllm-router row by default")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out)")
    parser.add_argument("--duration-scale", type=float, default=1.0, metavar="F",
                        help="multiply every phase and action time by F (default 1.0)")
    parser.add_argument("--util", type=float, default=None, metavar="F",
                        help="offered load as a share of the pool's saturation throughput (default: the scenario's)")
    parser.add_argument("--scheduler-config", type=Path, default=None, metavar="FILE.toml",
                        help="scheduler keys ([scheduler] table) for every run, instead of the scenario's")
    parser.add_argument("--spread-bursts", action="store_true",
                        help="trace scenarios: spread the requests that share a time stamp evenly up to the next "
                             "stamp (Mooncake's conversation trace stamps in ~3 s steps; default: sent together)")
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="replay this trace file (Mooncake .jsonl or Azure .csv) in a trace scenario")
    parser.add_argument("--speed", type=float, default=None, metavar="X",
                        help="trace scenarios: replay X times faster than the trace (default: the scenario's)")
    parser.add_argument("--start-s", type=settings.duration("s"), default=None, metavar="S",
                        help="trace scenarios: start S seconds into the trace (default: the scenario's)")
    parser.add_argument("--window-s", type=settings.duration("s"), default=None, metavar="W",
                        help="trace scenarios: replay W seconds of the trace (default: the scenario's; "
                             "with --trace, the whole file)")
    parser.add_argument("--continue-limit", type=int, default=None, metavar="N",
                        help="the proxy's --continue-limit (continuations of a broken stream; 0: off; "
                             "default: the proxy's, 1)")
    parser.add_argument("--affinity", default=None, metavar="MODE",
                        help="proxy prefix affinity for every run: prefix (the proxy's default) or none")
    parser.add_argument("--proxies", type=int, default=1, metavar="N",
                        help="proxy replicas on the one bus, the requests alternating among them as behind an L4 "
                             "balancer (default 1; a peer router runs alone)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="each proxy replica's --workers: N worker processes on its port, sharing their counts "
                             "through the channel between proxies like replicas (default 1; not with --virtual, "
                             "where a worker is a replica: --proxies)")
    parser.add_argument("--peer-interval-ms", type=settings.duration("ms"), default=20, metavar="MS",
                        help="--virtual with --proxies N > 1: the replicas share their counts, prefill backlogs and "
                             "prefix records every MS ms of virtual time, as the proxies' channel between proxies "
                             "does (default 20, the proxy's; 0: no sharing)")
    parser.add_argument("--peer-delay-ms", type=settings.duration("ms"), default=PEER_DELAY_MS, metavar="MS",
                        help="--virtual with --proxies N > 1: each message between the replicas reaches the others MS "
                             "ms of virtual time after it was sent, the bus's delivery time (default 2; "
                             "0: at once)")
    parser.add_argument("--peer-pick-ms", type=settings.duration("ms"), default=PEER_PICK_S * 1000, metavar="MS",
                        help="--virtual with --proxies N > 1: a replica tells its picks MS ms of virtual time after "
                             "the first of them, all in one message, as the proxies' --peer-pick-ms does (default "
                             "1, the proxy's; 0: at once)")
    parser.add_argument("--fleet", type=int, default=1, metavar="K",
                        help="--virtual, trace scenarios: K copies of the scenario's pool and of its trace (each "
                             "copy with its own prefixes, its arrivals falling between the other copies'): K times "
                             "the request rate on K times the engines, each engine as loaded as in one copy "
                             "(default 1)")
    parser.add_argument("--kv-events", action="store_true",
                        help="--virtual, trace scenarios: the simulated engines publish their KV cache changes, as "
                             "laswrr kv-events does for vLLM's, and la-swrr's prefix row gets a twin, affinity "
                             "exact, routing on that exact view with each request's engine token ids "
                             "(bench/virtual_kv.py); on the real stack name a +events row instead "
                             "(--policies la-swrr,la-swrr+events): its simulated engines publish on vLLM's wire")
    parser.add_argument("--virtual", action="store_true",
                        help="run in virtual time through the proxy's routing table and the engines' physics (no "
                             "processes; deterministic, seconds), plus an oracle row: a trace on fixed weights "
                             "(bench/virtual.py), a timeline scenario with the scheduler's core in the loop "
                             "(bench/virtual_timeline.py)")
    parser.add_argument("--engines", choices=("sim", "vllm"), default="sim",
                        help="sim: simulated engines (default); vllm: three real vLLM servers (CPU build, a tiny "
                             "model; --max-num-seqs 8, 4, 2), built and started by bench/real_vllm.py, for "
                             "the heterogeneous, announced-drop, cache, cache-plain, cache-reset and cache-busy scenarios "
                             "(--scenario takes a comma-separated list of them; the cache scenarios run their own rows, "
                             "la-swrr+events, la-swrr, rr, sglang-router:cache_aware; cache-busy la-swrr+events and "
                             "la-swrr+events-in-flight)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="--engines vllm: run the scenarios N times on the same engines (default 1)")
    parser.add_argument("--no-contention", action="store_true",
                        help="--engines vllm: skip the runs of each engine alone (CPU contention)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots (--virtual never draws any)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    settings.add_logging(parser, default="warning")
    parser.set_defaults(func=main)


def _known(name: str) -> str:
    """An alias (``round_robin``) becomes the policy's name; an unknown name stays, to be reported."""
    try:
        return canonical_policy(name)
    except ValueError:
        return name.strip()


def _variant(name: str) -> str:
    """``la_swrr+flow`` -> ``la-swrr+flow`` (bench.stack_adapter.VARIANTS); ValueError on an unknown variant."""
    from laswrr.bench.stack_adapter import split_variant

    base, plus, variant = name.strip().partition("+")
    split_variant(name.strip())
    return _known(base) + plus + variant


def plots_missing() -> str | None:
    """Why plots cannot be drawn (matplotlib is the ``[bench]`` extra, not in the runtime install), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "the plots need matplotlib: pip install 'laswrr[bench]'"
    return None


def parse_policies(text: str | None, peers: bool = True) -> list[str]:
    from laswrr.bench.stack_adapter import PEER_ROUTERS, peer_binary, peer_of, split_variant, vllm_router_binary

    if text is None:
        extra = [DEFAULT_PEER] if peers and vllm_router_binary() is not None else []
        return list(DEFAULT_POLICIES) + extra
    policies = [p.strip() if peer_of(p.strip()) else _variant(p) for p in text.split(",") if p.strip()]
    peers_named = [peer for peer in map(peer_of, policies) if peer is not None]
    unknown = [p for p in policies if split_variant(p)[0] not in POLICIES
               and (peer_of(p) or ("", ""))[1] not in PEER_POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)} "
                         f"or {{{','.join(PEER_ROUTERS)}}}:{{{','.join(PEER_POLICIES)}}}")
    for router, _ in peers_named:
        if peer_binary(router) is None:
            raise ValueError(f"{router} is not installed (pip install 'laswrr[peers]')")
    return policies


def scenario_policies(scenario: Scenario, policies: Sequence[str], named: bool) -> list[str]:
    """The rows a scenario runs: ``policies`` as named (``--policies``), else the default list with
    the scenario's own variant rows around their base policy's row (``Scenario.rows_before``/``_after``)."""
    if named or not (scenario.rows_before or scenario.rows_after):
        return list(policies)
    rows: list[str] = []
    for policy in policies:
        rows += [row for row in scenario.rows_before if row.partition("+")[0] == policy]
        rows.append(policy)
        rows += [row for row in scenario.rows_after if row.partition("+")[0] == policy]
    return rows


def read_scheduler_config(path: Path | None) -> dict[str, Any] | None:
    """The ``[scheduler]`` keys of a TOML file, checked by the scheduler's own validation."""
    if path is None:
        return None
    import tomllib

    from laswrr.scheduler.config import load_file
    from laswrr.schemas.codec import SchemaError

    try:
        load_file(str(path))
    except (SchemaError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    raw = tomllib.loads(path.read_text())
    return dict(raw.get("scheduler", raw))


def scenario_names(text: str) -> list[str]:
    if text == "all":
        return list(BENCH_SCENARIOS)
    get_scenario(text)  # raises ValueError with the valid names
    return [text]


def trace_override(scenario: Scenario, args: argparse.Namespace) -> Scenario:
    """The scenario with --trace/--speed/--start-s/--window-s/--spread-bursts applied (ValueError if it has no trace)."""
    given = [args.trace, args.speed, args.start_s, args.window_s]
    if scenario.trace is None:
        if any(v is not None for v in given) or args.spread_bursts:
            raise ValueError(f"--trace/--speed/--start-s/--window-s/--spread-bursts need a trace scenario, "
                             f"not {scenario.name!r}")
        return scenario
    window = scenario.trace
    if args.trace is not None:
        window = replace(window, path=str(args.trace), window_s=None)
    window = replace(window, **{k: v for k, v in (("speed", args.speed), ("start_s", args.start_s),
                                                   ("window_s", args.window_s)) if v is not None})
    if args.spread_bursts:
        window = replace(window, spread=True)
    window.validate()
    return replace(scenario, trace=window)


def bench_workload(scenario: Scenario, seed: int) -> tuple[Scenario, list[RequestSpec]]:
    """The requests every policy gets: the trace's window, or the workload generated from ``seed``."""
    if scenario.chat is not None:
        return scenario, generate_chat(replace(scenario.chat, duration_s=scenario.duration_s), seed)
    if scenario.trace is None:
        requests = generate(scenario.workload_spec(), seed, [(p.start_s, p.end_s) for p in scenario.phases])
        return scenario, assign_tenants(requests, scenario.tenants, seed) if scenario.tenants else requests
    requests = load_workload(scenario.trace)
    window = scenario.trace
    replay_s = window.window_s / window.speed if window.window_s is not None else requests[-1].offset_s + 1.0
    return scenario.with_trace(window, replay_s), requests


async def bench_scenario(scenario: Scenario, policies: Sequence[str], seed: int, out_dir: Path,
                         scale: float = 1.0, plots: bool = True, util: float | None = None,
                         scheduler_config: dict[str, Any] | None = None,
                         proxy_args: Sequence[str] = (),
                         alongside: dict[str, Alongside] | None = None,
                         proxies: int = 1, engines: Sequence[Node] | None = None,
                         model: str | None = None, workers: int = 1, tokenizer: str | None = None,
                         restart: Restart | None = None) -> tuple[dict[str, Any], list[Path]]:
    """Run every policy on the same workload; write results.json (and plots); return the summary.
    ``alongside``: per policy, a task on its running stack (``runner.run_policy``); ``proxies``:
    proxy replicas the load alternates among; ``engines`` (serving ``model``): running engines
    instead of simulated ones (the summary then also holds ``_runs`` and ``_workload`` for the
    caller, bench/real_bench.py), with their model's ``tokenizer`` directory and a ``restart``
    for their restart actions."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from laswrr.bench.runner import run_policy
    from laswrr.bench.stack_adapter import PeerUnavailable

    scenario = scenario.scaled(scale)
    if util is not None:
        scenario = replace(scenario, util=util)
    if scheduler_config is not None:
        scenario = replace(scenario, scheduler_config=scheduler_config)
    scenario, workload = bench_workload(scenario, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[PolicyRun] = []
    not_run: dict[str, str] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        for policy in policies:
            task = progress.add_task(f"{scenario.name} · {policy:<13}", total=len(workload))
            try:
                runs.append(await run_policy(scenario, policy, workload, out_dir / "runs" / policy.replace(":", "-"),
                                             on_result=lambda _r, t=task: progress.advance(t), proxy_args=proxy_args,
                                             alongside=(alongside or {}).get(policy), proxies=proxies,
                                             engines=engines, model=model, workers=workers,
                                             tokenizer=tokenizer, restart=restart))
            except PeerUnavailable as exc:  # one peer that will not start costs its row, not the run
                not_run[policy] = str(exc)
                progress.update(task, description=f"{scenario.name} · {policy:<13} did not run")
                log.warning("%s/%s did not run: %s", scenario.name, policy, exc)
    summary = scenario_summary(scenario, runs, seed, scale)
    summary["not_run"] = not_run
    summary["proxy_args"] = list(proxy_args)
    summary["proxies"] = proxies
    summary["workers"] = workers
    if scenario.trace is not None:
        summary["trace_arrivals"] = arrival_bursts([r.offset_s for r in workload], scenario.duration_s)
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if engines is not None:
        summary["_runs"] = {run.policy: run for run in runs}
        summary["_workload"] = workload
    paths: list[Path] = []
    if plots:
        from laswrr.bench.plots import plot_all

        paths = plot_all(scenario, runs, summary, out_dir)
    return summary, paths


def main(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "bench")
    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:<16} {scenario.description}")
        print(f"{slo_mixed.NAME:<16} {slo_mixed.DESCRIPTION} (--virtual only)")
        return 0
    if args.scenario == slo_mixed.NAME:  # its own runner: latency objectives, two classes, four loads
        if not args.virtual:
            print(f"bench: {slo_mixed.NAME} runs in virtual time: add --virtual", file=sys.stderr)
            return 2
        out = args.out / slo_mixed.NAME
        out.mkdir(parents=True, exist_ok=True)
        return slo_mixed.main(["--seed", str(args.seed), "--out", str(out / "virtual.json")])
    try:
        policies = parse_policies(args.policies, peers=not args.no_peers)
        if args.engines == "vllm":
            from laswrr.bench.real_bench import real_scenario_names

            if args.trace is not None or args.virtual or args.proxies != 1 or args.workers != 1 or args.util is not None:
                raise ValueError("--engines vllm takes none of --trace, --virtual, --proxies, --workers, --util")
            names = real_scenario_names(args.scenario or "announced-drop")
        elif args.scenario is None and args.trace is not None:
            names = [TRACE_SCENARIO[trace_format(args.trace)]]
        else:
            names = scenario_names(args.scenario or "announced-drop")
        if args.duration_scale <= 0:
            raise ValueError("--duration-scale must be > 0")
        if args.proxies < 1:
            raise ValueError("--proxies must be >= 1")
        if args.workers < 1:
            raise ValueError("--workers must be >= 1")
        if args.fleet != 1 and not args.virtual:
            raise ValueError("--fleet copies a trace scenario in virtual time: add --virtual")
        if args.kv_events and not args.virtual:
            raise ValueError("--kv-events feeds the simulated engines' KV events in virtual time: add --virtual "
                             "(on the real stack: --policies la-swrr,la-swrr+events)")
        if args.kv_events and args.affinity == "none":
            raise ValueError("--kv-events feeds prefix affinity's exact view: not with --affinity none")
        if args.virtual and args.workers != 1:
            raise ValueError("--virtual has no worker processes: a worker routes as a replica does, use --proxies")
        if args.util is not None and not 0 < args.util <= 2:
            raise ValueError("--util must be within (0, 2]")
        scheduler_config = read_scheduler_config(args.scheduler_config)
        scenarios = [] if args.engines == "vllm" else [trace_override(get_scenario(name), args) for name in names]
        if args.util is not None and any(s.trace is not None for s in scenarios):
            raise ValueError("--util does not apply to a trace scenario (the trace sets the load; see --speed)")
        if args.affinity not in (None, "prefix", "none"):
            raise ValueError(f"--affinity must be prefix or none, got {args.affinity!r}")
        proxy_args = () if args.affinity is None else ("--affinity", args.affinity)
        if args.continue_limit is not None:
            if args.continue_limit < 0:
                raise ValueError("--continue-limit must be >= 0")
            proxy_args += ("--continue-limit", str(args.continue_limit))
    except OSError as exc:
        print(f"bench: cannot read {args.scheduler_config}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.virtual:
        try:
            own = [p for p in policies if ":" not in p]  # peer routers are processes: not in virtual time
            # a timeline scenario takes --duration-scale, --util and --scheduler-config as on the real stack
            scenarios = [s if s.trace is not None else replace(
                s.scaled(args.duration_scale), util=s.util if args.util is None else args.util,
                scheduler_config=s.scheduler_config if scheduler_config is None else scheduler_config)
                for s in scenarios]
            return bench_virtual(scenarios, own, args.affinity, args.seed, args.out, args.proxies,
                                 int(args.peer_interval_ms), float(args.peer_delay_ms), args.fleet,
                                 float(args.peer_pick_ms), args.kv_events)
        except ValueError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
    if not args.no_plots and (missing := plots_missing()):
        print(f"bench: {missing} (or --no-plots)", file=sys.stderr)
        return 2
    interrupt_on_sigterm()  # `kill` stops a run like Ctrl-C: the stack is torn down, nothing left behind
    started = time.monotonic()
    if args.engines == "vllm":
        from laswrr.bench.real_bench import bench_real

        code = bench_real(names, policies, args.seed, args.out, args.duration_scale, not args.no_plots, proxy_args,
                          contention=not args.no_contention, repeats=max(1, args.repeats),
                          named=args.policies is not None)
        print(f"bench finished in {time.monotonic() - started:.0f}s")
        return code
    for scenario in scenarios:
        out_dir = args.out / scenario.name
        try:
            rows = scenario_policies(scenario, policies, named=args.policies is not None)
            summary, paths = asyncio.run(bench_scenario(scenario, rows, args.seed, out_dir,
                                                        args.duration_scale, plots=not args.no_plots,
                                                        util=args.util, scheduler_config=scheduler_config,
                                                        proxy_args=proxy_args, proxies=args.proxies,
                                                        workers=args.workers))
        except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
            print(f"bench: {scenario.name}: {exc}", file=sys.stderr)
            return 1
        print_table(summary)
        print(f"results: {out_dir / 'results.json'}")
        for path in paths:
            print(f"plot:    {path}")
    print(f"bench finished in {time.monotonic() - started:.0f}s")
    return 0
