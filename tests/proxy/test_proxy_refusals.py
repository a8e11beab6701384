"""The proxy's own answers are recorded, and an engine's 4xx is not 'completed' (docs/wire.md).

Every refusal (503 before a snapshot, 401, 400, 413, 429, 503 with no routable node) is an
``lb.req.refused.<proxy>`` event in LB_EVENTS with its cause word, status and the request id
the client got in ``x-laswrr-request-id``; ``/metrics`` counts answers by who gave them and
status class. An engine's 422 reaches the client whole and its attempt is ``engine_error``
with ``status`` 422 (a 2xx stays ``completed``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj

CHAT = "/v1/chat/completions"
KEY = {"Authorization": "Bearer sk-team-a"}
BODY = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


async def test_refusals_are_recorded_with_their_cause_and_engine_4xx_is_engine_error(
        engines, core: CoreDriver, start_proxy: StartProxy, tap: EventTap, http: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-team-a\n")
    proxy = await start_proxy(api_keys_file=str(keys), key_max_inflight=1, max_body_bytes=2048)
    answers: list[tuple[int, str | None]] = []

    async def post(headers: dict[str, str] | None = None, **kw: object) -> int:
        async with http.post(proxy.url + CHAT, headers=headers, **kw) as response:  # type: ignore[arg-type]
            await response.read()
            answers.append((response.status, response.headers.get("x-laswrr-request-id")))
            return response.status

    assert await post(KEY, json=BODY) == 503  # no snapshot yet
    engine = await engines("a")
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    assert await post(None, json=BODY) == 401
    assert await post(KEY, data=b"{not json") == 400
    assert await post(KEY, data=b"x" * 4096) == 413
    held = asyncio.create_task(post(KEY, json={**BODY, "stream": True, "test": {"chunks": 20, "delay": 0.05}}))
    await wait_for(lambda: proxy.state.router.table.load.total == 1, what="the key's first request in flight")
    assert await post(KEY, json=BODY) == 429
    assert await held == 200
    assert await post(KEY, json={**BODY, "test": {"status": 422}}) == 422  # the engine's own answer
    assert await post(KEY, json=BODY) == 200
    await wait_seq(proxy, "default", await core.capacity("a", 0))
    assert await post(KEY, json=BODY) == 503

    refused = {0: ("no_snapshot", 503), 1: ("invalid_api_key", 401), 2: ("invalid_json", 400),
               3: ("request_too_large", 413), 4: ("key_max_inflight", 429), 8: ("no_routable_node", 503)}
    await wait_for(lambda: len(tap.of(sj.REQ_REFUSED)) == len(refused), what="the refusals in LB_EVENTS")
    events = [data for _, data in tap.of(sj.REQ_REFUSED)]
    assert [(e["cause"], e["status"]) for e in events] == list(refused.values())
    # in order: the 429 came while the held stream ran, before its 200 was appended
    ids = [rid for status, rid in answers if status not in (200, 422)]
    assert [e["request_id"] for e in events] == ids and all(ids)
    assert all(subject == sj.req_refused("test-proxy") for subject, _ in tap.of(sj.REQ_REFUSED))
    assert events[4]["key_name"] == "team-a" and events[1].get("key_name") is None
    assert events[5]["pool"] == "default" and events[5]["model"] == "default"

    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 3, what="the three attempts' finished events")
    outcomes = sorted((d["outcome"], d["status"]) for _, d in tap.of(sj.REQ_FINISHED))
    assert outcomes == [("completed", 200), ("completed", 200), ("engine_error", 422)]

    async with http.get(proxy.url + "/metrics") as response:
        metrics = await response.text()
    assert 'laswrr_proxy_answers_total{by="router",class="4xx"} 4.0' in metrics
    assert 'laswrr_proxy_answers_total{by="router",class="5xx"} 2.0' in metrics
    assert 'laswrr_proxy_answers_total{by="engine",class="4xx"} 1.0' in metrics
    assert 'laswrr_proxy_answers_total{by="engine",class="2xx"} 2.0' in metrics
    assert 'laswrr_proxy_requests_total{node="a",outcome="engine_error",pool="default"} 1.0' in metrics


async def test_a_cancelled_attempt_keeps_the_status_the_engine_answered(
        engines, core: CoreDriver, start_proxy: StartProxy, tap: EventTap, http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    body = {**BODY, "stream": True, "test": {"chunks": 100, "delay": 0.05, "tag": "gone"}}
    async with http.post(proxy.url + CHAT, json=body) as response:
        assert response.status == 200
        await response.content.readany()  # the first event, then the client goes away
        request_id = response.headers["x-laswrr-request-id"]
    await wait_for(lambda: tap.finished(request_id) is not None, what="the cancelled attempt's finished event")
    finished = tap.finished(request_id)
    assert finished is not None and (finished["outcome"], finished["status"]) == ("client_cancelled", 200)
