"""LB_WEIGHTS recreated (``nats stream rm``, a fresh scheduler counting ``as_of_seq`` from 1 again):
the proxy must follow the new stream, not keep its higher-numbered snapshot from the old one forever.
And the same stream after a nats-server restart: the proxy watches it anew as soon as it is back."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import pytest

from proxy_support import CoreDriver, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import ensure_streams
from laswrr.services.proxy.bus import WEIGHTS_STREAM
from laswrr.services.tasks import stop_task

CHAT = "/v1/chat/completions"


async def _node_of(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(url + CHAT, json={"model": "m", "messages": []}) as resp:
        assert resp.status == 200
        return resp.headers["x-laswrr-node"]


async def _recreate_and_follow(nc: Any, core: CoreDriver, engines: Any, proxy: Any, http: aiohttp.ClientSession,
                               ticking: bool) -> None:
    a, b = await engines("a"), await engines("b")
    core.seq = 1_000_000  # the old scheduler has run for a while: a fresh one would take ages to catch up
    await core.register("a", a.url)
    for _ in range(5):
        seq = await core.tick()
    await wait_seq(proxy, "default", seq)
    assert await _node_of(http, proxy.url) == "a"
    first_stream = proxy.state.bus.stream_created
    assert first_stream is not None

    js = nc.jetstream()
    await js.delete_stream(WEIGHTS_STREAM)
    await ensure_streams(js)  # a new, empty LB_WEIGHTS
    fresh = CoreDriver(await js.key_value(sj.WEIGHTS_BUCKET))  # a fresh scheduler: as_of_seq from 1 again
    await fresh.register("b", b.url)

    async def tick_forever() -> None:  # a live scheduler: a snapshot every 100 ms
        while True:
            await fresh.tick()
            await asyncio.sleep(0.1)

    ticker = asyncio.create_task(tick_forever()) if ticking else None
    try:
        await wait_for(lambda: set(proxy.state.router.table.route("default").first.targets) == {"b"}, timeout=30,
                       what="the snapshots of the new stream")
        assert proxy.state.router.table.route("default").snapshot.as_of_seq <= fresh.seq  # numbered by the new stream
        assert proxy.state.bus.stream_created not in (None, first_stream)
        assert await _node_of(http, proxy.url) == "b"
        later = await fresh.tick()  # and it keeps following the new stream's numbering
        await wait_seq(proxy, "default", later)
    finally:
        if ticker is not None:  # cancelled again until it ends: nats-py's wait_for on Python 3.11 can
            assert await stop_task(ticker)  # swallow a cancel (likely what once took this test to 120 s)


async def test_proxy_follows_a_recreated_weights_stream_on_rewatch(engines, nc: Any, core: CoreDriver,
                                                                   start_proxy: StartProxy,
                                                                   http: aiohttp.ClientSession) -> None:
    """The watcher of the deleted stream goes silent; the next watcher reads a stream of another identity."""
    proxy = await start_proxy()
    proxy.state.bus.rewatch_s = 2.0  # sooner than the default 10 s
    await _recreate_and_follow(nc, core, engines, proxy, http, ticking=False)


async def test_proxy_follows_a_recreated_weights_stream_on_a_surviving_watcher(engines, nc: Any, core: CoreDriver,
                                                                              start_proxy: StartProxy,
                                                                              http: aiohttp.ClientSession) -> None:
    """nats-py's ordered consumer outlives the deletion (after missed heartbeats it re-subscribes past its
    last stream seq) and goes on delivering the new stream's snapshots, all with lower ``as_of_seq``: never
    silent, so no re-watch. The first refused snapshot makes the link check the stream identity."""
    proxy = await start_proxy()
    proxy.state.bus.rewatch_s = 120.0  # no re-watch during the test: only the refused-snapshot check can help
    started = time.monotonic()
    await _recreate_and_follow(nc, core, engines, proxy, http, ticking=True)
    assert time.monotonic() - started < 60


async def test_a_forged_snapshot_beyond_the_log_gives_way_to_the_schedulers(engines, nc: Any, core: CoreDriver,
                                                                         start_proxy: StartProxy,
                                                                         http: aiohttp.ClientSession) -> None:
    """A stray writer (an open bus) put a snapshot numbered 2^53 into LB_WEIGHTS: "newest wins"
    alone would keep it against every real snapshot. Its as_of_seq is beyond LB_EVENTS' last seq,
    so once the scheduler's next snapshot is refused as older, the proxy drops the forged one."""
    real, hijack = await engines("real"), await engines("hijack")
    js = nc.jetstream()
    for tick in range(1, 101):  # the log holds 100 events: no real snapshot is numbered above 100
        await js.publish(sj.CLOCK_TICK, b'{"tick": %d}' % tick)
    forger = CoreDriver(await js.key_value(sj.WEIGHTS_BUCKET))
    forger.seq = 2**53 - 1
    await forger.register("hijack", hijack.url)
    proxy = await start_proxy()
    await wait_seq(proxy, "default", 2**53)
    assert await _node_of(http, proxy.url) == "hijack"

    await core.register("real", real.url)  # the scheduler's snapshots: as_of_seq 1, 2, ...
    for _ in range(50):
        if set(proxy.state.router.table.route("default").first.targets) == {"real"}:
            break
        await core.tick()
        await asyncio.sleep(0.1)
    assert set(proxy.state.router.table.route("default").first.targets) == {"real"}
    assert proxy.state.router.table.route("default").snapshot.as_of_seq <= 51
    assert await _node_of(http, proxy.url) == "real"


async def test_proxy_watches_again_at_once_after_nats_server_restarts(engines, nats_server: Any, nc: Any,
                                                                       core: CoreDriver, start_proxy: StartProxy,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A restarted nats-server (same port, same store: `laswrr up` after a full disk) forgot the
    watcher's consumer: the proxy re-creates its watcher once the connection is back and silent a
    second, not ``rewatch_s`` after its last snapshot (here 120 s) nor when nats-py's ordered
    consumer resets itself after missed heartbeats (~20 s, measured without the re-watch)."""
    caplog.set_level(logging.INFO, "laswrr.proxy.bus")
    proxy = await start_proxy()
    proxy.state.bus.rewatch_s = 120.0
    a = await engines("a")
    await core.register("a", a.url)
    await wait_seq(proxy, "default", await core.tick())
    await asyncio.to_thread(nats_server.stop)
    await asyncio.to_thread(nats_server.start)
    deadline = time.monotonic() + 30
    while True:  # the test's own connection reconnects too
        try:
            later = await core.tick()
            break
        except Exception:  # noqa: BLE001 - not reconnected yet
            assert time.monotonic() < deadline, "the test's connection did not come back"
            await asyncio.sleep(0.1)
    table = proxy.state.router.table
    await wait_for(lambda: table.snapshots()["default"].as_of_seq >= later, timeout=30,
                   what="a snapshot published after the restart")
    assert "NATS connection back and LB_WEIGHTS silent: watching it anew" in caplog.text
