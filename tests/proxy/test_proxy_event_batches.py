"""The proxy's request events go out as ``lb.req.batch.<proxy>`` messages (services/proxy/events.py).

A batch is cut when ``--event-batch-max`` events wait or ``--event-flush-ms`` after the first
of them; at shutdown whatever waits goes out at once. The flush interval here is ten minutes,
so any batch that arrives during the test was cut by the event count or by the shutdown.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from proxy_support import CoreDriver, StartProxy, batch_events, stored_batches, wait_for, wait_seq

CHAT = "/v1/chat/completions"


async def _request(http: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": 1, "delay": 0}}
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def test_batches_of_batch_max_events_then_the_rest_at_shutdown(engines, core: CoreDriver,
                                                                    start_proxy: StartProxy,
                                                                    http: aiohttp.ClientSession, nc: Any) -> None:
    engine = await engines("a")
    proxy = await start_proxy(event_batch_max=3, event_flush_ms=600_000, heartbeat_s=600)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    events = proxy.state.events
    for _ in range(4):  # 8 events, one after the other
        await _request(http, proxy.url)
    await wait_for(lambda: events.published == 6, what="two whole batches")
    assert events.batches_published == 2 and events.buffered == 2  # the last two wait for a third
    metrics = await (await http.get(proxy.url + "/metrics")).text()
    assert 'laswrr_proxy_event_batch_size_bucket{le="2.0"} 0.0' in metrics
    assert 'laswrr_proxy_event_batch_size_bucket{le="4.0"} 2.0' in metrics
    assert "laswrr_proxy_event_batch_size_count 2.0" in metrics and "laswrr_proxy_event_batch_size_sum 6.0" in metrics
    assert "laswrr_proxy_event_batches_published_total 2.0" in metrics

    await proxy.stop()  # the stop event joins the last two; everything goes out at once
    batches = await stored_batches(nc.jetstream())
    assert len(batches) == 3
    assert [len(payload["events"]) for _, _, payload in batches] == [3, 3, 3]
    kinds = [kind for kind, _, _ in batch_events(batches)]
    assert kinds == ["req.started", "req.finished"] * 4 + ["proxy.stopped"]
    boot = events.boot_id
    assert [msg_id for _, msg_id, _ in batches] == [f"test-proxy:{boot}:{n}" for n in (1, 2, 3)]
    assert all(payload["boot_id"] == boot for _, _, payload in batches)
