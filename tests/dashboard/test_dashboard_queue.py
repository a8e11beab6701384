"""The dashboard's queue view in a real headless Chromium against a running stack with flow
control (real nats-server, scheduler, recorder, collector, ``laswrr proxy --flow-control``, one
simulated engine of 2 slots, ``laswrr dashboard``): requests held per band show on the live page
(the counts and the chart) while they wait and go back to 0 when they are dispatched; over the
recorded log the scrubber shows them again at a moment they waited.

Skipped, saying so, only where no chromium is installed (.ci/run installs Debian's package)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest

from laswrr.bench.browser import Browser, chromium_binary

from tests.conftest import Eventually
from tests.sim_stack import simulated_stack

ARTIFACTS = Path(os.environ.get("LASWRR_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
pytestmark = [pytest.mark.skipif(chromium_binary() is None,
                                 reason="chromium is not installed (Debian: apt-get install chromium; .ci/run "
                                        "installs it): the dashboard's browser tests need a real browser"),
              pytest.mark.timeout(240)]
NOW = "document.querySelector('.queue-now')"
CHART = "JSON.parse(document.querySelector('canvas.queue').dataset.drawn || '{}')"


async def ask(session: aiohttp.ClientSession, url: str, tokens: int, band: str) -> int:
    body = {"model": "default", "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "hi"}],
            "sim": {"output_tokens": tokens}}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"x-laswrr-priority": band}) as response:
        await response.read()
        return response.status


def held_now(band: str) -> str:
    return f"Number({NOW}?.querySelector('[data-band=\"{band}\"] b')?.textContent ?? -1)"


async def test_the_page_shows_the_requests_held_per_band(tmp_path: Path, eventually: Eventually) -> None:
    async with simulated_stack(tmp_path / "data", [("q-910b", "910B", 2)], speed=1.0) as stack:
        proxy = await stack.start_proxy(port=0, extra_args=("--flow-control",))
        await stack.start_dashboard(0)
        assert stack.dashboard_url is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session, Browser() as browser:
            await browser.goto(stack.dashboard_url)
            assert await browser.wait_for("document.querySelector('#status').textContent === 'live'")
            assert await browser.wait_for(f"{held_now('batch')} === 0")
            blockers = [asyncio.create_task(ask(session, proxy, 250, "default")) for _ in range(2)]

            async def both_in_flight() -> bool:  # both slots taken: what follows is held
                async with session.get(f"{proxy}/healthz") as response:
                    return int((await response.json())["inflight"]) == 2

            await eventually(both_in_flight, timeout=30, what="the two blockers in flight")
            held_at_ms = time.time() * 1000
            waiting = [asyncio.create_task(ask(session, proxy, 4, band))
                       for band in ("batch", "batch", "batch", "default", "interactive")]
            # the live push shows them within a few seconds (no reload): counts and the chart
            assert await browser.wait_for(f"{held_now('batch')} === 3 && {held_now('default')} === 1 && "
                                          f"{held_now('interactive')} === 1", timeout_s=10.0)
            drawn = await browser.wait_for(f"{CHART}.batch === 3 && {CHART}", timeout_s=5.0)
            assert drawn == {"interactive": 1, "default": 1, "batch": 3}
            await browser.screenshot(ARTIFACTS / "dashboard-queue-live.png")
            assert [await task for task in blockers + waiting] == [200] * 7
            assert await browser.wait_for(f"{held_now('batch')} === 0 && {held_now('interactive')} === 0 && "
                                          f"{CHART}.batch === 0", timeout_s=10.0)
        await stack.stop()  # the recorder commits everything, then the recorded log is viewed
        board = await stack.processes.spawn("dashboard-db", "dashboard", "--db", str(stack.data_dir / "events.duckdb"),
                                            "--port", "0", wait_listening=True)
        try:
            assert board.url is not None
            async with Browser() as browser:
                await browser.goto(board.url)
                await browser.wait_for("document.querySelector('#status').textContent === 'recorded log'")
                assert await browser.wait_for(f"{held_now('batch')} === 0")  # at the end of the log
                await browser.evaluate(f"window.laswrrScrub({json.dumps(held_at_ms + 1500)})")  # while they waited
                assert await browser.wait_for(f"{held_now('batch')} === 3 && {held_now('interactive')} === 1",
                                              timeout_s=10.0)
                await browser.screenshot(ARTIFACTS / "dashboard-queue-recorded.png")
        finally:
            await stack.processes.stop(("other",))
