"""`laswrr demo --out demo-out` (what `make demo` runs): the announced drop, LA-SWRR vs round robin.

Runs the core scenario (four simulated 910B engines, one drops from 10 to 1 slot mid-run, engine
and ``lb.admin.capacity`` together, then returns) once per policy on a fresh stack with the
embedded NATS, on the identical seeded workload; prints the comparison table; runs
``laswrr replay --db`` and ``laswrr report --db`` on LA-SWRR's recorded log (exact replay, zero
interruptions); writes the plots and results into ``--out`` and says where, and
``--out``/dashboard.png: the live dashboard of the LA-SWRR run, taken in headless Chromium
during the drop phase (skipped, saying so, without chromium).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from laswrr.schemas.words import RequestOutcome
from laswrr.services import settings
from laswrr.services.children import interrupt_on_sigterm

DEMO_POLICIES = ("la-swrr", "rr")
# Twice the scenario's 42 s: long enough for round robin's queue on the one-slot node to show in
# the drop phase (28 s of it), short enough for `make demo` to end in a few minutes on a fresh
# 2-core box (the measured time: docs/evidence/code-choices.md).
DEMO_DURATION_SCALE = 2.0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("demo", help="announced-drop demo: LA-SWRR vs round robin, with plots",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default demo-out)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--duration-scale", type=float, default=DEMO_DURATION_SCALE, metavar="F",
                        help=f"stretch the scenario's timeline by F (default {DEMO_DURATION_SCALE:g})")
    settings.add_logging(parser, default="warning")
    parser.set_defaults(func=main)


def dashboard_shot(out: Path, scenario: Any, phase: str = "drop", fraction: float = 0.6) -> Any:
    """A task for ``bench_scenario(alongside=...)``: starts ``laswrr dashboard`` on the running
    stack and, ``fraction`` into ``phase`` of the (scaled) scenario, screenshots the page in
    headless Chromium into ``out``. The browser opens only shortly before, to load the benchmark's
    two cores as little as possible."""
    from laswrr.bench.browser import Browser

    window = next(p for p in scenario.phases if p.name == phase)
    at_s = window.start_s + fraction * (window.end_s - window.start_s)

    async def dashboard_screenshot(stack: Any, t0: float) -> None:
        url = await stack.stack.start_dashboard(0)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, t0 + at_s - 10.0 - loop.time()))
        async with Browser() as browser:
            await browser.goto(url)
            await browser.wait_for("document.querySelectorAll('table.nodes tbody tr').length > 0", timeout_s=8.0)
            await asyncio.sleep(max(0.0, t0 + at_s - loop.time()))
            await browser.screenshot(out)

    return dashboard_screenshot


def _verdict(policy: str, summary: dict[str, Any]) -> list[str]:
    s = summary["policies"][policy]
    lines = []
    replay = s.get("replay")
    if replay is None:
        lines.append(f"{policy}: replay not run (no recorded DuckDB log found)")
    else:
        state = "exact: every snapshot reproduced" if replay["ok"] else f"DIVERGED (exit {replay['exit']})"
        lines.append(f"{policy}: laswrr replay --db → {state}")
        lines += [f"    {line}" for line in replay["output"].splitlines()[-4:]]
    report = s.get("report")
    if report is None:
        lines.append(f"{policy}: laswrr report --db unavailable; client side: "
                     f"{s['interrupted']} interrupted, {s['admitted_to_draining']} admitted to draining")
    else:
        keys = ("requests", RequestOutcome.COMPLETED, RequestOutcome.CLIENT_CANCELLED, RequestOutcome.UPSTREAM_ERROR,
                "interrupted", "admitted_to_draining")
        lines.append(f"{policy}: laswrr report --db → " + ", ".join(f"{k}={report.get(k)}" for k in keys))
    return lines


def main(args: argparse.Namespace) -> int:
    from laswrr.bench.browser import chromium_binary
    from laswrr.bench.cli import bench_scenario, plots_missing
    from laswrr.bench.report import print_table
    from laswrr.bench.scenarios import ANNOUNCED_DROP

    settings.configure_logging(args, "demo")
    if args.duration_scale <= 0:
        print("demo: --duration-scale must be > 0", file=sys.stderr)
        return 2
    if missing := plots_missing():
        print(f"demo: {missing}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()  # `kill` stops the demo like Ctrl-C: the stack is torn down
    started = time.monotonic()
    print(f"demo: {ANNOUNCED_DROP.description}; policies {', '.join(DEMO_POLICIES)}; embedded NATS")
    shot = args.out / "dashboard.png"
    shot.unlink(missing_ok=True)  # what exists afterwards is this run's
    alongside = {}
    if chromium_binary() is not None:
        alongside["la-swrr"] = dashboard_shot(shot, ANNOUNCED_DROP.scaled(args.duration_scale))
    else:
        print(f"demo: no chromium installed (apt-get install chromium): {shot} will not be taken")
    try:
        summary, paths = asyncio.run(bench_scenario(ANNOUNCED_DROP, DEMO_POLICIES, args.seed, args.out,
                                                    args.duration_scale, alongside=alongside))
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    print_table(summary)
    for policy in DEMO_POLICIES:
        print("\n".join(_verdict(policy, summary)))
    print(f"\nresults: {args.out / 'results.json'}")
    for path in paths:
        print(f"plot:    {path}")
    if shot.exists():
        print(f"dashboard during the drop phase: {shot}")
    print(f"demo finished in {time.monotonic() - started:.0f}s")
    la = summary["policies"]["la-swrr"]
    replay_ok = la.get("replay") is None or la["replay"]["ok"]
    return 0 if replay_ok and la["interrupted"] == 0 else 1
