"""A proxy signalled right after it starts (while it connects to NATS and sets up its watch) exits 0 at once.

Regression: a SIGTERM a few milliseconds after the banner used to hang the proxy for good (its
parent killed it after 35 s): the shutdown's cancel of the bus task landed in the same loop
iteration as a NATS reply, Python 3.11's ``asyncio.wait_for`` inside nats-py swallowed it, and the
task went on into a KV watch nobody stopped. A SIGTERM before the signal handlers were installed
killed it (exit -15). The timing that hits the race varies with the machine, so the CLI test
starts the proxy several times with signals from 0 to a few ms after the banner; the in-process
test makes the bus lose one cancel on purpose.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from nats.js import JetStreamContext

from proxy_support import wait_for
from laswrr.services.proxy import app
from laswrr.services.proxy.bus import BusLink
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.tasks import bounded, stop_task

DELAYS_S = (0.0, 0.001, 0.002, 0.003, 0.004, 0.006)
EXIT_WITHIN_S = 5.0


def _start_and_signal(nats_url: str, proxy_id: str, delay_s: float) -> tuple[int | None, float, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "laswrr.services.proxy.cli", "--nats-url", nats_url, "--host", "127.0.0.1", "--port", "0",
         "--proxy-id", proxy_id, "--log-level", "DEBUG"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.startswith("proxy listening on "), line
        if delay_s:
            time.sleep(delay_s)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, took, proc.stderr.read()


def test_sigterm_right_after_start_exits_zero_quickly(nats_url: str) -> None:
    for i, delay in enumerate(DELAYS_S):
        code, took, log = _start_and_signal(nats_url, f"early-{i}", delay)
        assert code == 0, f"start {i} (SIGTERM {delay * 1000:.0f} ms after the banner): exit {code} " \
                          f"after {took:.1f} s; log:\n{log[-2000:]}"
        assert "Traceback" not in log, log


class LosesOneCancel(BusLink):
    """A bus link whose set-up loses the first cancel, as nats-py's requests do on Python 3.11."""

    async def _prepare(self, js: JetStreamContext) -> None:
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            pass  # wait_for returned the reply that arrived with the cancel
        await super()._prepare(js)


async def test_stop_ends_a_bus_that_lost_a_cancel(nats_url: str, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streams exist (``nc``), so the shutdown's flush ends at once and its cancel hits the set-up."""
    monkeypatch.setattr(app, "BusLink", LosesOneCancel)
    proxy = await app.start(ProxyConfig(nats_url=nats_url, host="127.0.0.1", port=0, grace_s=1.0))
    await wait_for(lambda: proxy.state.bus.nc is not None, what="connected")
    stopping = asyncio.create_task(proxy.stop())
    done, _ = await asyncio.wait({stopping}, timeout=EXIT_WITHIN_S)
    assert done, f"stop still running after {EXIT_WITHIN_S} s"
    stopping.result()
    assert proxy.state.bus.nc is not None and proxy.state.bus.nc.is_closed
    assert proxy.state.events.published == 1  # lb.proxy.stopped went out before the bus stopped


async def test_stop_task_outlasts_a_swallowed_cancel() -> None:
    """What 3.11's wait_for does when the result arrives with the cancel: the task just goes on."""
    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(10)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await stop_task(task, patience_s=2.0)
    assert task.cancelled()


async def test_stop_task_gives_up_instead_of_hanging() -> None:
    released = asyncio.Event()

    async def deaf() -> None:
        while not released.is_set():
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    started = time.monotonic()
    assert not await stop_task(task, patience_s=0.2)
    assert time.monotonic() - started < 1.0 and not task.done()
    released.set()
    assert await stop_task(task, patience_s=2.0)


async def test_bounded_stops_a_late_coroutine() -> None:
    assert await bounded(asyncio.sleep(0), 1.0, "quick")
    started = time.monotonic()
    assert not await bounded(asyncio.sleep(10), 0.1, "late")
    assert time.monotonic() - started < 1.0
