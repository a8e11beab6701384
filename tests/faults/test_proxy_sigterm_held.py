"""A proxy stopped with SIGTERM (by its own pid) while flow control holds requests hands back
what it holds: each held request is answered at once, a 503 ``shutting_down`` with
``Retry-After``, recorded as ``lb.req.refused`` (cause ``stopping``) under the id its
``lb.req.queued`` named; none waits for the end of the grace period to be dropped unanswered
(before ``FlowGate.hand_back``, the held requests stayed held through ``--grace-s`` and were
cancelled with it: their clients saw the connection close without a response).

Real parts: a stack of real processes (``Stack``: nats-server, scheduler, recorder, one
simulated engine of capacity 2) and a real ``laswrr proxy --flow-control --grace-s 4`` process;
two long streams take the two slots, six more requests are held.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.services.up import Stack

pytestmark = pytest.mark.timeout(180)
GRACE_S = 4.0
HELD = 6


async def queue_depth(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("laswrr_proxy_queue_depth{")))


async def proxy_inflight(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/healthz") as response:
        return int((await response.json())["inflight"])


async def chat(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[Any, ...]:
    """(status, Retry-After, error code, request id, seconds from the send) or the client error."""
    body = {"model": "default", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            data = await response.read()
            code = json.loads(data)["error"]["code"] if response.status != 200 else None
            return (response.status, response.headers.get("Retry-After"), code,
                    response.headers.get("x-laswrr-request-id"), time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return (type(exc).__name__, None, None, None, time.monotonic())


async def test_sigterm_answers_every_held_request(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "data", proxy_port=0,
                  proxy_args=("--flow-control", "--grace-s", str(GRACE_S), "--queue-ttl-ms", "120000"))
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        await stack.start_nats()
        await stack.start_core()
        nodes = await stack.start_sim_engines([("sim-a", "910B", 2)], speed=1.0)
        await stack.register(nodes)
        url = await stack.start_proxy(port=0)
        proxy = next(c for c in stack.children if c.role == "proxy")
        long = [asyncio.create_task(chat(http, url, 20_000)) for _ in range(2)]  # the slots (the rest held)
        deadline = time.monotonic() + 30
        while (inflight := await proxy_inflight(http, url)) + await queue_depth(http, url) < 2 or not inflight:
            assert time.monotonic() < deadline, f"only {inflight} in flight"
            await asyncio.sleep(0.1)
        waiting = [asyncio.create_task(chat(http, url, 8)) for _ in range(HELD)]
        deadline = time.monotonic() + 30
        while (depth := await queue_depth(http, url)) < HELD + 2 - inflight:
            assert time.monotonic() < deadline, f"only {depth} held"
            await asyncio.sleep(0.1)
        signalled = time.monotonic()
        os.kill(proxy.pid, signal.SIGTERM)
        outcomes = await asyncio.wait_for(asyncio.gather(*long, *waiting), 60)
        code = await asyncio.wait_for(proxy.process.wait(), 60)
    finally:
        await http.close()
        await stack.stop()
    with store.open_read(tmp_path / "data" / store.DB_FILE) as con:
        stopped = {row[0] for row in con.execute(
            "SELECT j->>'request_id' FROM input_events WHERE family = 'lb.req.refused' AND j->>'cause' = 'stopping'"
        ).fetchall()}
    answers = [o for o in outcomes if o[0] != 200]
    print(f"FAULT proxy SIGTERM with {depth} held and {inflight} in flight: "
          f"{sum(a[0] == 503 for a in answers)} answered 503 within {max(a[4] for a in answers) - signalled:.2f} s "
          f"(grace {GRACE_S:g} s); outcomes {sorted(str(o[0]) for o in outcomes)}; exit {code}")
    assert len(answers) == depth  # the in-flight ones went on (200); every held one was answered
    for status, retry_after, err, request_id, at in answers:
        assert (status, err) == (503, "shutting_down") and retry_after is not None and int(retry_after) >= 1
        assert request_id is not None
        assert at - signalled < GRACE_S, "a held request waited for the grace period"  # answered at the stop
    assert {a[3] for a in answers} == stopped  # each recorded under its own id
    assert code == 0
