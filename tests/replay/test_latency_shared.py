"""End to end: two proxy replicas share one latency estimate. Each reads every proxy's request
events from LB_EVENTS (services/proxy/bus.py, ``LatencyFeed``), so the replica that has served
nothing yet predicts from what the other one measured, and each pick records ``learned_from``:
``laswrr replay --db PATH --latency`` refolds the shared estimate and finds every recorded
prediction of both replicas equal. Real parts: nats-server, scheduler, recorder, collector, two
proxies and two simulated engines, child processes of ``services.up.Stack``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.js.api import DeliverPolicy

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import decode_batch
from laswrr.schemas.events import RequestStarted
from laswrr.services.natsbus import connect
from tests.replay.test_latency_audit import NODES, ask, latency_report
from tests.replay_cli import replay_exact
from tests.sim_stack import simulated_stack

pytestmark = pytest.mark.timeout(180)

TARGETS = {"x-laswrr-ttft-slo-ms": "60000", "x-laswrr-tpot-slo-ms": "5000"}


async def test_a_replica_predicts_from_the_other_ones_attempts_and_the_log_refolds_both(tmp_path: Path) -> None:
    picks: dict[str, list[RequestStarted]] = {"a": [], "b": []}

    async def on_request_events(msg: Any) -> None:
        if msg.subject.startswith(sj.REQ_BATCH + "."):
            for item in decode_batch(msg.subject, msg.data)[1]:
                if isinstance(item.event, RequestStarted) and item.event.proxy in picks:
                    picks[item.event.proxy].append(item.event)

    async with simulated_stack(tmp_path / "stack", NODES, speed=10.0, tick_ms=100,
                               proxy_args=("--slo-defaults", "batch=60000/", "--share-latency")) as stack:
        a = await stack.start_proxy(name="a")
        b = await stack.start_proxy(name="b")
        nc = await connect(stack.role_url("viewer"), "shared-estimate-test", stack.nats_auth)
        try:
            await nc.jetstream().subscribe(sj.REQ_ALL, stream=sj.EVENTS_STREAM, cb=on_request_events,
                                           ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                for wave in range(4):  # a's attempts only: b has served nothing
                    assert await asyncio.gather(*(ask(http, a, 20 + 100 * i, TARGETS) for i in range(4))) == [200] * 4
                for _ in range(4):  # then b's
                    assert await ask(http, b, 60, TARGETS) == 200
                async with http.get(b + "/health") as response:  # the proxy says where its estimate learns from
                    shared = (await response.json())["latency_shared"]
            deadline = asyncio.get_running_loop().time() + 30
            while len(picks["a"]) + len(picks["b"]) < 20:  # every started event read back from the log's stream
                assert asyncio.get_running_loop().time() < deadline, picks
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
    assert (len(picks["a"]), len(picks["b"])) == (16, 4), picks
    first = picks["b"][0]
    # b's first pick, before b served anything, was made from a's measured attempts on that node
    assert isinstance(first.learned, int) and first.learned > 0, [p.learned for p in picks["b"]]
    assert isinstance(first.predicted_ttft_ms, float), first
    assert all(isinstance(p.learned_from, int) for p in picks["a"] + picks["b"])  # every pick says whose estimate
    assert first.learned_from == picks["b"][-1].learned_from == shared["from_seq"]  # from where b started reading
    assert shared["rejected"] == 0

    db = tmp_path / "stack" / "events.duckdb"
    report = latency_report(db)
    assert report["mismatches"] == 0, report["first_mismatches"]
    # a's start and b's (one if no message came between), and no estimate of one proxy's own
    assert report["proxies"] == 0 and report["shared"] in (1, 2), report
    checked = report["checked"]
    predicted = [p for p in picks["a"] + picks["b"] if isinstance(p.predicted_ttft_ms, float)]  # nodes measured
    assert isinstance(checked, dict) and checked["pick"] == len(predicted) >= 10, report
    print("shared latency estimate:", {k: report[k] for k in ("shared", "checked", "mismatches", "learned")},
          "b's picks learned", [p.learned for p in picks["b"]])
    replay_exact(db)
