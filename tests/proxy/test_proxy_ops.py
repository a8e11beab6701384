"""Operations: /healthz, /metrics, /v1/models fallback, heartbeats, replicas side by side."""

from __future__ import annotations

import time

import aiohttp

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.services.nats_server import free_port

CHAT = "/v1/chat/completions"


async def test_healthz_reports_snapshot_and_nats(engines, core: CoreDriver, start_proxy: StartProxy,
                                                 http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    async with http.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "no_snapshot"
    engine = await engines("a")
    seq = await core.register("a", engine.url)
    await wait_seq(proxy, "default", seq)
    await wait_for(lambda: proxy.state.bus.connected)
    async with http.get(proxy.url + "/healthz") as resp:
        health = await resp.json()
    assert health["status"] == "ok" and health["nats_connected"] is True and health["proxy"] == "test-proxy"
    pool = health["pools"]["default"]
    assert pool["as_of_seq"] == seq and pool["routable"] == ["a"] and 0 <= pool["age_s"] < 5


async def test_metrics_exposition(engines, core: CoreDriver, start_proxy: StartProxy,
                                  http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    async with http.post(proxy.url + CHAT, json={"model": "m", "stream": True, "messages": []}) as resp:
        await resp.read()
    async with http.post(proxy.url + CHAT, data=b"{") as resp:
        assert resp.status == 400
    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for line in ('laswrr_proxy_requests_total{node="a",outcome="completed",pool="default"} 1.0',
                 'laswrr_proxy_rejected_total{reason="invalid_json"} 1.0',
                 'laswrr_node_inflight{node="a",pool="default"} 0.0',
                 'laswrr_node_effective_weight{node="a",pool="default"} 4.0',
                 'laswrr_node_target_weight{node="a",pool="default"}',
                 'laswrr_node_routable{node="a",pool="default"} 1.0',
                 'laswrr_node_phase{node="a",phase="active",pool="default"} 1.0',
                 'laswrr_node_phase{node="a",phase="draining",pool="default"} 0.0',
                 'laswrr_proxy_responses_total{code="200"} 1.0',
                 'laswrr_proxy_responses_total{code="400"} 1.0',
                 "# TYPE laswrr_proxy_events_published_total counter",
                 "# TYPE laswrr_proxy_events_dropped_total counter",
                 'laswrr_proxy_ttft_seconds_count{pool="default"} 1.0',
                 'laswrr_proxy_duration_seconds_count{pool="default"} 1.0',
                 "laswrr_proxy_overhead_seconds_count 1.0",
                 "laswrr_proxy_nats_connected 1.0",
                 "laswrr_proxy_events_dropped_total 0.0"):
        assert line in text, line
    assert 'laswrr_proxy_snapshot_age_seconds{pool="default"}' in text


async def test_models_fall_back_to_pool_names(core: CoreDriver, start_proxy: StartProxy,
                                              http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    await core.register("x", f"http://127.0.0.1:{free_port()}", pool="llama")
    await wait_seq(proxy, "default", await core.register("y", f"http://127.0.0.1:{free_port()}"))
    async with http.get(proxy.url + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["default", "llama"]


async def test_replicas_side_by_side_heartbeat_and_share_snapshots(engines, core: CoreDriver,
                                                                   start_proxy: StartProxy, tap: EventTap,
                                                                   http: aiohttp.ClientSession) -> None:
    a, b = await engines("a"), await engines("b")
    await core.register("a", a.url)
    seq = await core.register("b", b.url)
    replicas = [await start_proxy(proxy_id=f"replica-{i}", heartbeat_s=0.2) for i in range(2)]
    for proxy in replicas:
        await wait_seq(proxy, "default", seq)
        # the replicas share their in-flight (lb.peer): a release is told within --peer-interval-ms,
        # so the second one starts once it has heard the first one's last release
        await wait_for(lambda p=proxy: not p.state.router.table.route("default").others, what="the other replica idle")
        for _ in range(4):
            async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as resp:
                assert resp.status == 200
    assert len(a.received) == len(b.received) == 4  # each replica alternates on its own
    done_ns = time.time_ns()  # every request answered: a heartbeat from now on counts none in flight

    def after_requests() -> dict[str, int]:
        return {s: d["inflight"] for s, d in tap.of(sj.PROXY_HEARTBEAT) if d["ts_ns"] > done_ns}

    await wait_for(lambda: set(after_requests()) == {sj.proxy_heartbeat("replica-0"), sj.proxy_heartbeat("replica-1")},
                   what="both heartbeats")
    assert set(after_requests().values()) == {0}
    proxies = {d["proxy"] for _, d in tap.of(sj.REQ_STARTED)}
    assert proxies == {"replica-0", "replica-1"}


async def test_a_drain_snapshot_is_acknowledged_at_once_after_the_admissions_before_it(
        engines, core: CoreDriver, start_proxy: StartProxy, tap: EventTap, http: aiohttp.ClientSession) -> None:
    """The scheduler's drained waits for each proxy to say it routes on the drain's snapshot
    (scheduler/core.py ``_check_drained``): the proxy says so as soon as a snapshot takes a node out
    of rotation, not at its next heartbeat, and after the events of what it admitted before."""
    a, b = await engines("a"), await engines("b")
    await core.register("a", a.url)
    proxy = await start_proxy(heartbeat_s=600)  # no periodic heartbeat within this test
    seq = await core.register("b", b.url)
    await wait_seq(proxy, "default", seq)
    for _ in range(2):
        async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as resp:
            assert resp.status == 200
    await wait_seq(proxy, "default", await core.capacity("b", 6))  # both stay in rotation: no heartbeat
    drain = await core.send(sj.admin_drain("a"), {})
    await wait_for(lambda: any(d.get("snapshot_seq") == drain for _, d in tap.of(sj.PROXY_HEARTBEAT)),
                   what="a heartbeat naming the drain's snapshot")
    heartbeats = [d for _, d in tap.of(sj.PROXY_HEARTBEAT)]
    assert [d["snapshot_seq"] for d in heartbeats] == [drain] and heartbeats[0]["inflight"] == 0
    order = [subject for subject, _ in tap.messages]
    starts = [i for i, subject in enumerate(order) if subject.startswith(sj.REQ_STARTED)]
    assert len(starts) == 2 and order.index(sj.proxy_heartbeat(proxy.state.config.proxy_id)) > max(starts)
