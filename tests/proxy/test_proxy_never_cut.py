"""Never cut: drains, capacity 0, removal and new snapshots leave admitted streams alone;
graceful shutdown lets them finish; a lost NATS keeps routing on the last snapshot."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import msgspec

from proxy_support import CoreDriver, EventTap, StartProxy, batch_events, stored_batches, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.schemas.events import RequestBatch
from laswrr.services.proxy.events import Batch
from laswrr.services.nats_server import EmbeddedNats

CHAT = "/v1/chat/completions"


async def _stream(http: aiohttp.ClientSession, url: str, chunks: int, delay: float) -> tuple[str, bytes]:
    body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": chunks, "delay": delay}}
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200
        return resp.headers["x-laswrr-node"], await resp.read()


async def test_drain_with_long_streams_in_flight(engines, core: CoreDriver, start_proxy: StartProxy,
                                                 http: aiohttp.ClientSession, tap: EventTap) -> None:
    a, b = await engines("a"), await engines("b")
    await core.register("a", a.url, capacity=4)
    proxy = await start_proxy(policy="rr")
    await wait_seq(proxy, "default", await core.register("b", b.url, capacity=4))

    long_streams = [asyncio.create_task(_stream(http, proxy.url, chunks=20, delay=0.05)) for _ in range(6)]
    await wait_for(lambda: len(a.received) >= 2 and len(b.received) >= 2, what="streams on both nodes")
    drain_seq = await core.capacity("a", 0)  # a -> draining: not routable in the new snapshot
    await wait_seq(proxy, "default", drain_seq)
    assert len(a.received) == 3 and all(not t.done() for t in long_streams)

    short = await asyncio.gather(*(_stream(http, proxy.url, chunks=1, delay=0) for _ in range(10)))
    assert {node for node, _ in short} == {"b"}
    assert len(a.received) == 3  # nothing new reached the drained node

    results = await asyncio.gather(*long_streams)
    assert sorted(node for node, _ in results) == ["a"] * 3 + ["b"] * 3
    assert all(data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 21 for _, data in results)
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 16, what="16 finished events")
    assert {d["outcome"] for _, d in tap.of(sj.REQ_FINISHED)} == {"completed"}
    started_on_a = [d for s, d in tap.of(sj.REQ_STARTED) if s == sj.req_started("a")]
    assert len(started_on_a) == 3 and all(d["snapshot_seq"] < drain_seq for d in started_on_a)


async def test_removal_and_new_snapshots_leave_admitted_requests_alone(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    a, b = await engines("a"), await engines("b")
    await core.register("b", b.url)
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", a.url))
    streams = [asyncio.create_task(_stream(http, proxy.url, chunks=10, delay=0.05)) for _ in range(4)]
    await wait_for(lambda: len(a.received) + len(b.received) == 4)
    for _ in range(3):
        await core.tick()
    await core.send(sj.admin_remove("a"), {})
    await core.send(sj.admin_node("b"), {"url": b.url, "capacity": 9})
    await wait_seq(proxy, "default", core.seq)
    assert "a" not in proxy.state.router.table.route("default").first.targets
    results = await asyncio.gather(*streams)
    assert all(data.endswith(b"data: [DONE]\n\n") for _, data in results)


async def test_graceful_stop_lets_streams_finish_and_publishes_stopped(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, tap: EventTap) -> None:
    engine = await engines("a")
    proxy = await start_proxy(grace_s=5.0)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    streams = [asyncio.create_task(_stream(http, proxy.url, chunks=10, delay=0.05)) for _ in range(3)]
    await wait_for(lambda: len(engine.received) == 3)
    stopping = asyncio.create_task(proxy.stop())
    await wait_for(lambda: proxy.state.stopping)
    await wait_for(lambda: proxy.site not in proxy.runner.sites, what="the listening socket closed")
    try:  # the listening socket is closed at once, while the streams go on
        async with aiohttp.ClientSession() as fresh:
            await fresh.post(proxy.url + CHAT, json={"model": "m"})
        raise AssertionError("a new connection was accepted during shutdown")
    except aiohttp.ClientConnectionError:
        pass
    results = await asyncio.gather(*streams)
    assert all(data.endswith(b"data: [DONE]\n\n") for _, data in results)
    await stopping
    await wait_for(lambda: len(tap.of(sj.PROXY_STOPPED)) == 1, what="stopped event")
    outcomes = [d["outcome"] for _, d in tap.of(sj.REQ_FINISHED)]
    assert outcomes == ["completed"] * 3
    last = tap.messages[-1][0]
    assert last == sj.proxy_stopped("test-proxy")  # after every request event


async def test_grace_period_over_aborts_with_router_aborted(engines, core: CoreDriver, start_proxy: StartProxy,
                                                            http: aiohttp.ClientSession, tap: EventTap) -> None:
    engine = await engines("a")
    proxy = await start_proxy(grace_s=0.2)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    stream = asyncio.create_task(_stream(http, proxy.url, chunks=40, delay=0.05))
    await wait_for(lambda: len(engine.received) == 1)
    await proxy.stop()
    _, data = await stream
    assert b"[DONE]" not in data
    assert data.rstrip().splitlines()[-1].startswith(b'data: {"error"')  # told, not silently cut
    await wait_for(lambda: len(tap.of(sj.PROXY_STOPPED)) == 1)
    [(_, finished)] = tap.of(sj.REQ_FINISHED)
    assert finished["outcome"] == "router_aborted"


async def test_nats_outage_keeps_routing_and_buffers_events(engines, core: CoreDriver, start_proxy: StartProxy,
                                                            http: aiohttp.ClientSession,
                                                            nats_server: EmbeddedNats) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    await wait_for(lambda: proxy.state.bus.connected)
    nats_server.stop()
    await wait_for(lambda: not proxy.state.bus.connected, what="the proxy to notice")
    for _ in range(5):
        _, data = await _stream(http, proxy.url, chunks=2, delay=0)
        assert data.endswith(b"[DONE]\n\n")
    health = await (await http.get(proxy.url + "/healthz")).json()
    assert health["status"] == "stale" and health["nats_connected"] is False
    assert proxy.state.events.buffered >= 10

    nats_server.start()  # same port and store: the proxy reconnects and publishes what waited
    await wait_for(lambda: proxy.state.events.buffered == 0, timeout=15, what="buffered events published")
    js = proxy.state.bus.nc.jetstream()  # type: ignore[union-attr]
    batches = await stored_batches(js)
    log = Path(nats_server.log_file or "").read_text(errors="replace")[-3000:] if nats_server.log_file else ""
    events = batch_events(batches)
    assert len(events) >= 10, (batches, proxy.state.events.published, log)
    assert proxy.state.events.dropped == 0
    _assert_each_attempt_once_in_order(events, attempts=5)
    boot = proxy.state.events.boot_id
    assert [msg_id for _, msg_id, _ in batches] == [f"test-proxy:{boot}:{n}" for n in range(1, len(batches) + 1)]
    assert [payload["batch"] for _, _, payload in batches] == list(range(1, len(batches) + 1))


def _assert_each_attempt_once_in_order(events: list[tuple[str, str | None, dict]], attempts: int) -> None:
    """Every attempt's started and finished exactly once, started first (de-duplicated, in order)."""
    started = [e["request_id"] for kind, _, e in events if kind == "req.started"]
    finished = [e["request_id"] for kind, _, e in events if kind == "req.finished"]
    assert len(started) == len(set(started)) == len(finished) == len(set(finished)) == attempts, events
    position = {(kind, e.get("request_id")): i for i, (kind, _, e) in enumerate(events)}
    assert all(position[("req.started", rid)] < position[("req.finished", rid)] for rid in started)


async def test_a_batch_re_sent_after_a_lost_ack_is_stored_once(engines, core: CoreDriver, start_proxy: StartProxy,
                                                               http: aiohttp.ClientSession,
                                                               nats_server: EmbeddedNats) -> None:
    """NATS frozen (SIGSTOP by its pid) while a batch is out: its ack never comes in time, the
    proxy publishes it again under the same Nats-Msg-Id, and JetStream, once thawed, stores the
    first copy and de-duplicates the others."""
    engine = await engines("a")
    proxy = await start_proxy(heartbeat_s=60)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    await wait_for(lambda: proxy.state.bus.connected)
    events = proxy.state.events
    await wait_for(lambda: events.buffered == 0, what="the first heartbeat published")
    events.ack_timeout_s = 0.3
    assert nats_server.process is not None
    pid = nats_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            _, data = await _stream(http, proxy.url, chunks=2, delay=0)
            assert data.endswith(b"[DONE]\n\n")
        await wait_for(lambda: events.resent >= 2, timeout=10, what="the batch published again")
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_for(lambda: events.buffered == 0, timeout=15, what="the batch acknowledged")
    batches = await stored_batches(proxy.state.bus.nc.jetstream())  # type: ignore[union-attr]
    ids = [msg_id for _, msg_id, _ in batches]
    assert len(ids) == len(set(ids)) == events.batches_published  # every batch stored once
    _assert_each_attempt_once_in_order(batch_events(batches), attempts=3)
    assert events.dropped == 0
    metrics = await (await http.get(proxy.url + "/metrics")).text()
    assert f"laswrr_proxy_event_batches_resent_total {float(events.resent)}" in metrics


async def test_event_buffer_drops_oldest_when_full(engines, core: CoreDriver, start_proxy: StartProxy,
                                                   http: aiohttp.ClientSession, nats_server: EmbeddedNats) -> None:
    engine = await engines("a")
    proxy = await start_proxy(event_buffer=4, heartbeat_s=60)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    nats_server.stop()
    await wait_for(lambda: not proxy.state.bus.connected)
    for _ in range(5):
        await _stream(http, proxy.url, chunks=1, delay=0)
    assert proxy.state.events.buffered == 4 and proxy.state.events.dropped == 6
    metrics = await (await http.get(proxy.url + "/metrics")).text()
    assert "laswrr_proxy_events_dropped_total 6.0" in metrics


async def test_a_batch_re_sent_after_a_nats_restart_is_stored_once(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        nats_server: EmbeddedNats) -> None:
    """NATS dies after storing a batch but before its ack reached the proxy (the batch is put
    back as unacknowledged, byte for byte, as the proxy holds it then). After the restart the
    proxy publishes it again under the same Nats-Msg-Id, and JetStream, whose de-duplication
    window survived the restart, keeps the one copy it had."""
    engine = await engines("a")
    proxy = await start_proxy(heartbeat_s=60)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    events = proxy.state.events
    for _ in range(3):
        await _stream(http, proxy.url, chunks=1, delay=0)
    await wait_for(lambda: events.buffered == 0 and events.published >= 6, what="the events acknowledged")
    js = proxy.state.bus.nc.jetstream()  # type: ignore[union-attr]
    before = await stored_batches(js)
    seq, msg_id, _ = before[-1]
    raw = await js.get_msg(sj.EVENTS_STREAM, seq)
    items = [bytes(item) for item in msgspec.json.decode(raw.data, type=RequestBatch).events]
    events.batches.unacked.append(Batch(int(msg_id.rsplit(":", 1)[1]), msg_id, items, sends=1))  # its ack was lost
    events.batches.unacked_events += len(items)
    nats_server.stop()
    nats_server.start()
    events._wakeup.set()
    await wait_for(lambda: events.buffered == 0, timeout=15, what="the batch published again")
    assert events.resent >= 1
    js = proxy.state.bus.nc.jetstream()  # type: ignore[union-attr]
    after = await stored_batches(js)
    assert [msg_id for _, msg_id, _ in after] == [msg_id for _, msg_id, _ in before]  # no second copy
    _assert_each_attempt_once_in_order(batch_events(after), attempts=3)


async def test_a_full_buffer_drops_the_oldest_events_even_from_a_batch_in_flight(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        nats_server: EmbeddedNats) -> None:
    """NATS frozen with a batch out and re-sent: new events pile up behind it, and past
    ``--event-buffer`` the oldest go, first from that batch. Once NATS thaws every event is in
    the stream at most once, in order, the newest all kept, and whatever is missing was counted
    dropped (an event dropped from a batch whose first copy NATS had already read is delivered
    all the same: the re-sent, shorter copy is de-duplicated)."""
    engine = await engines("a")
    proxy = await start_proxy(event_buffer=6, event_flush_ms=0, heartbeat_s=600)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    await wait_for(lambda: proxy.state.bus.connected)
    events = proxy.state.events
    await wait_for(lambda: events.buffered == 0)
    events.ack_timeout_s = 0.3
    assert nats_server.process is not None
    pid = nats_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await _stream(http, proxy.url, chunks=1, delay=0)
        await wait_for(lambda: events.resent >= 1, what="the first batch re-sent")
        for _ in range(7):  # 16 events in all, one request after the other, behind a capacity of 6
            _, data = await _stream(http, proxy.url, chunks=1, delay=0)
            assert data.endswith(b"[DONE]\n\n")
        assert events.buffered == 6 and events.dropped + events.buffered + events.published == 16
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_for(lambda: events.buffered == 0, timeout=15, what="the rest acknowledged")
    boot = events.boot_id
    produced = [(kind, f"test-proxy-{boot}-{n}") for n in range(1, 9) for kind in ("req.started", "req.finished")]
    batches = await stored_batches(proxy.state.bus.nc.jetstream())  # type: ignore[union-attr]
    stored = [(kind, event["request_id"]) for kind, _, event in batch_events(batches)]
    assert stored == [event for event in produced if event in stored]  # each at most once, in order
    assert stored[-6:] == produced[-6:]  # the newest six all kept
    assert len(stored) + events.dropped >= len(produced) > len(stored)  # what is missing was counted


async def test_cli_sigterm_drains_and_exits_zero(engines, core: CoreDriver, nats_url: str, tap: EventTap,
                                                 http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    await core.register("a", engine.url)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr.services.proxy.cli", "--nats-url", nats_url, "--host", "127.0.0.1", "--port", "0",
        "--proxy-id", "cli-proxy", "--grace-s", "10", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        assert line.startswith("proxy listening on "), line
        url = line.split()[-1]
        for _ in range(100):  # until it holds the snapshot
            async with http.get(url + "/healthz") as resp:
                if (await resp.json())["pools"]:
                    break
            await asyncio.sleep(0.05)
        stream = asyncio.create_task(_stream(http, url, chunks=10, delay=0.05))
        await wait_for(lambda: len(engine.received) == 1)
        proc.send_signal(signal.SIGTERM)
        _, data = await stream
        assert data.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await wait_for(lambda: len(tap.of(sj.PROXY_STOPPED)) == 1)
    assert tap.of(sj.PROXY_STOPPED)[0][0] == sj.proxy_stopped("cli-proxy")
    assert [d["outcome"] for _, d in tap.of(sj.REQ_FINISHED)] == ["completed"]
