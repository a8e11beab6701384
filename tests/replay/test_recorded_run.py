"""End to end: a real recorded run (nats-server, scheduler, recorder, collector, proxy, simulated
engines, all as child processes of ``services.up.Stack``) with normal requests, client cancels,
a capacity drop to 0 (a drain) and an engine killed mid-stream (its streams are continued on
other nodes). Afterwards the recorded log replays exactly, and ``laswrr report`` counts what the
clients saw."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
import pytest

from laswrr.replay import store
from laswrr.replay.report import gather
from laswrr.replay.replay import replay_db
from laswrr.schemas import subjects as sj

up = pytest.importorskip("laswrr.services.up")
pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"


@dataclass
class ClientCounts:
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    nodes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.completed + self.cancelled + self.errors


def body(tokens: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": tokens, "stream": True}


async def chat(http: aiohttp.ClientSession, url: str, counts: ClientCounts, tokens: int,
               cancel_after_first: bool = False, streaming: asyncio.Queue[str] | None = None) -> None:
    """One streaming request, classified as the client sees it."""
    try:
        async with http.post(url + CHAT, json=body(tokens)) as resp:
            node = resp.headers.get("x-laswrr-node", "?")
            counts.nodes[node] = counts.nodes.get(node, 0) + 1
            if resp.status != 200:
                await resp.read()
                counts.errors += 1
                return
            seen = b""
            async for chunk in resp.content.iter_any():
                seen += chunk
                if streaming is not None and len(seen) == len(chunk):
                    streaming.put_nowait(node)  # this stream's first bytes reached the client
                if cancel_after_first:
                    counts.cancelled += 1
                    resp.close()  # the client goes away mid-stream
                    return
            if seen.rstrip().endswith(b"data: [DONE]"):
                counts.completed += 1
            else:
                counts.errors += 1  # the stream was cut
    except (aiohttp.ClientError, asyncio.TimeoutError):
        counts.errors += 1


async def proxy_routes_all(http: aiohttp.ClientSession, url: str, nodes: int, wait_s: float = 30.0) -> None:
    """Wait until the proxy has a snapshot in which every node is routable."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        async with http.get(url + "/healthz") as resp:
            health = await resp.json()
        if len(health.get("pools", {}).get("default", {}).get("routable", [])) == nodes:
            return
        assert asyncio.get_running_loop().time() < deadline, f"proxy never routed to all nodes: {health}"
        await asyncio.sleep(0.1)


async def test_recorded_run_replays_exactly_and_report_counts_match_the_clients(tmp_path: Path) -> None:
    stack = up.Stack(tmp_path / "stack", proxy_port=0, tick_ms=100)
    counts = ClientCounts()
    try:
        await stack.start(sim_speed=10.0)
        assert stack.proxy_url is not None
        url = stack.proxy_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await proxy_routes_all(http, url, len(stack.nodes))
            await asyncio.gather(*(chat(http, url, counts, 20) for _ in range(16)))
            await asyncio.gather(*(chat(http, url, counts, 400, cancel_after_first=True) for _ in range(4)))
            streaming: asyncio.Queue[str] = asyncio.Queue()
            long_runs = [asyncio.create_task(chat(http, url, counts, 3000, streaming=streaming)) for _ in range(8)]
            victim = await asyncio.wait_for(streaming.get(), 20)
            other = next(n.id for n in stack.nodes if n.id != victim)
            nc = await nats.connect(stack.nats_url)
            await nc.publish(sj.admin_capacity(other), json.dumps({"capacity": 0}).encode())  # as `nats pub`
            await nc.flush()
            await nc.close()
            child = next(c for c in stack.children if c.name == victim)
            child.expected_exit = True
            child.process.kill()  # an engine dies with streams in flight
            await asyncio.gather(*long_runs)
            await asyncio.gather(*(chat(http, url, counts, 20) for _ in range(8)))
    finally:
        await stack.stop()
    assert counts.errors == 0, f"a stream was cut by the engine kill: {counts}"  # continued elsewhere
    assert counts.cancelled == 4

    db = tmp_path / "stack" / "events.duckdb"
    with store.open_read(db) as con:
        result = replay_db(con)
        report = gather(con)
    assert result.identical, result.summary() + "\n" + (result.first.describe() if result.first else "")
    assert result.events > 100 and result.snapshots > 10
    assert result.verified_through == result.last_seq  # the scheduler processed every input
    assert {k: report[k] for k in ("requests", "completed", "client_cancelled", "upstream_error", "interrupted",
                                   "open")} == {
        "requests": counts.total, "completed": counts.completed, "client_cancelled": counts.cancelled,
        "upstream_error": counts.errors, "interrupted": 0, "open": 0}, (report, counts)
    assert report["admitted_to_draining"] == 0
    assert report["continued_streams"] >= 1 and report["interrupted_engine_cut"] == 0, report
    drains = [(d["node"], d["reason"], d["by"]) for d in report["drains"]]
    assert (other, "capacity set to 0", "inflight") in drains, drains  # its streams ran to completion

    with store.open_read(db) as con:  # the proxy's events came in batches; the views unnest them
        singles = con.execute("SELECT count(*) FROM events WHERE subject LIKE 'lb.req.started.%' "
                              "OR subject LIKE 'lb.req.finished.%' OR subject LIKE 'lb.proxy.%'").fetchone()
        sizes = con.execute("SELECT json_array_length(data::JSON->'events') FROM events "
                            "WHERE subject = 'lb.req.batch.proxy'").fetchall()
        rows = con.execute("SELECT count(*), count(*) FILTER (WHERE outcome IS NOT NULL AND finished_ts_ns >= "
                           "started_ts_ns) FROM requests").fetchone()
    assert singles == (0,) and len(sizes) > 1 and max(n for (n,) in sizes) > 1, sizes
    assert rows == (counts.total, counts.total)
