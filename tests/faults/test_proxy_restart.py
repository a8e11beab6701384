"""A proxy killed (-9, by its own pid) with 20 requests in flight and restarted under the same
``--proxy-id`` (what `laswrr up`'s supervision does, like compose's fixed ids and restart
policy) leaves no phantom load: the scheduler's in-flight for it is back to 0 within a bound.

Real parts: `laswrr up` with its simulated engines on an external nats-server, 20 real streaming
clients. The bound asserted is generous for a loaded CI box; the measured figure is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect
from tests.replay_cli import replay_exact
from tests.up_process import UpStderr, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(240)
IN_FLIGHT = 20
BOUND_S = 30.0  # heartbeat period (2 s) + the restart, with room for a loaded machine


async def scheduler_inflight(kv) -> int:  # type: ignore[no-untyped-def]
    snapshot = json.loads((await kv.get("default")).value)
    return sum(n["inflight"] for n in snapshot["nodes"])


async def long_stream(http: aiohttp.ClientSession, url: str) -> str:
    body = {"model": "default", "stream": True, "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.content:
                pass
            return "completed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return type(exc).__name__


async def test_a_restarted_proxy_leaves_no_phantom_in_flight(tmp_path: Path, nats_url: str) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--nats-url", nats_url)
    stderr = UpStderr(proc)
    url = banner["proxy URL"].split()[0]
    nc = await connect(nats_url, "fault-test")
    kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        streams = [asyncio.create_task(long_stream(http, url)) for _ in range(IN_FLIGHT)]
        deadline = time.monotonic() + 30
        while await scheduler_inflight(kv) < IN_FLIGHT:
            assert time.monotonic() < deadline, "the 20 requests never showed as in flight"
            await asyncio.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(int(banner["pid proxy"]), signal.SIGKILL)
        await stderr.wait_for(r"started proxy \(pid (\d+)\)", count=2)
        restarted_s = time.monotonic() - killed_at
        while (inflight := await scheduler_inflight(kv)) > 0:
            assert time.monotonic() - killed_at < BOUND_S, f"still {inflight} in flight {BOUND_S} s after the kill"
            await asyncio.sleep(0.05)
        zero_s = time.monotonic() - killed_at
        outcomes = await asyncio.gather(*streams)
        async with http.post(f"{url}/v1/chat/completions", json={
                "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status == 200  # the restarted proxy serves
    finally:
        await http.close()
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 90)
    js = nc.jetstream()
    published = (await js.stream_info(sj.EVENTS_STREAM)).state.messages
    await nc.close()
    with store.open_read(data / store.DB_FILE) as con:
        recorded = con.execute("SELECT count(*) FROM events WHERE stream = 'LB_EVENTS'").fetchone()
        cut = con.execute("SELECT count(*) FROM interruptions").fetchone()
        boots = con.execute("SELECT count(DISTINCT j->>'boot_id') FROM input_events WHERE family IN "
                            "('lb.proxy.heartbeat', 'lb.req.started', 'lb.req.finished')").fetchone()
    failed = sum(1 for o in outcomes if o != "completed")
    replay = replay_exact(data / store.DB_FILE)
    print(f"FAULT proxy kill -9 with {IN_FLIGHT} in flight, restarted with the same id: restarted in "
          f"{restarted_s:.2f} s, scheduler in-flight 0 after {zero_s:.2f} s; client streams failed {failed} "
          f"(the killed proxy's own), cut by the router (views) {cut[0] if cut else None}; events published "
          f"{published} recorded {recorded[0] if recorded else None}; replay: {replay}")
    assert boots == (2,)
    assert recorded == (published,)
