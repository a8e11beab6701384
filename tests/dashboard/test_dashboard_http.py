"""``laswrr dashboard`` as a child process over HTTP (no browser): a real nats-server, a real
``laswrr scheduler`` and ``laswrr recorder``; the live push, the API's answers to bad queries,
and the recorded-log mode over the recorder's DuckDB file."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
from nats.aio.client import Client

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload
from laswrr.services.children import ChildProcesses


async def sse_events(url: str, wanted: int, timeout_s: float = 15.0,
                     connected: asyncio.Event | None = None) -> list[tuple[str, dict]]:
    """The first ``wanted`` events of the SSE stream at ``url``; ``connected`` is set at the first."""
    events: list[tuple[str, dict]] = []
    name = ""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        deadline = time.monotonic() + timeout_s
        while len(events) < wanted and time.monotonic() < deadline:
            line = (await asyncio.wait_for(resp.content.readline(), timeout_s)).decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if connected is not None:
                    connected.set()
    return events


async def test_live_push_state_history_and_the_recorded_log(nats_url: str, nc: Client, tmp_path: Path) -> None:
    children = ChildProcesses(tmp_path / "logs")
    js = nc.jetstream()
    try:
        await children.spawn("scheduler", "scheduler", "--nats-url", nats_url, "--tick-ms", "100", role="scheduler")
        await children.spawn("recorder", "recorder", "--nats-url", nats_url, "--data-dir", str(tmp_path),
                             role="recorder")
        await js.publish(sj.admin_node("n1"), b'{"url": "http://127.0.0.1:1", "capacity": 4, "chip": "910B"}')
        live = await children.spawn("dashboard", "dashboard", "--nats-url", nats_url, "--port", "0",
                                    role="other", wait_listening=True)
        assert live.url is not None and live.url.endswith("/")
        connected = asyncio.Event()
        push = asyncio.create_task(sse_events(live.url + "api/events", 40, connected=connected))
        await asyncio.wait_for(connected.wait(), 15)  # its "hello": what is published next is pushed
        await js.publish(sj.admin_capacity("n1"), b'{"capacity": 2}')
        items = [batch_item(kind, "n1", json.dumps({"request_id": f"r{i}", "proxy": "p1", "outcome": "completed",
                                                    "ttft_ms": 10.0 * i, "duration_ms": 100.0}).encode())
                 for i in range(3) for kind in ("req.started", "req.finished")]
        await js.publish(sj.req_batch("p1"), batch_payload("b1", 1, items))  # a proxy's batch: 3 requests
        events = await push
        assert events[0][0] == "hello"
        kinds = {name for name, _ in events}
        assert {"snapshot", "mark"} <= kinds
        assert any(name == "mark" and data["text"] == "n1: capacity set to 2" for name, data in events)
        async with aiohttp.ClientSession() as session:
            async with session.get(live.url + "api/state") as resp:
                state = await resp.json()
            assert state["mode"] == "live" and [n["node"] for n in state["pools"]["default"]["nodes"]] == ["n1"]
            assert state["pools"]["default"]["nodes"][0]["capacity"] == 2
            for _ in range(100):  # until the board has folded the batch
                async with session.get(live.url + "api/state") as resp:
                    requests = (await resp.json())["pools"]["default"]["requests"]
                if requests["count"]:
                    break
                await asyncio.sleep(0.1)
            assert requests["count"] == 3 and requests["outcomes"] == {"completed": 3}
            async with session.get(live.url + "api/history?window=60") as resp:
                history = await resp.json()
            assert len(history["pools"]["default"]["series"]["n1"]) > 3
            for query in ("api/history?window=-1", "api/history?window=x", "api/state?at=yesterday"):
                async with session.get(live.url + query) as resp:
                    assert resp.status == 400 and "error" in await resp.json(), query
            async with session.get(live.url) as resp:
                assert resp.status == 200 and "dashboard.js" in await resp.text()
            async with session.get(live.url + "static/dashboard.js") as resp:
                assert resp.status == 200
        await children.stop(("other", "scheduler", "recorder"))

        recorded = await children.spawn("recorded", "dashboard", "--db", str(tmp_path / "events.duckdb"),
                                        "--port", "0", role="other", wait_listening=True)
        assert recorded.url is not None
        async with aiohttp.ClientSession() as session:
            async with session.get(recorded.url + "api/state") as resp:
                state = await resp.json()
            first, last = state["range_ms"]
            assert state["mode"] == "recorded" and first < last and state["at_ms"] == last
            assert state["pools"]["default"]["nodes"][0]["capacity"] == 2
            assert state["pools"]["default"]["requests"]["count"] == 3  # the batch's finished events
            async with session.get(recorded.url + f"api/state?at={first + 50}") as resp:
                early = await resp.json()
            assert early["pools"]["default"]["nodes"][0]["capacity"] == 4  # before the change
            async with session.get(recorded.url + "api/events") as resp:
                assert resp.status == 404
    finally:
        await children.stop(("other", "scheduler", "recorder"))


async def test_a_missing_log_is_a_one_line_error(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "dashboard", "--db", str(tmp_path / "none.duckdb"), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and out == b"" and "no recorded log at" in err.decode()
