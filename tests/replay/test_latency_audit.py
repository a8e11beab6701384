"""End to end: the latency estimate of a real recorded run is replayable. A real stack (nats-server,
scheduler, recorder, collector, a proxy with flow control and latency objectives, two simulated
engines of different chips, all child processes of ``services.up.Stack``) serves streamed requests
with and without targets, held ones among them, and one no node can meet (429 ``slo_unmeetable``).
Afterwards ``laswrr replay --db PATH --latency`` refolds the recorded request events, makes every
recorded prediction again and finds each one equal, and reports the estimate's accuracy per node;
the core's replay of the same log stays byte-identical."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.replay_cli import replay_exact
from tests.sim_stack import simulated_stack

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"
NODES = (("fast", "910C", 2), ("slow", "910", 2))  # 910C prefills 2.7x as fast as 910 (sim profiles)


async def ask(http: aiohttp.ClientSession, url: str, words: int, headers: dict[str, str]) -> int:
    """One streamed request, read to its end; its status."""
    body = {"messages": [{"role": "user", "content": "tell me about the sea " * words}], "max_tokens": 12,
            "stream": True}
    async with http.post(url + CHAT, json=body, headers=headers) as response:
        await response.read()
        return response.status


def latency_report(db: Path) -> dict[str, object]:
    """``laswrr replay --db DB --latency --json`` as an analyst runs it (NATS pointed at a closed port:
    the stack is stopped, the file is read directly)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "LASWRR_"))}
    env["NATS_URL"] = "nats://127.0.0.1:1"
    done = subprocess.run([sys.executable, "-m", "laswrr", "replay", "--db", str(db), "--latency", "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    report: dict[str, object] = json.loads(done.stdout)
    return report


async def test_a_recorded_run_refolds_to_every_recorded_prediction(tmp_path: Path) -> None:
    statuses: list[int] = []
    async with simulated_stack(tmp_path / "stack", NODES, speed=10.0, tick_ms=100,
                               proxy_args=("--flow-control", "--slo-defaults", "batch=60000/")) as stack:
        url = await stack.start_proxy()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for wave in range(6):  # 8 at a time on 4 slots: some are held, then dispatched
                targets = [{}, {"x-laswrr-priority": "batch"}, {"x-laswrr-ttft-slo-ms": "60000"},
                           {"x-laswrr-ttft-slo-ms": "60000", "x-laswrr-tpot-slo-ms": "5000"}]
                statuses += await asyncio.gather(*(ask(http, url, 20 + 150 * ((wave + i) % 5), targets[i % 4])
                                                   for i in range(8)))
            statuses.append(await ask(http, url, 400, {"x-laswrr-ttft-slo-ms": "0.001"}))  # no node: 429 at once
    assert statuses[:-1] == [200] * 48 and statuses[-1] == 429, statuses

    db = tmp_path / "stack" / "events.duckdb"
    report = latency_report(db)
    assert report["mismatches"] == 0, report["first_mismatches"]
    checked = report["checked"]
    assert isinstance(checked, dict) and checked["pick"] >= 10 and checked["refusal"] == 1, report
    assert report["picks"] == report["learned"] == 48 and report["undecodable"] == 0, report
    accuracy = report["accuracy"]
    assert isinstance(accuracy, dict) and {"fast", "slow", "all"} <= set(accuracy), accuracy
    every = accuracy["all"]
    assert every["attempts"] + report["unmeasured"] == 48 and every["ttft_p50_ms"] is not None, report
    print("latency audit:", json.dumps({k: report[k] for k in ("checked", "mismatches", "accuracy")}))
    replay_exact(db)  # and the core's replay of the run with objectives is byte-identical
