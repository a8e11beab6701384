"""Flow control on real processes (a nats-server, the real core feeding LB_WEIGHTS, real HTTP
engines, the proxy): held requests leave by priority band, by deficit round robin between API
keys, at the TTL (429), after the no-node wait (503), when their client leaves, and never to a
node drained while they waited; two proxies each hold their own queue on the pool-wide view."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy_support import CoreDriver, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.schemas.words import Band
from laswrr.services.proxy.app import RunningProxy
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

CHAT = "/v1/chat/completions"


def body(tag: str, chunks: int = 1, delay: float = 0.0, max_tokens: int = 100) -> dict[str, Any]:
    return {"model": "default", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}], "test": {"chunks": chunks, "delay": delay, "tag": tag}}


def tags(engine: Any) -> list[str]:
    return [b["test"]["tag"] for b in engine.received]


def held(proxy: RunningProxy, pool: str = "default") -> int:
    assert proxy.state.flow is not None
    return proxy.state.flow.queue.depth(pool)


def releases(proxy: RunningProxy, pool: str = "default") -> int:
    """Requests of ``pool`` whose end flow control has processed (each one pumps the queue at once)."""
    assert proxy.state.flow is not None
    state = proxy.state.flow.queue.pools.get(pool)
    return 0 if state is None else len(state.releases)


async def post(http: aiohttp.ClientSession, proxy: RunningProxy, payload: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with http.post(proxy.url + CHAT, json=payload, headers=headers or {}) as response:
        return response.status, dict(response.headers), await response.read()


async def hold(http: aiohttp.ClientSession, proxy: RunningProxy, payload: dict[str, Any],
               headers: dict[str, str] | None = None) -> asyncio.Task[tuple[int, dict[str, str], bytes]]:
    """Send a request that will be held; return once the proxy holds it (order is arrival order)."""
    before = held(proxy)
    task = asyncio.create_task(post(http, proxy, payload, headers))
    await wait_for(lambda: held(proxy) == before + 1, what=f"{payload['test']['tag']} held")
    return task


async def one_node(core: CoreDriver, engines: Any, start_proxy: StartProxy, capacity: int = 1,
                   **flags: Any) -> tuple[Any, RunningProxy]:
    engine = await engines("a")
    seq = await core.register("a", engine.url, capacity=capacity)
    proxy = await start_proxy(flow_control=True, **flags)
    await wait_seq(proxy, "default", seq)
    view = proxy.state.router.table.route("default").snapshot.nodes[0]
    assert view.concurrency_limit == capacity  # the slot limit, published by the core (factor 1.0)
    return engine, proxy


async def test_held_requests_leave_by_band_interactive_first(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1)))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    waiting = [await hold(http, proxy, body(tag), {"x-laswrr-priority": band})
               for tag, band in (("b1", "batch"), ("d1", "default"), ("i1", "interactive"), ("b2", "batch"),
                                 ("i2", "interactive"), ("none", ""))]
    for task in [blocker, *waiting]:
        status, headers, _ = await task
        assert status == 200 and headers["x-laswrr-node"] == "a"
    # one slot: each held request is dispatched when the previous one ends, interactive first
    assert tags(engine) == ["blocker", "i1", "i2", "d1", "none", "b1", "b2"]
    assert held(proxy) == 0


async def test_bad_flow_headers_are_a_400(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    _engine, proxy = await one_node(core, engines, start_proxy)
    for headers in ({"x-laswrr-priority": "urgent"}, {"x-laswrr-ttl-ms": "-1"}):
        status, _, raw = await post(http, proxy, body("bad"), headers)
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "invalid_header" and "x-laswrr-" in error["message"]


async def test_api_keys_share_by_work_and_the_keys_maximum_band_applies(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("heavy:k-heavy max_priority=batch\nlight:k-light\nold-style-key\n")
    engine, proxy = await one_node(core, engines, start_proxy, api_keys_file=str(keys))
    auth = {"heavy": {"Authorization": "Bearer k-heavy", "x-laswrr-priority": "interactive"},  # capped to batch
            "light": {"Authorization": "Bearer k-light", "x-laswrr-priority": "batch"}}
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1),
                                       {"Authorization": "Bearer old-style-key"}))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    # work 1002 (a 2-token prompt + max_tokens 1000) against the quantum 1024: one request a turn
    waiting = [await hold(http, proxy, body(f"h{i}", max_tokens=1000), auth["heavy"]) for i in range(6)]
    waiting += [await hold(http, proxy, body(f"l{i}", max_tokens=1000), auth["light"]) for i in range(3)]
    for task in [blocker, *waiting]:
        assert (await task)[0] == 200
    # one band (heavy's interactive capped to batch), equal work per request: the keys alternate
    assert tags(engine) == ["blocker", "h0", "l0", "h1", "l1", "h2", "l2", "h3", "h4", "h5"]


async def test_a_larger_request_costs_more_turns(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("big:k-big\nsmall:k-small\n")
    engine, proxy = await one_node(core, engines, start_proxy, api_keys_file=str(keys), flow_quantum=1000)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1),
                                       {"Authorization": "Bearer k-small"}))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    waiting = [await hold(http, proxy, body(f"B{i}", max_tokens=2998), {"Authorization": "Bearer k-big"})
               for i in range(2)]
    waiting += [await hold(http, proxy, body(f"s{i}", max_tokens=998), {"Authorization": "Bearer k-small"})
                for i in range(6)]
    for task in [blocker, *waiting]:
        assert (await task)[0] == 200
    # work 3000 against 1000 (max_tokens + the 2-token prompt): three small per big
    assert tags(engine) == ["blocker", "s0", "s1", "B0", "s2", "s3", "s4", "B1", "s5"]


async def test_ttl_expiry_is_a_429_with_the_limit_named(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, retry_after_cap_s=5.0)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=20, delay=0.1)))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    status, headers, raw = await post(http, proxy, body("short"), {"x-laswrr-ttl-ms": "300"})
    error = json.loads(raw)["error"]
    assert status == 429 and error["code"] == "queue_timeout" and error["type"] == "requests"
    assert "time to live" in error["message"]
    assert headers["Retry-After"] == "5"  # no release seen in the pool yet: the cap
    assert (await blocker)[0] == 200 and "short" not in tags(engine)


async def test_queue_full_is_a_429_at_once(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, queue_bound=1)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1)))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    first = await hold(http, proxy, body("b1"), {"x-laswrr-priority": "batch"})
    status, _, raw = await post(http, proxy, body("b2"), {"x-laswrr-priority": "batch"})
    assert status == 429 and json.loads(raw)["error"]["code"] == "queue_full"
    other_band = await hold(http, proxy, body("i1"), {"x-laswrr-priority": "interactive"})  # its own bound
    for task in (blocker, first, other_band):
        assert (await task)[0] == 200
    async with http.get(proxy.url + "/metrics") as response:
        text = await response.text()
    assert 'laswrr_proxy_flow_refused_total{band="batch",cause="queue_full",pool="default"} 1.0' in text
    assert 'laswrr_proxy_queue_depth{band="batch",pool="default"} 0.0' in text


async def test_no_routable_node_is_a_503_after_the_short_wait(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, no_node_wait_ms=400)
    seq = await core.capacity("a", 0)  # drained: no routable node in the pool
    await wait_seq(proxy, "default", seq)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, headers, raw = await post(http, proxy, body("r"))
    waited = loop.time() - started
    error = json.loads(raw)["error"]
    assert status == 503 and error["code"] == "no_routable_node" and headers["Retry-After"] == "1"
    assert waited >= 0.4
    status, _, _ = await post(http, proxy, body("r2"))  # still none: at once
    assert status == 503 and engine.received == []


async def test_a_node_back_within_the_wait_takes_the_held_request(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, no_node_wait_ms=5000)
    await wait_seq(proxy, "default", await core.capacity("a", 0))
    task = await hold(http, proxy, body("r"))
    await core.capacity("a", 1)  # back (slow start)
    status, headers, _ = await task
    assert status == 200 and headers["x-laswrr-node"] == "a" and tags(engine) == ["r"]


async def test_a_client_that_leaves_while_held_leaves_the_queue(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1)))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    task = await hold(http, proxy, body("gone"))
    task.cancel()  # the client closes its connection
    await wait_for(lambda: held(proxy) == 0, timeout=2, what="the held request gone from the queue")
    assert (await blocker)[0] == 200
    # the next request takes the one slot after what was dispatched before it: a "gone" sent on
    # would have reached the engine first
    assert (await post(http, proxy, body("after")))[0] == 200
    assert tags(engine) == ["blocker", "after"]  # "gone" never dispatched
    async with http.get(proxy.url + "/metrics") as response:
        text = await response.text()
    assert 'cause="client_disconnected"' in text


async def test_a_node_drained_while_requests_wait_never_gets_them(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    a, b = await engines("a"), await engines("b")
    await core.register("a", a.url, capacity=1)
    seq = await core.register("b", b.url, capacity=1)
    proxy = await start_proxy(flow_control=True)
    await wait_seq(proxy, "default", seq)
    short = asyncio.create_task(post(http, proxy, body("short", chunks=5, delay=0.1)))
    long = asyncio.create_task(post(http, proxy, body("long", chunks=15, delay=0.1)))
    await wait_for(lambda: len(a.received) + len(b.received) == 2, what="both nodes busy")
    on_short = a if tags(a) == ["short"] else b
    on_long = b if on_short is a else a
    waiting = await hold(http, proxy, body("held"))
    drained = await core.send(sj.admin_drain(on_short.name), {})
    await wait_seq(proxy, "default", drained)
    before = releases(proxy)
    status_short, _, raw_short = await short
    assert status_short == 200 and b"[DONE]" in raw_short  # the admitted request finished, not cut
    await wait_for(lambda: releases(proxy) > before, what="the proxy's release of the short request")
    assert held(proxy) == 1  # the drained node's slot freed, but it is not routable: still held
    status, headers, _ = await waiting
    assert status == 200 and headers["x-laswrr-node"] == on_long.name
    status_long, _, raw_long = await long
    assert status_long == 200 and b"[DONE]" in raw_long
    assert tags(on_short) == ["short"]


async def test_rate_limits_per_key(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("slow:k-slow rpm=2\ntokens:k-tok tpm=500\nfree:k-free\n")
    _engine, proxy = await one_node(core, engines, start_proxy, capacity=4, api_keys_file=str(keys))
    slow = {"Authorization": "Bearer k-slow"}
    assert [(await post(http, proxy, body("s"), slow))[0] for _ in range(2)] == [200, 200]
    status, headers, raw = await post(http, proxy, body("s"), slow)
    error = json.loads(raw)["error"]
    assert status == 429 and error["code"] == "rate_limit_requests" and error["type"] == "requests"
    assert 29 <= int(headers["Retry-After"]) <= 30  # one request a 30 s
    tok = {"Authorization": "Bearer k-tok"}
    assert (await post(http, proxy, body("t", max_tokens=400), tok))[0] == 200  # 401 charged; used 7 + 1
    # settled with the usage: 393 given back, so another 400 fits
    assert (await post(http, proxy, body("t", max_tokens=400), tok))[0] == 200
    status, headers, raw = await post(http, proxy, body("t", max_tokens=498), tok)  # 500: more than is left
    error = json.loads(raw)["error"]
    assert status == 429 and error["code"] == "rate_limit_tokens" and error["type"] == "tokens"
    assert int(headers["Retry-After"]) >= 1 and "500 tokens per minute" in error["message"]
    free = [(await post(http, proxy, body("f"), {"Authorization": "Bearer k-free"}))[0] for _ in range(3)]
    assert free == [200] * 3


@pytest.mark.parametrize("flow", [True])
async def test_two_proxies_hold_their_own_queues_on_the_pool_wide_view(
        flow: bool, engines: Any, nc: Any, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    js = nc.jetstream()
    service = SchedulerService(nc, SchedulerOptions(tick_ms=100, replica_id="sched-test", checkpoint_every=0))
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        engine = await engines("a")
        await js.publish(sj.admin_node("a"), json.dumps({"url": engine.url, "capacity": 2}).encode())
        p1 = await start_proxy(proxy_id="p1", flow_control=flow)
        p2 = await start_proxy(proxy_id="p2", flow_control=flow)
        for proxy in (p1, p2):
            await wait_for(lambda proxy=proxy: "a" in proxy.state.router.table.candidates("default"),
                           timeout=10, what="routes on a")
        first = asyncio.create_task(post(http, p1, body("p1-long", chunks=30, delay=0.1)))
        second = asyncio.create_task(post(http, p1, body("p1-long2", chunks=30, delay=0.1)))
        await wait_for(lambda: len(engine.received) == 2, what="a full through p1")

        def p2_sees_a_full() -> bool:
            route = p2.state.router.table.route("default")
            return route.snapshot.nodes[0].inflight == 2

        await wait_for(p2_sees_a_full, timeout=10, what="p2's snapshot shows p1's two requests")
        waiting = await hold(http, p2, body("p2-held"))  # p2 holds on the pool-wide count, not its own 0
        assert held(p1) == 0
        for task in (first, second, waiting):
            assert (await task)[0] == 200
        assert tags(engine)[-1] == "p2-held"
    finally:
        stop.set()
        await asyncio.wait_for(runner, 10)


def test_keys_file_fields_and_old_files() -> None:
    from laswrr.scheduler.routing.flow import KeyLimits
    from laswrr.services.proxy.keys import KeysFileError, parse_key_lines

    lines = parse_key_lines("alice:k1\nk2\n  bob : k3 \nbig:k4 max_priority=batch tpm=1000\nk5 rpm=3 max_priority=default")
    assert [(name, limits) for name, _, limits in lines] == [
        ("alice", KeyLimits()), ("key-2", KeyLimits()), ("bob", KeyLimits()),
        ("big", KeyLimits(max_band=Band.BATCH, tpm=1000)), ("key-5", KeyLimits(max_band=Band.DEFAULT, rpm=3))]
    assert KeyLimits().max_band is Band.INTERACTIVE  # a key without a maximum may use every band
    for bad, words in (("a:k x=1", "optional fields"), ("a:k rpm=0", "positive integer"),
                       ("a:k max_priority=urgent", "max_priority must be"), ("a:k rpm=1 rpm=2", "each once"),
                       ("a:k tpm=1.5", "positive integer")):
        with pytest.raises(KeysFileError, match=words):
            parse_key_lines(bad)


async def test_held_requests_are_in_the_log_from_queued_to_started_or_refused(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, tap: Any) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, retry_after_cap_s=5.0)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=10, delay=0.1)))
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    dispatched = await hold(http, proxy, body("later"), {"x-laswrr-priority": "batch"})
    gone = await hold(http, proxy, body("gone"))
    expired = asyncio.create_task(post(http, proxy, body("short"), {"x-laswrr-ttl-ms": "300"}))
    await wait_for(lambda: held(proxy) == 3, what="three held")
    gone.cancel()
    status, headers, _ = await expired
    assert status == 429
    assert (await blocker)[0] == 200 and (await dispatched)[0] == 200

    def queued() -> list[dict[str, Any]]:
        return [d for _, d in tap.of(sj.REQ_QUEUED)]

    await wait_for(lambda: len(queued()) == 3 and len(tap.of(sj.REQ_REFUSED)) == 2
                   and len(tap.of(sj.REQ_FINISHED)) == 2, timeout=10, what="the queue's events in the log")
    by_band = {d["band"]: d for d in queued()}
    assert set(by_band) == {"batch", "default"} and by_band["batch"]["cause"] == "saturated"
    assert all(d["proxy"] == "test-proxy" and d["pool"] == "default" and d["ttl_ms"] > 0 for d in queued())
    started = {d["request_id"]: d for _, d in tap.of(sj.REQ_STARTED)}
    assert by_band["batch"]["request_id"] in started  # dispatched: the same id, now on a node
    refused = {d["request_id"]: d for _, d in tap.of(sj.REQ_REFUSED)}
    expiry = refused[headers["x-laswrr-request-id"]]
    assert expiry["status"] == 429 and expiry["cause"] == "queue_timeout"
    left = [d for d in refused.values() if d["status"] == 499]
    assert len(left) == 1 and left[0]["cause"] == "client_disconnected"
    assert {expiry["request_id"], left[0]["request_id"]} <= {d["request_id"] for d in queued()}


async def test_interactive_requests_find_the_reserved_slot(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    engine, proxy = await one_node(core, engines, start_proxy, capacity=10)  # limit 10, 9 for default and batch
    blockers = [asyncio.create_task(post(http, proxy, body(f"b{i}", chunks=15, delay=0.1), {"x-laswrr-priority": "batch"}))
                for i in range(9)]
    await wait_for(lambda: len(engine.received) == 9, what="nine batch requests on a")
    waiting = await hold(http, proxy, body("b9"), {"x-laswrr-priority": "batch"})  # the tenth slot is reserved
    status, headers, _ = await post(http, proxy, body("i0"), {"x-laswrr-priority": "interactive"})
    assert status == 200 and tags(engine)[-1] == "i0"  # at once, into the reserve, while b9 waits
    assert held(proxy) == 1 and not waiting.done()
    for task in [*blockers, waiting]:
        assert (await task)[0] == 200
    assert tags(engine)[-1] == "b9"


async def test_a_slot_another_proxy_frees_goes_to_the_more_urgent_band_it_holds(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two proxies on one 2-slot node, no snapshot after the first (the core driver sends none):
    p1 holds an interactive request, p2 a batch one; a release on p2 leaves the slot to p1's,
    which p1 takes on p2's peer message (the 50 ms tick is off here), then p2's goes."""
    import laswrr.services.proxy.flow as flow_io

    monkeypatch.setattr(flow_io, "TICK_S", 30.0)  # only a release or a peer message can wake a held request
    engine = await engines("a")
    seq = await core.register("a", engine.url, capacity=2)
    p1 = await start_proxy(proxy_id="p1", flow_control=True)
    p2 = await start_proxy(proxy_id="p2", flow_control=True)
    for proxy in (p1, p2):
        await wait_seq(proxy, "default", seq)
    await wait_for(lambda: "p2" in p1.state.router.table.route("default").peers
                   and "p1" in p2.state.router.table.route("default").peers, what="each hears the other")
    short = asyncio.create_task(post(http, p2, body("p2-short", chunks=10, delay=0.1)))
    long = asyncio.create_task(post(http, p2, body("p2-long", chunks=60, delay=0.1)))
    await wait_for(lambda: len(engine.received) == 2, what="a full through p2")
    await wait_for(lambda: p1.state.router.table.load.load.get("a") == 2, what="p1 counts p2's two requests (its messages)")
    batch = await hold(http, p2, body("p2-batch"), {"x-laswrr-priority": "batch"})
    interactive = await hold(http, p1, body("p1-interactive"), {"x-laswrr-priority": "interactive"})
    await wait_for(lambda: p2.state.router.channel.peer_held("default") == {"interactive": 1},
                   what="p2 hears that p1 holds an interactive request")
    assert p1.state.router.channel.peer_held("default") == {"batch": 1}
    status, headers, _ = await interactive  # before p2-long ends (6 s): woken by p2's message
    assert status == 200 and headers["x-laswrr-node"] == "a" and not long.done()
    assert tags(engine) == ["p2-short", "p2-long", "p1-interactive"] and not batch.done()
    assert p2.state.flow is not None and p2.state.flow.deferred >= 1  # p2's release left the slot to p1
    for task in (short, long, batch):
        assert (await task)[0] == 200
    assert tags(engine)[-1] == "p2-batch"


async def test_a_held_request_is_dispatched_within_its_ttft_target_or_answered_when_it_passes(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """Latency objectives under flow control (docs/proxy.md, "Latency objectives"): a request is
    held only while its TTFT target can still be met (its time to live capped at the target)."""
    engine, proxy = await one_node(core, engines, start_proxy, retry_after_cap_s=5.0)
    blocker = asyncio.create_task(post(http, proxy, body("blocker", chunks=30, delay=0.1)))  # the one slot, ~3 s
    await wait_for(lambda: tags(engine) == ["blocker"], what="the blocker on a")
    within = await hold(http, proxy, body("within"), {"x-laswrr-ttft-slo-ms": "60000"})
    late = await hold(http, proxy, body("late"), {"x-laswrr-ttft-slo-ms": "300"})
    status, _, raw = await late
    assert status == 429 and json.loads(raw)["error"]["code"] == "queue_timeout"
    assert not blocker.done() and not within.done()  # answered at its target, not when the slot freed
    assert (await blocker)[0] == 200
    status, _, _ = await within
    assert status == 200 and tags(engine) == ["blocker", "within"]  # dispatched on the freed slot
