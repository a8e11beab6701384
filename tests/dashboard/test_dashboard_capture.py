"""The live dashboard under the standard headless capture, and readable (README, "The dashboard").

A running stack (real nats-server, scheduler, recorder, collector, simulated engines, ``laswrr
dashboard`` as the read-only viewer): ``chromium --headless=new --virtual-time-budget=8000
--screenshot URL`` must return (it never did: the page's live stream kept it loading) with the
page drawn (the same flags with ``--dump-dom`` show every node in the table, status live); then,
in a real headless Chromium, what the weights chart drew: each phase band named, no event label
over another or cut, no axis label cut, the new value on a capacity marker, two nodes of equal
weight both visible on their shared line, a removed node's band ending where it was removed.

Skipped, saying so, only where no chromium is installed (.ci/run installs Debian's package)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from laswrr.bench.browser import Browser, chromium_binary
from laswrr.schemas import subjects as sj
from laswrr.services.up import Stack

from tests.conftest import Eventually
from tests.sim_stack import simulated_stack

ARTIFACTS = Path(os.environ.get("LASWRR_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
SIMS = (("d-a", "910B", 8), ("d-b", "910B", 8), ("d-gone", "910", 4))  # d-a and d-b: equal weights
pytestmark = pytest.mark.skipif(chromium_binary() is None,
                                reason="chromium is not installed (Debian: apt-get install chromium; .ci/run "
                                       "installs it): the dashboard's browser tests need a real browser")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with simulated_stack(tmp_path / "data", SIMS, speed=4.0) as stack:
        await stack.start_dashboard(0)
        yield stack


def capture(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The standard capture (``--no-sandbox``: tests run as root); 180 s for a loaded machine:
    before, it never returned at all."""
    binary = chromium_binary()
    assert binary is not None
    return subprocess.run([binary, "--headless=new", "--no-sandbox", "--virtual-time-budget=8000",
                           "--window-size=1280,1100", f"--user-data-dir={tmp_path / 'profile'}", *extra, url],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)


async def _admin(stack: Stack, subject: str, body: bytes) -> None:
    assert stack._nc is not None
    await stack._nc.jetstream().publish(subject, body)


@pytest.mark.timeout(600)
async def test_the_headless_capture_returns_with_the_live_page_drawn(stack: Stack, tmp_path: Path,
                                                                    eventually: Eventually) -> None:
    assert stack.dashboard_url is not None
    await _admin(stack, sj.admin_capacity("d-gone"), b'{"capacity": 2}')
    await _admin(stack, sj.admin_remove("d-gone"), b"{}")
    async with aiohttp.ClientSession() as http:

        async def forgotten() -> bool:
            async with http.get(stack.dashboard_url + "api/state") as response:
                pools = (await response.json())["pools"]
            nodes = {n["node"] for pool in pools.values() for n in pool["nodes"]}
            return "d-a" in nodes and "d-gone" not in nodes

        await eventually(forgotten, timeout=60, what="d-gone drained and forgotten on the dashboard")

    shot = tmp_path / "screenshot.png"
    done = await asyncio.to_thread(capture, stack.dashboard_url, tmp_path, f"--screenshot={shot}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 20_000  # a drawn page, not a blank one
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "dashboard-capture.png").write_bytes(shot.read_bytes())
    done = await asyncio.to_thread(capture, stack.dashboard_url, tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'id="status" class="status ok">live<' in dom, dom[:3000]
    assert "No snapshot yet" not in dom and "connecting…" not in dom
    for node in ("d-a", "d-b"):
        assert f'<tr data-node="{node}">' in dom


@pytest.mark.timeout(600)
async def test_the_weights_chart_is_readable(stack: Stack) -> None:
    assert stack.dashboard_url is not None
    async with Browser(width=1280, height=1100) as browser:
        await browser.goto(stack.dashboard_url)
        await browser.wait_for("window.laswrrDrawn.default && window.laswrrDrawn.default['d-gone']")
        # The registrations' labels fill the chart's label rows where they were drawn: the markers
        # below start 6 s later (some 240 px at the 30 s window), so each finds a free row (on a
        # loaded machine the stack came up just before them, and the capacity label had none).
        await browser.wait_for("(() => { const l = window.laswrrDrawn.default.__labels; "
                               "return l.length > 0 && Date.now() - Math.max(...l.map((e) => e.t)) > 6000; })()",
                               timeout_s=60)
        for subject, body in ((sj.admin_capacity("d-gone"), b'{"capacity": 2}'), (sj.admin_drain("d-gone"), b"{}"),
                              (sj.admin_undrain("d-gone"), b"{}"), (sj.admin_remove("d-gone"), b"{}")):
            await _admin(stack, subject, body)  # four markers at nearly one time: their labels must not collide
            await asyncio.sleep(0.3)
        removed_at = time.time() * 1000
        await browser.wait_for("!document.querySelector('tr[data-node=\"d-gone\"]')", timeout_s=20)
        # the chart goes on after the removal: the removed node's band end leaves the right edge (now)
        await browser.wait_for("(() => { const b = window.laswrrDrawn.default['d-gone'].band; return b.end_px < "
                               "document.querySelector('canvas.weights').clientWidth - 30; })()", timeout_s=30)
        drawn = json.loads(await browser.evaluate("JSON.stringify(window.laswrrDrawn.default)"))
        labels = [entry["label"] for entry in drawn["__labels"]]
        assert "capacity d-gone → 2" in labels, labels  # the new value on the capacity marker
        for node in ("d-a", "d-b", "d-gone"):
            assert drawn[node]["band"]["label"] == node  # each phase band is named
        band = drawn["d-gone"]["band"]  # the removed node's band ends where it was removed
        assert abs(band["end_ms"] - removed_at) < 5000, (band, removed_at)
        width = await browser.evaluate("document.querySelector('canvas.weights').clientWidth")
        assert band["end_px"] < width - 30  # not stretched to the chart's right edge (now)

        boxes = json.loads(await browser.evaluate(
            "JSON.stringify([...document.querySelectorAll('canvas')].map(c => ({w: c.clientWidth, "
            "h: Number(c.dataset.h || c.getAttribute('height')), labels: c.laswrrLabels || []})))"))
        for canvas in boxes:
            for box in canvas["labels"]:  # no label cut by the canvas' edges
                assert 0 <= box["x0"] and box["x1"] <= canvas["w"] and 0 <= box["y0"], (box, canvas["w"])
            marks = [b for b in canvas["labels"] if b["kind"] == "mark"]
            for i, a in enumerate(marks):  # no event label over another
                for b in marks[i + 1:]:
                    assert a["x1"] <= b["x0"] or b["x1"] <= a["x0"] or a["y1"] <= b["y0"] or b["y1"] <= a["y0"], (a, b)

        # d-a and d-b have equal weights: their effective lines coincide, and both colours show on it
        assert abs(drawn["d-a"]["effective"] - drawn["d-b"]["effective"]) < 0.05, drawn  # within a pixel
        colours = json.loads(await browser.evaluate("""JSON.stringify((() => {
            const c = document.querySelector('canvas.weights'), ctx = c.getContext('2d');
            const dpr = window.devicePixelRatio || 1, y = Math.round(window.laswrrDrawn.default['d-a'].y_px * dpr);
            const w = c.width, data = ctx.getImageData(Math.round(w * 0.5), y, Math.round(w * 0.4), 1).data;
            const seen = {};
            for (let i = 0; i < data.length; i += 4) seen[`${data[i]},${data[i + 1]},${data[i + 2]}`] = 1;
            return Object.keys(seen);
        })())"""))
        node_colours = json.loads(await browser.evaluate(
            "JSON.stringify(Object.fromEntries(['d-a', 'd-b'].map(n => [n, getComputedStyle("
            "document.querySelector(`tr[data-node=\"${n}\"] td.node .swatch`)).backgroundColor])))"))
        rgb = {k: v.removeprefix("rgb(").removesuffix(")").replace(" ", "") for k, v in node_colours.items()}
        assert rgb["d-a"] in colours and rgb["d-b"] in colours, (rgb, colours[:20])
        await browser.screenshot(ARTIFACTS / "dashboard-readable.png")
