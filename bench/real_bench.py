"""`laswrr bench --engines vllm`: the benchmark scenarios on three real vLLM servers.

The servers (bench/real_vllm.py: the CPU build, the tiny model; ``--max-num-seqs`` 8, 4 and 2,
registered with those capacities) are started once and serve every policy of every scenario in
turn, each policy on a fresh laswrr stack (runner.run_policy with ``engines``) with the same
seeded workload; before each policy the engines' prefix caches are emptied. The table adds the
engines' own preemptions (``vllm:num_preemptions_total`` over the run).

**CPU contention.** The three engines share this machine's cores, so a request's latency on one
engine includes the others' work. After the policies, every engine is sent alone (the others
idle, no router) exactly the requests la-swrr sent it, at the same offsets: the ``alone`` table
gives each engine's TTFT and E2E then, beside what they were in the shared run. The difference is
what the engines cost each other, not anything a router did.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from laswrr.bench import cache_view, real_vllm
from laswrr.bench.load import make_session, run_load
from laswrr.bench.metrics import latency_summary
from laswrr.bench.report import print_table
from laswrr.bench.scenarios import REAL_BLOCK_TOKENS, REAL_ENGINES, REAL_SCENARIOS, Scenario
from laswrr.bench.workload import RequestSpec


def real_scenario_names(text: str) -> list[str]:
    """``all``, one scenario or a comma-separated list of them."""
    if text == "all":
        return list(REAL_SCENARIOS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in REAL_SCENARIOS]
    if unknown or not names:
        raise ValueError(f"--engines vllm runs {', '.join(REAL_SCENARIOS)} (or all, or a comma-separated list), "
                         f"not {text!r}")
    return names


async def alone(servers: Sequence[real_vllm.VllmServer], workload: Sequence[RequestSpec],
                shared: Any) -> dict[str, Any]:
    """Each engine alone with the requests ``shared`` (a PolicyRun) sent it, at the same offsets."""
    by_index = {spec.index: spec for spec in workload}
    out: dict[str, Any] = {}
    async with make_session() as http:
        for server in servers:
            mine = [r for r in shared.results if r.node == server.name]
            specs = [by_index[r.index] for r in mine]
            if not specs:
                continue
            first = min(s.offset_s for s in specs)
            specs = [_shifted(s, first) for s in specs]
            t0 = asyncio.get_running_loop().time() + 0.2
            run = await run_load(server.url, specs, t0, model=real_vllm.MODEL_NAME, session=http)
            out[server.name] = {"requests": len(specs), "alone": _latency(latency_summary(run.results)),
                                "shared": _latency(latency_summary(mine))}
    return out


def _shifted(spec: RequestSpec, by: float) -> RequestSpec:
    from dataclasses import replace

    return replace(spec, offset_s=round(spec.offset_s - by, 6))


def _latency(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")}


def print_alone(scenario: str, figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{scenario}: each engine alone with the requests la-swrr sent it (CPU contention), "
                        "seconds", title_justify="left")
    for name in ("engine", "requests", "TTFT P50 shared/alone", "TTFT P99 shared/alone", "E2E P50 shared/alone",
                 "E2E P99 shared/alone"):
        table.add_column(name, justify="left" if name == "engine" else "right")
    for node, f in figures.items():
        cells = [f"{_f(f['shared'][k])} / {_f(f['alone'][k])}" for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")]
        table.add_row(node, str(f["requests"]), *cells)
    Console(width=150).print(table)


def print_accuracy(summary: dict[str, Any]) -> None:
    """Per row: the cache view's predicted cached tokens against the engines' (bench/cache_view.py)
    and the latency estimate's accuracy (``laswrr replay --db --latency``), when measured."""
    for policy, s in summary["policies"].items():
        if s.get("cache_view") is not None:
            print("cache view: " + cache_view.line(policy, s["cache_view"]), flush=True)
        figures = ((s.get("latency_estimate") or {}).get("accuracy") or {}).get("all")
        if figures:
            print(f"latency estimate: {policy}: {figures['attempts']} attempts, TTFT abs error P50 "
                  f"{figures['ttft_p50_ms']} ms / P90 {figures['ttft_p90_ms']} ms (measured median "
                  f"{figures['measured_ttft_p50_ms']} ms); TPOT abs error P50 {figures['tpot_p50_ms']} ms / "
                  f"P90 {figures['tpot_p90_ms']} ms", flush=True)


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def engine_options(scenario: Scenario) -> dict[str, Any]:
    """The engine flags a scenario needs (``real_vllm.server``'s options): its KV room in blocks
    (``--num-gpu-blocks-override``) and whether they publish their KV cache events."""
    blocks = None if scenario.kv_tokens is None else scenario.kv_tokens // REAL_BLOCK_TOKENS
    return {"num_blocks": blocks, "kv_events": scenario.kv_events}


def engine_groups(names: Sequence[str]) -> list[tuple[dict[str, Any], list[str]]]:
    """The scenarios by the engine flags they need, in order of first appearance: one start of
    the engines per group."""
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for name in names:
        options = engine_options(REAL_SCENARIOS[name])
        group = next((g for g in groups if g[0] == options), None)
        if group is None:
            groups.append((options, [name]))
        else:
            group[1].append(name)
    return groups


def bench_real(names: Sequence[str], policies: Sequence[str], seed: int, out: Path, scale: float,
               plots: bool, proxy_args: Sequence[str], contention: bool = True, repeats: int = 1,
               named: bool = True) -> int:
    """Start the three engines, run every scenario for every policy on them (``repeats`` times:
    ``<out>/repeat-<k>/<scenario>`` when more than once), stop them. Scenarios needing other
    engine flags (a small KV room, KV events) get engines of their own. ``named``: ``policies``
    were named (--policies), else a scenario with rows of its own runs those."""
    for options, group in engine_groups(names):
        code = _bench_group(group, options, policies, seed, out, scale, plots, proxy_args, contention, repeats,
                            named)
        if code:
            return code
    return 0


def _bench_group(names: Sequence[str], options: dict[str, Any], policies: Sequence[str], seed: int, out: Path,
                 scale: float, plots: bool, proxy_args: Sequence[str], contention: bool, repeats: int,
                 named: bool) -> int:
    from laswrr.bench.cli import bench_scenario

    flags = "".join([f", --num-gpu-blocks-override {options['num_blocks']}" if options["num_blocks"] else "",
                     ", KV events" if options["kv_events"] else ""])
    print(f"starting {len(REAL_ENGINES)} real vLLM engines (--max-num-seqs "
          f"{', '.join(str(e.capacity) for e in REAL_ENGINES)}{flags}); 1-3 minutes ...", flush=True)
    try:
        servers = real_vllm.start_engines([e.capacity for e in REAL_ENGINES], out / "vllm-logs",
                                          names=[e.node for e in REAL_ENGINES], **options)
    except real_vllm.VllmUnavailable as exc:
        print(f"bench: vLLM unavailable: {exc}", flush=True)
        return 1
    # a restarted engine's processes end with the thread that started them (PR_SET_PDEATHSIG):
    # restarts run on one thread that lives until the engines are stopped
    restarter = ThreadPoolExecutor(1, thread_name_prefix="vllm-restart")
    by_name = {s.name: s for s in servers}

    async def restart(node: str) -> None:
        await asyncio.get_running_loop().run_in_executor(restarter, by_name[node].restart)

    try:
        print("  " + "; ".join(f"{s.name} {s.url} up in {s.started_s:.0f}s" for s in servers), flush=True)
        nodes = [s.node() for s in servers]
        for name, k in [(name, k) for k in range(1, repeats + 1) for name in names]:
            scenario: Scenario = REAL_SCENARIOS[name]
            out_dir = out / scenario.name if repeats == 1 else out / f"repeat-{k}" / scenario.name
            if repeats > 1:
                print(f"repeat {k} of {repeats}: {scenario.name}", flush=True)
            rows = list(scenario.rows) if scenario.rows and not named else list(policies)
            summary, _ = asyncio.run(bench_scenario(scenario, rows, seed, out_dir, scale, plots=plots,
                                                    proxy_args=proxy_args, engines=nodes,
                                                    model=real_vllm.MODEL_NAME, proxies=scenario.proxies,
                                                    tokenizer=str(real_vllm.model_dir()), restart=restart))
            summary["engines_kind"] = "vllm"
            summary["vllm"] = {"version": real_vllm.VLLM_VERSION, "model": str(real_vllm.model_dir()),
                               "started_s": {s.name: round(s.started_s, 1) for s in servers},
                               "num_gpu_blocks": options["num_blocks"], "kv_events": options["kv_events"]}
            # once (the engines do not change); not where the run restarts an engine or is about caches
            if contention and k == 1 and "la-swrr" in summary["policies"] and scenario.chat is None:
                shared = summary.pop("_runs")["la-swrr"]
                workload = summary.pop("_workload")
                summary["alone"] = asyncio.run(alone(servers, workload, shared))
            summary.pop("_runs", None)
            summary.pop("_workload", None)
            (out_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
            print_table(summary)
            print_accuracy(summary)
            if "alone" in summary:
                print_alone(scenario.name, summary["alone"])
            print(f"results: {out_dir / 'results.json'}", flush=True)
    finally:
        real_vllm.stop_all(servers)
        restarter.shutdown()
    return 0
