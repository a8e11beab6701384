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

Goals (docs/evidence/README.md) are evaluated against round robin when it ran:
  drop_within_1_5x: P99 E2E in the focus phase ≤ 1.5 × steady P99 (announced-drop);
  zero_interruptions, zero_admissions_to_draining; half_of_rr: P99 E2E ≤ 0.5 × rr's
  (over the whole run); lowest_cov: the lowest time-averaged CoV of all policies.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from laswrr.bench.metrics import ClientOutcome, RequestResult, balance, by_phase, latency_summary, node_shares, ratio, tenant_summary
from laswrr.bench.scenarios import Scenario
from laswrr.schemas.words import Band, NpuHealth, Phase


@dataclass(frozen=True, slots=True)
class NodePoint:
    effective_weight: float
    target_weight: float
    inflight: int
    phase: Phase  # the node's phase in the snapshot
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
    channel: dict[str, Any] | None = None  # the channel between proxies' traffic against the events' (runner)
    preemptions: dict[str, float] = field(default_factory=dict)  # node -> the engine's own preemptions in the run
    cache_view: dict[str, Any] | None = None  # the view's predicted cached tokens against the engines' (cache_view.py)
    latency: dict[str, Any] | None = None  # `laswrr replay --db --latency --json`


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


def silent_loss(scenario: Scenario) -> tuple[str, float, float] | None:
    """(node, when, its new slots) of the scenario's unannounced slot loss at the start of its
    focus phase (silent-slowdown*), else None."""
    focus = next((p for p in scenario.phases if p.name == scenario.focus_phase), None)
    if focus is None:
        return None
    for action in scenario.actions:
        if action.kind == "capacity" and not action.announce and action.at_s == focus.start_s:
            return action.node, action.at_s, float(action.value)
    return None


def slowed_node(scenario: Scenario, run: PolicyRun) -> dict[str, Any] | None:
    """What a policy did with the silently slowed node: requests sent to it during the focus phase
    (count and share), and for la-swrr (which publishes weights) the seconds from the loss to the
    first snapshot whose target weight for it is at most half its target just before the loss."""
    loss = silent_loss(scenario)
    if loss is None:
        return None
    node, at_s, _ = loss
    focus = next(p for p in scenario.phases if p.name == scenario.focus_phase)
    in_focus = [r for r in run.results if focus.start_s <= r.start_s < focus.end_s]
    sent = sum(1 for r in in_focus if r.node == node)
    before = [p.nodes[node].target_weight for p in run.snapshots if p.t_s < at_s and node in p.nodes]
    reaction = None
    if before and ":" not in run.policy:  # a peer router does not route on the scheduler's weights
        threshold = before[-1] / 2
        reaction = next((round(p.t_s - at_s, 3) for p in run.snapshots
                         if p.t_s >= at_s and node in p.nodes and p.nodes[node].target_weight <= threshold), None)
    return {"node": node, "requests_in_focus": sent,
            "share_in_focus": round(sent / len(in_focus), 4) if in_focus else None, "weight_reaction_s": reaction}


def fault_reaction(scenario: Scenario, run: PolicyRun) -> dict[str, Any] | None:
    """For a scenario whose focus phase starts with an NPU fault (``fault_code`` or a ``health``
    of Alarm/Critical): the seconds from it to the first snapshot in which the node is no longer
    routable (drained or ejected), and the requests sent to it in the focus phase after that."""
    focus = next((p for p in scenario.phases if p.name == scenario.focus_phase), None)
    action = next((a for a in scenario.actions if focus is not None and a.at_s == focus.start_s and (
        (a.kind == "fault_code" and a.value) or (a.kind == "health" and a.value in (NpuHealth.ALARM, NpuHealth.CRITICAL)))), None)
    if focus is None or action is None:
        return None
    out_at = next((p.t_s for p in run.snapshots if p.t_s >= action.at_s and action.node in p.nodes
                   and not p.nodes[action.node].routable), None)
    return {"node": action.node, "out_after_s": None if out_at is None else round(out_at - action.at_s, 3),
            "requests_in_focus": sum(1 for r in run.results if r.node == action.node
                                     and focus.start_s <= r.start_s < focus.end_s)}


def workload_of(scenario: Scenario) -> dict[str, Any] | None:
    """The generated workload's parameters (a chat workload's under ``chat``); None for a trace."""
    if scenario.chat is not None:
        return {"chat": asdict(replace(scenario.chat, duration_s=scenario.duration_s))}
    return scenario.workload_spec().as_dict() if scenario.trace is None else None


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
        "preemptions": int(sum(run.preemptions.values())) if run.preemptions else None,
        "preemptions_per_node": {node: int(n) for node, n in sorted(run.preemptions.items())},
        "interrupted": sum(1 for r in run.results if r.outcome == ClientOutcome.INTERRUPTED),
        "errors": sum(1 for r in run.results if r.outcome == ClientOutcome.ERROR),
        "admitted_to_draining_client": admitted_to_draining_from_snapshots(run.results, run.snapshots),
        "wall_s": round(run.wall_s, 1),
        "notes": list(run.notes),
        "view_lag": run.view_lag,
        "channel": run.channel,
        "slowed_node": slowed_node(scenario, run),
        "faulty_node": fault_reaction(scenario, run),
        "cache_view": run.cache_view,
        "latency_estimate": run.latency,
    }
    report = run.report or {}
    summary["report"] = report or None
    summary["admitted_to_draining"] = report.get("admitted_to_draining", summary["admitted_to_draining_client"])
    summary["report_interrupted"] = report.get("interrupted")
    summary["continued_streams"] = report.get("continued_streams")
    summary["continuation_added_ms"] = {"p50": report.get("continuation_added_ms_p50"),
                                        "p99": report.get("continuation_added_ms_p99")}
    summary["replay"] = run.replay
    if scenario.tenants:
        summary["tenants"] = tenant_summary(run.results, scenario.duration_s)
        summary["tenants"]["over_slots"] = over_slots(run.snapshots, {e.node: e.capacity for e in scenario.engines},
                                                      scenario.duration_s)
    return summary


def over_slots(snapshots: Sequence[SnapshotPoint], slots: dict[str, int], window_s: float) -> dict[str, Any]:
    """How far the pool-wide in-flight count (the scheduler's, per snapshot) went beyond each
    node's slots during the window: the overshoot of late binding on counts of several proxies
    (with flow control and the default factor the slot limit is the node's slots)."""
    inside = [p for p in snapshots if 0 <= p.t_s <= window_s]
    over = [max(0, n.inflight - slots.get(node, 0)) for p in inside for node, n in p.nodes.items() if node in slots]
    busy = [p for p in inside if any(n.inflight > slots.get(node, 0) for node, n in p.nodes.items() if node in slots)]
    return {"snapshots": len(inside), "max_over": max(over, default=0),
            "mean_over_per_node": round(sum(over) / len(over), 3) if over else None,
            "share_of_snapshots_over": round(len(busy) / len(inside), 3) if inside else None}


def _p99(summary: dict[str, Any], phase: str | None = None) -> float | None:
    group = summary["overall"] if phase is None else summary["phases"].get(phase, {})
    return group.get("e2e_p99")


def _ttft_p99(summary: dict[str, Any], phase: str) -> float | None:
    return summary["phases"].get(phase, {}).get("ttft_p99")


def overload_goals(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The flow-control goals (the overload scenario) for ``la-swrr+flow``, against ``la-swrr``."""
    flow = summaries.get("la-swrr+flow")
    if flow is None:
        return {}
    t = flow["tenants"]
    out: dict[str, Any] = {}
    p99 = (t["per_priority"].get(Band.INTERACTIVE) or {}).get("ttft_p99")
    out["interactive_ttft_p99_s"] = {"value": p99, "goal": 1.0, "met": p99 is not None and p99 <= 1.0}
    jain_value = t["jain_of_fair_share"]
    out["jain_of_max_min_fair_share"] = {"value": jain_value, "goal": 0.9,
                                         "met": jain_value is not None and jain_value >= 0.9}
    base = summaries.get("la-swrr")
    if base is not None:
        r = ratio(t["total_goodput_tps"], base["tenants"]["total_goodput_tps"])
        out["goodput_vs_default"] = {"value": r, "goal": 0.95, "met": r is not None and r >= 0.95}
    out["no_5xx"] = {"value": t["answered_5xx"], "met": t["answered_5xx"] == 0}
    out["no_cut"] = {"value": flow["interrupted"], "met": flow["interrupted"] == 0}
    replay = flow.get("replay") or {}
    out["replay_exact"] = {"value": replay.get("ok"), "met": bool(replay.get("ok"))}
    return out


def goals(scenario: Scenario, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The scenario's goals for la-swrr, with the numbers they were judged on."""
    if scenario.tenants:
        return overload_goals(summaries)
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
    out.update(status_goals(scenario, summaries))
    faulty = la.get("faulty_node")
    if faulty is not None and any(e.flavour == "mindie" for e in scenario.engines):
        value = faulty["out_after_s"]  # within two exporter refreshes of the change (5 s each)
        out["unhealthy_chip_out_s"] = {"value": value, "goal": 12.0, "met": value is not None and value <= 12.0}
    covs = {p: s["balance"]["overall"]["cov"] for p, s in summaries.items() if s["balance"]["overall"]["cov"] is not None}
    if covs:
        best = min(covs, key=lambda p: covs[p])
        out["lowest_cov"] = {"value": covs.get("la-swrr"), "best": best, "met": best == "la-swrr"}
    return out


def status_goals(scenario: Scenario, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goals on a silent slot loss of MindIE engines: the loss believed within one status
    poll (the weight halved within 1 s), focus-phase E2E P99 <= 0.9x la-swrr without the status
    source and <= 0.5x the best peer router (vllm-router/sglang-router rows); and the same two
    ratios on TTFT P99, what the slowed node's queue shows in (the E2E tail of this workload is
    set by the longest decodes on the healthy nodes: docs/ascend.md §9)."""
    la, without = summaries.get("la-swrr"), summaries.get("la-swrr+no-status")
    if la is None or la.get("slowed_node") is None or not any(e.flavour == "mindie" for e in scenario.engines):
        return {}
    out: dict[str, Any] = {}
    reaction = la["slowed_node"]["weight_reaction_s"]
    out["loss_believed_s"] = {"value": reaction, "goal": 1.0, "met": reaction is not None and reaction <= 1.0}
    focus = scenario.focus_phase
    if without is not None:
        r = ratio(_p99(la, focus), _p99(without, focus))
        out["focus_p99_vs_no_status"] = {"value": r, "goal": 0.9, "met": r is not None and r <= 0.9,
                                         "no_status_reaction_s": (without.get("slowed_node") or {}).get("weight_reaction_s")}
    peers = {p: _p99(s, focus) for p, s in summaries.items() if ":" in p and _p99(s, focus) is not None}
    if peers:
        best = min(peers, key=lambda p: peers[p])  # type: ignore[arg-type,return-value]
        r = ratio(_p99(la, focus), peers[best])
        out["focus_p99_vs_best_peer"] = {"value": r, "best": best, "goal": 0.5, "met": r is not None and r <= 0.5}
    ttft = {p: _ttft_p99(s, focus) for p, s in summaries.items() if ":" in p and _ttft_p99(s, focus) is not None}
    if ttft:
        best = min(ttft, key=lambda p: ttft[p])  # type: ignore[arg-type,return-value]
        r = ratio(_ttft_p99(la, focus), ttft[best])
        out["focus_ttft_p99_vs_best_peer"] = {"value": r, "best": best, "goal": 0.5, "met": r is not None and r <= 0.5}
    if without is not None:
        r = ratio(_ttft_p99(la, focus), _ttft_p99(without, focus))
        out["focus_ttft_p99_vs_no_status"] = {"value": r, "goal": 0.9, "met": r is not None and r <= 0.9}
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
        "workload": workload_of(scenario),
        "trace": None if scenario.trace is None else asdict(scenario.trace),
        "engines": [{"node": e.node, "chip": e.chip, "capacity": e.capacity, "flavour": e.flavour}
                    for e in scenario.engines],
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
                _fmt(bal["max_mean"]), _fmt(bal["jain"]), _count(s.get("preemptions")), str(s["interrupted"]),
                str(s["admitted_to_draining"]),
                str(s["errors"]), _continued_cell(s), _replay_cell(s["replay"])]
        if any(p.get("slowed_node") for p in summary["policies"].values()):
            row.append(_slowed_cell(s.get("slowed_node")))
        rows.append(row)
    return rows


def table_header(summary: dict[str, Any]) -> list[str]:
    phase_names = [p["name"] for p in summary["phases"]]
    slowed = ["to slowed node (share; weight halved after)"] if any(
        p.get("slowed_node") for p in summary["policies"].values()) else []
    return (["policy"] + [f"{n} P99" for n in phase_names]
            + ["all P50", "TTFT P50", "TTFT P99", "hit rate", "CoV", "max/mean", "Jain", "preempt.", "interr.", "to drain",
               "errors",
                  "continued (ms P50/P99)", "replay"] + slowed)


def _drain_line(drain: dict[str, Any]) -> str:
    """A drain of the run as `laswrr report` has it: how long to drained, and how long the node
    stayed draining after its last attempt (a P/D leg counts on its own node) ended."""
    if drain["by"] is None:
        return f"{drain['node']} draining, not drained by the end of the run"
    if drain["by"] == "deadline":
        return f"{drain['node']} drained by the drain deadline {drain['duration_ms'] / 1000:.2f} s after the drain"
    last = drain["last_attempt_ts_ns"]
    if last is None or last <= drain["started_ts_ns"]:
        return (f"{drain['node']} drained {drain['duration_ms'] / 1000:.2f} s after the drain "
                "(nothing was in flight on it)")
    later = drain["later_legs"]
    return (f"{drain['node']} drained {drain['duration_ms'] / 1000:.2f} s after the drain, "
            f"{drain['after_last_attempt_ms']:.0f} ms after its last attempt ended"
            + (f"; {later} legs of its requests ended elsewhere after that" if later else ""))


def _slowed_cell(slowed: dict[str, Any] | None) -> str:
    if not slowed:
        return "—"
    share = "—" if slowed["share_in_focus"] is None else f"{slowed['share_in_focus'] * 100:.1f} %"
    reaction = "" if slowed["weight_reaction_s"] is None else f"; {slowed['weight_reaction_s']:.2f} s"
    return f"{slowed['requests_in_focus']} ({share}{reaction})"


def _count(value: int | None) -> str:
    return "—" if value is None else str(value)


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

    replicas, workers = summary.get("proxies", 1), summary.get("workers", 1)
    through = f" (through {replicas} proxy replicas)" if replicas > 1 else ""
    through += f" ({workers} workers each)" if workers > 1 else ""
    table = Table(title=f"{summary['scenario']}: {summary['description']}{through}\n"
                        "E2E latency in seconds; CoV, max/mean, Jain of in-flight per unit of true capacity",
                  title_justify="left")
    for i, name in enumerate(table_header(summary)):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in table_rows(summary):
        table.add_row(*row)
    console = Console(width=max(Console().width, 150))
    console.print(table)
    for policy, reason in summary.get("not_run", {}).items():
        console.print(f"  {policy}: did not run: {reason}")
    for name, goal in summary["goals"].items():
        met = goal.get("met")
        mark = "" if met is None else ("[green]met[/]" if met else "[red]missed[/]")
        extra = f" (goal {goal['goal']})" if "goal" in goal else ""
        extra += f" best={goal['best']}" if "best" in goal else ""
        row = "la-swrr+flow" if summary["policies"].get("la-swrr+flow", {}).get("tenants") else "la-swrr"
        console.print(f"  {row} {name}: {goal['value']}{extra} {mark}")
    for policy, s in summary["policies"].items():
        c = s.get("channel")
        if c and c["messages"]:
            console.print(f"  {policy}: channel between proxies {c['messages']} messages ({c['whole']} whole views), "
                          f"{c['bytes_per_message']} B each with the subject, {c['bytes']} B = "
                          f"{100 * (c['share_of_event_bytes'] or 0):.0f} % of the request events' {c['event_bytes']} B"
                          + (f"; taken {c['lag']['mean_s'] * 1000:.1f} ms after they were sent on average "
                             f"(P99 <= {c['lag']['p99_le_s'] * 1000:g} ms)" if c.get("lag") else ""))
        for drain in (s.get("report") or {}).get("drains") or []:
            console.print(f"  {policy}: {_drain_line(drain)}")
        t = s.get("tenants")
        if t:
            keys = ", ".join(f"{k} {v['goodput_tps']:.0f}/{v['fair_tps']:.0f}" for k, v in t["per_key"].items())
            ttft = ", ".join(f"{p} {v['ttft_p99']}" for p, v in t["per_priority"].items())
            over = t.get("over_slots") or {}
            console.print(f"  {policy}: goodput {t['total_goodput_tps']} tok/s, Jain of fair share "
                          f"{t['jain_of_fair_share']}; per key goodput/fair tok/s: {keys}; TTFT P99 by band: {ttft}; "
                          f"statuses {t['statuses']}; in flight beyond the slots: max {over.get('max_over')}, "
                          f"in {over.get('share_of_snapshots_over')} of the snapshots")
