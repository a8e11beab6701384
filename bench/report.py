"""Benchmark results: one run per policy -> the JSON summary, the goal checks, the rich table.

Pure apart from ``print_table`` (rich console output). Inputs are what ``bench.runner`` gathered:
the client's per-request results, the weight snapshots seen during the run (relative time,
per-node view), and the analyst report / replay verdict on the run's recorded DuckDB file.

Figures per policy (see ``bench.metrics`` for the definitions):
  * ``phases[name]``: requests, outcomes, P50/P90/P99/max of TTFT and E2E (seconds);
  * ``balance[name]``: time-averaged CoV, max/mean and Jain's index of in-flight/true capacity;
  * ``continued_streams`` and ``continuation_added_ms`` (P50/P99 of the time from a break to
    the next token sent to the client), from ``laswrr report --json``;
  * ``interrupted`` (client-side), ``admitted_to_draining`` (from ``laswrr report --json`` when
    it ran, else counted from the snapshots: a request whose start fell while its node was not
    routable or had effective weight 0 in the latest snapshot the client had seen);
  * ``replay``: the exact-replay verdict.

Goals (docs/design.md §5, "Evidence") are evaluated against round robin when it ran:
  drop_within_1_5x: P99 E2E in the focus phase ≤ 1.5 × steady P99 (announced-drop);
  zero_interruptions, zero_admissions_to_draining; half_of_rr: P99 E2E ≤ 0.5 × rr's
  (over the whole run); lowest_cov: the lowest time-averaged CoV of all policies.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from laswrr.bench.metrics import ClientOutcome, RequestResult, balance, by_phase, latency_summary, node_shares, ratio
from laswrr.bench.scenarios import Scenario


@dataclass(frozen=True, slots=True)
class NodePoint:
    effective_weight: float
    target_weight: float
    inflight: int
    phase: str
    routable: bool


@dataclass(frozen=True, slots=True)
class SnapshotPoint:
    t_s: float  # when the runner received it, from the start of the load
    as_of_seq: int
    nodes: dict[str, NodePoint]


@dataclass(slots=True)
class PolicyRun:
    policy: str
    results: list[RequestResult]
    snapshots: list[SnapshotPoint] = field(default_factory=list)
    report: dict[str, Any] | None = None  # `laswrr report --db --json`
    replay: dict[str, Any] | None = None  # {"ok": bool, "exit": int, "output": str}
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    prefix_cache: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> queried/hit tokens
    view_lag: dict[str, Any] | None = None  # the proxies' laswrr_proxy_view_lag_seconds, merged (runner)


def hit_rate(prefix_cache: dict[str, dict[str, float]]) -> float | None:
    """Hit tokens over queried tokens, summed over the engines; None when nothing was queried."""
    queried = sum(c["queried_tokens"] for c in prefix_cache.values())
    hits = sum(c["hit_tokens"] for c in prefix_cache.values())
    return round(hits / queried, 4) if queried > 0 else None


def admitted_to_draining_from_snapshots(results: Sequence[RequestResult], snapshots: Sequence[SnapshotPoint]
                                        ) -> int:
    """Requests that started on a node the newest snapshot (as the runner saw it) did not route to."""
    times = [s.t_s for s in snapshots]
    count = 0
    for r in results:
        k = bisect_right(times, r.start_s) - 1
        if r.node is None or k < 0:
            continue
        view = snapshots[k].nodes.get(r.node)
        if view is not None and (not view.routable or view.effective_weight <= 0):
            count += 1
    return count


def policy_summary(scenario: Scenario, run: PolicyRun) -> dict[str, Any]:
    phases = list(scenario.phases)
    summary: dict[str, Any] = {
        "policy": run.policy,
        "overall": latency_summary(run.results),
        "phases": by_phase(run.results, phases),
        "balance": balance(run.results, scenario.nodes, scenario.capacity_at(), phases),
        "requests_per_node": node_shares(run.results),
        "prefix_cache_hit_rate": hit_rate(run.prefix_cache),
        "prefix_cache": {node: {**c, "hit_rate": hit_rate({node: c})} for node, c in sorted(run.prefix_cache.items())},
        "interrupted": sum(1 for r in run.results if r.outcome == ClientOutcome.INTERRUPTED),
        "errors": sum(1 for r in run.results if r.outcome == ClientOutcome.ERROR),
        "admitted_to_draining_client": admitted_to_draining_from_snapshots(run.results, run.snapshots),
        "wall_s": round(run.wall_s, 1),
        "notes": list(run.notes),
        "view_lag": run.view_lag,
    }
    report = run.report or {}
    summary["report"] = report or None
    summary["admitted_to_draining"] = report.get("admitted_to_draining", summary["admitted_to_draining_client"])
    summary["report_interrupted"] = report.get("interrupted")
    summary["continued_streams"] = report.get("continued_streams")
    summary["continuation_added_ms"] = {"p50": report.get("continuation_added_ms_p50"),
                                        "p99": report.get("continuation_added_ms_p99")}
    summary["replay"] = run.replay
    return summary


def _p99(summary: dict[str, Any], phase: str | None = None) -> float | None:
    group = summary["overall"] if phase is None else summary["phases"].get(phase, {})
    return group.get("e2e_p99")


def goals(scenario: Scenario, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals for la-swrr, with the numbers they were judged on."""
    la = summaries.get("la-swrr")
    if la is None:
        return {}
    out: dict[str, Any] = {}
    if "steady" in la["phases"] and scenario.focus_phase and scenario.focus_phase != "steady":
        r = ratio(_p99(la, scenario.focus_phase), _p99(la, "steady"))
        out["focus_vs_steady_p99"] = {"value": r, "goal": 1.5, "met": r is not None and r <= 1.5}
    out["zero_interruptions"] = {"value": la["interrupted"], "met": la["interrupted"] == 0}
    adm = la["admitted_to_draining"]
    out["zero_admissions_to_draining"] = {"value": adm, "met": adm == 0}
    rr = summaries.get("rr")
    if rr is not None:
        r = ratio(_p99(la), _p99(rr))
        out["p99_vs_rr"] = {"value": r, "goal": 0.5, "met": r is not None and r <= 0.5}
        if scenario.focus_phase:
            out["focus_p99_vs_rr"] = {"value": ratio(_p99(la, scenario.focus_phase), _p99(rr, scenario.focus_phase)),
                                      "goal": 0.5}
    covs = {p: s["balance"]["overall"]["cov"] for p, s in summaries.items() if s["balance"]["overall"]["cov"] is not None}
    if covs:
        best = min(covs, key=lambda p: covs[p])
        out["lowest_cov"] = {"value": covs.get("la-swrr"), "best": best, "met": best == "la-swrr"}
    return out


def scenario_summary(scenario: Scenario, runs: Sequence[PolicyRun], seed: int, scale: float) -> dict[str, Any]:
    summaries = {run.policy: policy_summary(scenario, run) for run in runs}
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "seed": seed,
        "duration_scale": scale,
        "speed": scenario.speed,
        "util": scenario.util,
        "workload": scenario.workload_spec().as_dict() if scenario.trace is None else None,
        "trace": None if scenario.trace is None else asdict(scenario.trace),
        "engines": [{"node": e.node, "chip": e.chip, "capacity": e.capacity} for e in scenario.engines],
        "phases": [{"name": p.name, "start_s": p.start_s, "end_s": p.end_s} for p in scenario.phases],
        "actions": [{"at_s": a.at_s, "kind": a.kind, "node": a.node, "value": a.value, "announce": a.announce,
                     "label": a.label} for a in scenario.actions],
        "scheduler_config": dict(scenario.scheduler_config or {}),
        "policies": summaries,
        "goals": goals(scenario, summaries),
    }


# --------------------------------------------------------------------------- table


def _fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.2f}{unit}"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row per policy: P99 E2E per phase, P50 E2E overall, P99 TTFT, balance, faults."""
    rows = []
    phase_names = [p["name"] for p in summary["phases"]]
    for policy, s in summary["policies"].items():
        bal = s["balance"]["overall"]
        row = [policy]
        row += [_fmt(s["phases"][name]["e2e_p99"]) for name in phase_names]
        row += [_fmt(s["overall"]["e2e_p50"]), _fmt(s["overall"]["ttft_p50"]), _fmt(s["overall"]["ttft_p99"]),
                _fmt(s.get("prefix_cache_hit_rate")), _fmt(bal["cov"]),
                _fmt(bal["max_mean"]), _fmt(bal["jain"]), str(s["interrupted"]), str(s["admitted_to_draining"]),
                str(s["errors"]), _continued_cell(s), _replay_cell(s["replay"])]
        rows.append(row)
    return rows


def table_header(summary: dict[str, Any]) -> list[str]:
    phase_names = [p["name"] for p in summary["phases"]]
    return (["policy"] + [f"{n} P99" for n in phase_names]
            + ["all P50", "TTFT P50", "TTFT P99", "hit rate", "CoV", "max/mean", "Jain", "interr.", "to drain", "errors",
                  "continued (ms P50/P99)", "replay"])


def _continued_cell(summary: dict[str, Any]) -> str:
    count = summary.get("continued_streams")
    if not count:
        return "—" if count is None else "0"
    added = summary.get("continuation_added_ms") or {}
    return f"{count} ({_fmt(added.get('p50'))}/{_fmt(added.get('p99'))})"


def _replay_cell(replay: dict[str, Any] | None) -> str:
    if replay is None:
        return "—"
    return "exact" if replay.get("ok") else "DIVERGED"


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    replicas = summary.get("proxies", 1)
    through = f" (through {replicas} proxy replicas)" if replicas > 1 else ""
    table = Table(title=f"{summary['scenario']}: {summary['description']}{through}\n"
                        "E2E latency in seconds; CoV, max/mean, Jain of in-flight per unit of true capacity",
                  title_justify="left")
    for i, name in enumerate(table_header(summary)):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in table_rows(summary):
        table.add_row(*row)
    console = Console(width=max(Console().width, 150))
    console.print(table)
    for name, goal in summary["goals"].items():
        met = goal.get("met")
        mark = "" if met is None else ("[green]met[/]" if met else "[red]missed[/]")
        extra = f" (goal {goal['goal']})" if "goal" in goal else ""
        extra += f" best={goal['best']}" if "best" in goal else ""
        console.print(f"  la-swrr {name}: {goal['value']}{extra} {mark}")
