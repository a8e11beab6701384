"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed).

* ``weights.png``: effective weight per node over time (target dashed), one panel per policy,
  phases shaded and scenario actions marked;
* ``inflight.png``: client-side in-flight requests per node over time, one panel per policy;
* ``p99.png``: P99 end-to-end latency per phase, one bar per policy;
* ``balance.png``: load variation per policy (time-averaged CoV and max/mean of utilisation).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from laswrr.bench.metrics import inflight_series, sample_times  # noqa: E402
from laswrr.bench.report import PolicyRun  # noqa: E402
from laswrr.bench.scenarios import Scenario  # noqa: E402

PHASE_SHADES = ("#ffffff", "#f3f3f3")


def _decorate(ax: Axes, scenario: Scenario) -> None:
    for i, phase in enumerate(scenario.phases):
        ax.axvspan(phase.start_s, phase.end_s, color=PHASE_SHADES[i % 2], zorder=0)
        ax.text((phase.start_s + phase.end_s) / 2, 1.0, phase.name, transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=8, color="#555555")
    for action in scenario.actions:
        if action.label:
            ax.axvline(action.at_s, color="#d62728", linestyle=":", linewidth=1)
            ax.text(action.at_s, 0.98, " " + action.label, transform=ax.get_xaxis_transform(), rotation=90,
                    va="top", ha="left", fontsize=7, color="#d62728")
    ax.set_xlim(0, scenario.duration_s)
    ax.grid(alpha=0.3)


def _panels(count: int, title: str) -> tuple[Any, list[Axes]]:
    fig, axes = plt.subplots(count, 1, figsize=(10, 2.6 * count + 0.6), sharex=True, squeeze=False)
    fig.suptitle(title)
    return fig, [row[0] for row in axes]


def plot_weights(scenario: Scenario, runs: Sequence[PolicyRun], path: Path) -> Path:
    fig, axes = _panels(len(runs), f"{scenario.name}: effective weight per node (target dashed)")
    for ax, run in zip(axes, runs):
        times = [s.t_s for s in run.snapshots]
        for k, node in enumerate(scenario.nodes):
            color = f"C{k}"
            eff = [s.nodes[node].effective_weight if node in s.nodes else float("nan") for s in run.snapshots]
            tgt = [s.nodes[node].target_weight if node in s.nodes else float("nan") for s in run.snapshots]
            ax.plot(times, eff, color=color, label=node, linewidth=1.4, drawstyle="steps-post")
            ax.plot(times, tgt, color=color, linestyle="--", linewidth=0.7, alpha=0.7, drawstyle="steps-post")
        ax.set_ylim(bottom=0)
        _decorate(ax, scenario)
        ax.set_ylabel(f"{run.policy}\nweight")
        if not run.snapshots:
            ax.text(0.5, 0.5, "no snapshots recorded", transform=ax.transAxes, ha="center")
    axes[0].legend(loc="upper right", fontsize=8, ncol=len(scenario.nodes))
    axes[-1].set_xlabel("time since load start (s)")
    return _save(fig, path)


def plot_inflight(scenario: Scenario, runs: Sequence[PolicyRun], path: Path) -> Path:
    fig, axes = _panels(len(runs), f"{scenario.name}: in-flight requests per node (client side)")
    times = sample_times(0.0, scenario.duration_s, 0.1)
    for ax, run in zip(axes, runs):
        series = inflight_series(run.results, scenario.nodes, times)
        for k, node in enumerate(scenario.nodes):
            ax.plot(times, series[node], color=f"C{k}", label=node, linewidth=1.0)
        _decorate(ax, scenario)
        ax.set_ylabel(f"{run.policy}\nin flight")
    axes[0].legend(loc="upper right", fontsize=8, ncol=len(scenario.nodes))
    axes[-1].set_xlabel("time since load start (s)")
    return _save(fig, path)


def plot_p99(summary: dict[str, Any], path: Path) -> Path:
    policies = list(summary["policies"])
    phases = [p["name"] for p in summary["phases"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        values = [summary["policies"][policy]["phases"][ph]["e2e_p99"] or 0.0 for ph in phases]
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(phases))]
        bars = ax.bar(xs, values, width=width, label=policy, color=f"C{k}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(phases)), phases)
    ax.set_ylabel("P99 end-to-end latency (s)")
    ax.set_title(f"{summary['scenario']}: P99 E2E per phase")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_balance(summary: dict[str, Any], path: Path) -> Path:
    policies = list(summary["policies"])
    covs = [summary["policies"][p]["balance"]["overall"]["cov"] or 0.0 for p in policies]
    ratios = [summary["policies"][p]["balance"]["overall"]["max_mean"] or 0.0 for p in policies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = [f"C{k}" for k in range(len(policies))]
    left.bar_label(left.bar(policies, covs, color=colors), fmt="%.2f", fontsize=8)
    left.set_title("CoV of utilisation (lower = more even)", fontsize=9)
    right.bar_label(right.bar(policies, ratios, color=colors), fmt="%.2f", fontsize=8)
    right.set_title("max / mean utilisation", fontsize=9)
    fig.suptitle(f"{summary['scenario']}: load variation per policy (in-flight / true capacity)")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    return _save(fig, path)


def plot_all(scenario: Scenario, runs: Sequence[PolicyRun], summary: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = scenario.name
    return [
        plot_weights(scenario, runs, out_dir / f"{prefix}-weights.png"),
        plot_inflight(scenario, runs, out_dir / f"{prefix}-inflight.png"),
        plot_p99(summary, out_dir / f"{prefix}-p99.png"),
        plot_balance(summary, out_dir / f"{prefix}-balance.png"),
    ]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
