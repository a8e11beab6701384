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
from pathlib import Path
from typing import Any

from laswrr.bench import real_vllm
from laswrr.bench.load import make_session, run_load
from laswrr.bench.metrics import latency_summary
from laswrr.bench.report import print_table
from laswrr.bench.scenarios import REAL_ENGINES, REAL_SCENARIOS, Scenario
from laswrr.bench.workload import RequestSpec


def real_scenario_names(text: str) -> list[str]:
    if text == "all":
        return list(REAL_SCENARIOS)
    if text not in REAL_SCENARIOS:
        raise ValueError(f"--engines vllm runs {', '.join(REAL_SCENARIOS)} (or all), not {text!r}")
    return [text]


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


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def bench_real(names: Sequence[str], policies: Sequence[str], seed: int, out: Path, scale: float,
               plots: bool, proxy_args: Sequence[str], contention: bool = True, repeats: int = 1) -> int:
    """Start the three engines, run every scenario for every policy on them (``repeats`` times:
    ``<out>/repeat-<k>/<scenario>`` when more than once), stop them."""
    from laswrr.bench.cli import bench_scenario

    print(f"starting {len(REAL_ENGINES)} real vLLM engines (--max-num-seqs "
          f"{', '.join(str(e.capacity) for e in REAL_ENGINES)}); 1-3 minutes ...", flush=True)
    try:
        servers = real_vllm.start_engines([e.capacity for e in REAL_ENGINES], out / "vllm-logs",
                                          names=[e.node for e in REAL_ENGINES])
    except real_vllm.VllmUnavailable as exc:
        print(f"bench: vLLM unavailable: {exc}", flush=True)
        return 1
    try:
        print("  " + "; ".join(f"{s.name} {s.url} up in {s.started_s:.0f}s" for s in servers), flush=True)
        nodes = [s.node() for s in servers]
        for name, k in [(name, k) for k in range(1, repeats + 1) for name in names]:
            scenario: Scenario = REAL_SCENARIOS[name]
            out_dir = out / scenario.name if repeats == 1 else out / f"repeat-{k}" / scenario.name
            if repeats > 1:
                print(f"repeat {k} of {repeats}: {scenario.name}", flush=True)
            summary, _ = asyncio.run(bench_scenario(scenario, policies, seed, out_dir, scale, plots=plots,
                                                    proxy_args=proxy_args, engines=nodes,
                                                    model=real_vllm.MODEL_NAME))
            summary["engines_kind"] = "vllm"
            summary["vllm"] = {"version": real_vllm.VLLM_VERSION, "model": str(real_vllm.model_dir()),
                               "started_s": {s.name: round(s.started_s, 1) for s in servers}}
            if contention and k == 1 and "la-swrr" in summary["policies"]:  # once: the engines do not change
                shared = summary.pop("_runs")["la-swrr"]
                workload = summary.pop("_workload")
                summary["alone"] = asyncio.run(alone(servers, workload, shared))
            summary.pop("_runs", None)
            summary.pop("_workload", None)
            (out_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
            print_table(summary)
            if "alone" in summary:
                print_alone(scenario.name, summary["alone"])
            print(f"results: {out_dir / 'results.json'}", flush=True)
    finally:
        real_vllm.stop_all(servers)
    return 0
