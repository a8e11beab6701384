"""End to end, the time to first token of streamed and whole answers: a real recorded run
(nats-server, scheduler, recorder, collector, proxy and simulated engines, as child processes of
``services.up.Stack``) serves streamed and non-streamed requests; the recorded views give a
streamed request its real TTFT (before its last byte) and a whole answer none (``stream`` false,
``ttft_ms`` NULL, its first byte kept in ``first_byte_ms``), the p99 TTFT query of
docs/analysts.md counts the streamed requests only, and the log replays exactly."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.services.proxy.answers import REQUEST_ID_HEADER

up = pytest.importorskip("laswrr.services.up")
pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "analysts.md"


def the_guides_ttft_query() -> str:
    """The analyst guide's p99 time-to-first-token query, as printed there."""
    blocks = re.findall(r"```sql\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    found = [s.strip() for b in blocks for s in b.split(";") if "quantile_cont(ttft_ms" in s]
    assert len(found) == 1, found
    return found[0]


async def chat(http: aiohttp.ClientSession, url: str, stream: bool) -> str:
    """One request, read to its end; its request id."""
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40, "stream": stream}
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == ("text/event-stream" if stream else "application/json")
        await resp.read()
        return resp.headers[REQUEST_ID_HEADER]


async def routable(http: aiohttp.ClientSession, url: str, nodes: int) -> bool:
    async with http.get(url + "/healthz") as resp:
        health = await resp.json()
    return len(health.get("pools", {}).get("default", {}).get("routable", [])) == nodes


async def test_whole_answers_have_no_ttft_in_the_views_and_the_guides_query(tmp_path: Path, eventually) -> None:
    stack = up.Stack(tmp_path / "stack", proxy_port=0, tick_ms=100)
    try:
        await stack.start(sim_speed=10.0)
        assert stack.proxy_url is not None
        url = stack.proxy_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await eventually(lambda: routable(http, url, len(stack.nodes)), timeout=30, what="every node routable")
            streamed = await asyncio.gather(*(chat(http, url, True) for _ in range(6)))
            whole = await asyncio.gather(*(chat(http, url, False) for _ in range(6)))
    finally:
        await stack.stop()

    db = tmp_path / "stack" / "events.duckdb"
    with store.open_read(db) as con:
        result = replay_db(con)
        rows = {r[0]: r[1:] for r in con.execute(
            "SELECT request_id, outcome, stream, ttft_ms, duration_ms FROM requests").fetchall()}
        attempts = {r[0]: r[1:] for r in con.execute(
            "SELECT attempt_id, stream, ttft_ms, first_byte_ms, duration_ms FROM attempts").fetchall()}
        per_node = con.execute(the_guides_ttft_query()).fetchall()
    assert result.identical, result.summary()
    assert set(rows) == {*streamed, *whole}
    for request_id in streamed:
        outcome, stream, ttft_ms, duration_ms = rows[request_id]
        assert (outcome, stream) == ("completed", True)
        assert 0 < ttft_ms < duration_ms  # its first token, before its last
        assert attempts[request_id][:3] == (True, ttft_ms, ttft_ms)
    for request_id in whole:
        outcome, stream, ttft_ms, duration_ms = rows[request_id]
        assert (outcome, stream, ttft_ms) == ("completed", False, None)
        stream, ttft_ms, first_byte_ms, duration_ms = attempts[request_id]
        assert (stream, ttft_ms) == (False, None)
        assert 0 < first_byte_ms <= duration_ms  # recorded all the same: its first byte was its whole answer
    # the guide's query: one row per node that served a stream, counting the streamed requests only
    assert sum(count for _, count, _ in per_node) == len(streamed), per_node
    assert all(p99 is not None and p99 > 0 for _, _, p99 in per_node), per_node
