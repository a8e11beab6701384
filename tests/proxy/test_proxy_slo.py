"""Latency objectives at the proxy (docs/proxy.md, "Latency objectives"): a request's targets are
recorded on its ``lb.req.started``; one no node is predicted to meet gets 429 ``slo_unmeetable``
at once, recorded with its targets, the best prediction and what it was made of; a bad target
header is a 400."""

from __future__ import annotations

import time

import aiohttp

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj

CHAT = "/v1/chat/completions"
BODY = {"model": "default", "messages": [{"role": "user", "content": "tell me a story " * 200}]}


async def test_targets_are_recorded_and_an_unmeetable_one_is_refused_at_once(
        engines, core: CoreDriver, start_proxy: StartProxy, tap: EventTap, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(slo_defaults=("batch=10000/",))
    engine = await engines("a")
    await wait_seq(proxy, "default", await core.register("a", engine.url))

    async def post(headers: dict[str, str], stream: bool = True) -> tuple[int, dict | None]:
        async with http.post(proxy.url + CHAT, headers=headers, json={**BODY, "stream": stream}) as response:
            if response.content_type == "text/event-stream":
                await response.read()
                return response.status, None
            return response.status, await response.json()

    # a whole answer's first byte is its last token: it teaches the estimate nothing, so nothing is
    # predicted and an objective no node could meet is still served
    assert (await post({}, stream=False))[0] == 200
    assert (await post({"x-laswrr-ttft-slo-ms": "0.001"}, stream=False))[0] == 200
    assert (await post({}))[0] == 200  # no objective: served as before, and measured (a stream)
    assert (await post({"x-laswrr-priority": "batch"}))[0] == 200  # the band's default target
    assert (await post({"x-laswrr-ttft-slo-ms": "60000", "x-laswrr-tpot-slo-ms": "1000"}))[0] == 200
    began = time.perf_counter()
    status, body = await post({"x-laswrr-ttft-slo-ms": "0.001"})  # no node prefills 800 tokens in 1 us
    assert status == 429 and body is not None and body["error"]["code"] == "slo_unmeetable"
    assert time.perf_counter() - began < 1.0  # at once, not after a deadline
    assert "ttft_slo_ms 0.001" in body["error"]["message"] and "predicted_ttft_ms" in body["error"]["message"]
    status, body = await post({"x-laswrr-tpot-slo-ms": "soon"})
    assert status == 400 and body is not None and body["error"]["code"] == "invalid_header"

    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 5, what="the five finished events")
    assert [data["stream"] for _, data in tap.of(sj.REQ_FINISHED)] == [False, False, True, True, True]
    started = [data for _, data in tap.of(sj.REQ_STARTED)]
    assert len(started) == 5 and started[1]["ttft_slo_ms"] == 0.001
    assert "ttft_slo_ms" not in started[2] and "tpot_slo_ms" not in started[2]
    assert started[3]["ttft_slo_ms"] == 10000 and "tpot_slo_ms" not in started[3]
    assert (started[4]["ttft_slo_ms"], started[4]["tpot_slo_ms"]) == (60000, 1000)
    for k, data in enumerate(started):  # what the estimate's prediction on the node is made of (a refold of the log reads it)
        assert data["batch_size"] == 1 and data["uncached_tokens"] > 0 and data["learned"] == [0, 0, 0, 1, 2][k], data
    await wait_for(lambda: len(tap.of(sj.REQ_REFUSED)) == 2, what="the two refusals")
    unmeetable, bad = (data for _, data in tap.of(sj.REQ_REFUSED))
    assert unmeetable["cause"] == "slo_unmeetable" and unmeetable["status"] == 429
    assert unmeetable["ttft_slo_ms"] == 0.001 and unmeetable["predicted_ttft_ms"] > 0.001
    assert unmeetable["predicted_node"] == "a" and unmeetable["learned"] >= 1 and unmeetable["batch_size"] == 1
    assert bad["cause"] == "invalid_header"

    async with http.get(proxy.url + "/metrics") as response:  # the autoscaling gauges, from the same estimate
        metrics = await response.text()
    assert 'laswrr_pool_saturation{pool="default"} 0.0' in metrics
    assert 'laswrr_pool_predicted_ttft_seconds{pool="default"}' in metrics
    assert 'laswrr_pool_token_backlog_seconds{pool="default"} 0.0' in metrics
