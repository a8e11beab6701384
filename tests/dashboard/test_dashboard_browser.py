"""The dashboard page in a real headless Chromium against a running stack (real nats-server,
scheduler, recorder, collector, proxy, simulated engines, ``laswrr dashboard``), then over the
recorded log with ``--db``. Screenshots go to ``$LASWRR_ARTIFACTS`` (default test-artifacts/).

Skipped, saying so, only where no chromium is installed (.ci/run installs Debian's package)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from laswrr.bench.browser import Browser, chromium_binary
from laswrr.schemas import subjects as sj
from laswrr.services.up import Stack

from tests.sim_stack import simulated_stack

ARTIFACTS = Path(os.environ.get("LASWRR_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
SIMS = (("d-910b", "910B", 8), ("d-910", "910", 4))
pytestmark = pytest.mark.skipif(chromium_binary() is None,
                                reason="chromium is not installed (Debian: apt-get install chromium; .ci/run "
                                       "installs it): the dashboard's browser tests need a real browser")


def drawn(node: str) -> str:
    return f"(window.laswrrDrawn.default || {{}})[{json.dumps(node)}]"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with simulated_stack(tmp_path / "data", SIMS, speed=4.0) as stack:
        await stack.start_proxy(port=0)
        await stack.start_dashboard(0)
        yield stack


async def some_requests(proxy_url: str, count: int) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{proxy_url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()


async def test_live_page_shows_every_node_and_follows_a_capacity_drop(stack: Stack, tmp_path: Path) -> None:
    assert stack.dashboard_url is not None and stack.proxy_url is not None
    await some_requests(stack.proxy_url, 6)
    async with Browser() as browser:
        await browser.goto(stack.dashboard_url)
        rows = await browser.wait_for("[...document.querySelectorAll('table.nodes tbody tr')].map(r => r.dataset.node)"
                                      ".sort().join(',') || ''")
        assert rows == ",".join(sorted(node for node, _, _ in SIMS))
        assert await browser.wait_for("document.querySelector('#status').textContent === 'live'")
        before = await browser.wait_for(f"{drawn('d-910b')} && {drawn('d-910b')}.effective")
        assert before > 3  # capacity 8, lightly loaded
        await browser.wait_for("document.querySelector('.requests').textContent.includes('completed')")

        assert stack._nc is not None
        capacity_at_ms = time.time() * 1000  # the recorded log's clock is this machine's too
        await stack._nc.jetstream().publish(sj.admin_capacity("d-910b"), b'{"capacity": 1}')
        # the drawn curve follows within a few seconds (the live push; no reload)
        effective = await browser.wait_for(f"{drawn('d-910b')} && {drawn('d-910b')}.effective <= 1.5 && "
                                           f"{drawn('d-910b')}.effective", timeout_s=5.0)
        assert 0 < effective <= 1.5
        other = await browser.evaluate(f"{drawn('d-910')}.effective")
        assert other > 1.5  # the other node keeps its share (capacity 4)
        await browser.wait_for("document.querySelector('.marks').textContent.includes('d-910b: capacity set to 1')")
        cell = await browser.evaluate("document.querySelector('tr[data-node=\"d-910b\"] td.capacity').textContent")
        assert cell == "1"
        await browser.screenshot(ARTIFACTS / "dashboard-live.png")

    await stack.stop()  # the recorder commits everything, then the recorded log is viewed
    db = stack.data_dir / "events.duckdb"
    board = await stack.processes.spawn("dashboard-db", "dashboard", "--db", str(db), "--port", "0",
                                        wait_listening=True)
    try:
        assert board.url is not None
        async with Browser() as browser:
            await browser.goto(board.url)
            await browser.wait_for("document.querySelector('#status').textContent === 'recorded log'")
            assert not await browser.evaluate("document.querySelector('#scrub').hidden")
            # at the end of the log: capacity 1; scrubbed back to the first snapshot: capacity 8
            await browser.wait_for("document.querySelector('tr[data-node=\"d-910b\"] td.capacity')?.textContent === '1'")
            first = await browser.evaluate("Number(document.querySelector('#scrubber').min)")
            assert 0 < first < capacity_at_ms - 200  # the stack had run a while before the drop
            await browser.evaluate(f"window.laswrrScrub({(first + capacity_at_ms) / 2})")  # between the two
            await browser.wait_for("document.querySelector('tr[data-node=\"d-910b\"] td.capacity')?.textContent === '8'")
            await browser.screenshot(ARTIFACTS / "dashboard-recorded.png")
    finally:
        await stack.processes.stop(("other",))
