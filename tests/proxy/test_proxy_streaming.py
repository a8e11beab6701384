"""Pass-through: bytes, headers, the official openai client, and the events each request leaves."""

from __future__ import annotations

import json

import aiohttp
import openai

from laswrr.schemas import subjects as sj
from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq

CHAT = "/v1/chat/completions"


async def test_sse_stream_is_byte_equal_and_headers_pass(engines, core: CoreDriver, start_proxy: StartProxy,
                                                         http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    seq = await core.register("a", engine.url)
    proxy = await start_proxy()
    await wait_seq(proxy, "default", seq)
    body = {"model": "echo-model", "stream": True, "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": True}, "test": {"chunks": 12, "delay": 0.002}}

    async with http.post(engine.url + CHAT, json=body) as direct:
        direct_bytes = await direct.read()
    async with http.post(proxy.url + CHAT, json=body) as via:
        assert via.status == 200
        via_bytes = await via.read()
        headers = via.headers

    assert via_bytes == direct_bytes
    assert via_bytes.endswith(b"data: [DONE]\n\n") and via_bytes.count(b"data: ") == 14
    assert headers["x-laswrr-node"] == "a"
    assert headers["x-engine"] == "a"  # the engine's own headers pass through
    assert headers["Content-Type"].startswith("text/event-stream")
    assert "Content-Length" not in headers
    assert len(engine.received) == 2


async def test_chunks_reach_the_client_before_the_stream_ends(engines, core: CoreDriver, start_proxy: StartProxy,
                                                              http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": 4, "delay": 0.4}}
    async with http.post(proxy.url + CHAT, json=body) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")  # got the first chunk while the engine still sleeps
        assert len(engine.cancelled) == 0 and not resp.content.at_eof()
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_openai_client_streams_and_not(engines, core: CoreDriver, start_proxy: StartProxy,
                                             tap: EventTap) -> None:
    engine = await engines("a")
    seq = await core.register("a", engine.url)
    proxy = await start_proxy()
    await wait_seq(proxy, "default", seq)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, timeout=10)
    try:
        reply = await client.chat.completions.create(
            model="echo-model", messages=[{"role": "user", "content": "hi"}], extra_body={"test": {"chunks": 5}})
        assert reply.choices[0].message.content == "t0 t1 t2 t3 t4 "
        assert reply.usage is not None and reply.usage.completion_tokens == 5

        stream = await client.chat.completions.create(
            model="echo-model", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True}, extra_body={"test": {"chunks": 6}})
        parts, usage = [], None
        async for chunk in stream:
            parts.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == "t0 t1 t2 t3 t4 t5 "
        assert usage is not None and usage.completion_tokens == 6

        models = await client.models.list()
        assert [m.id for m in models.data] == ["echo-model"]
    finally:
        await client.close()

    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 2, what="two finished events")
    started = [d for _, d in tap.of(sj.REQ_STARTED)]
    finished = [d for _, d in tap.of(sj.REQ_FINISHED)]
    assert all(s["snapshot_seq"] == seq and s["proxy"] == "test-proxy" and s["pool"] == "default" for s in started)
    assert [s for s, _ in tap.of(sj.REQ_STARTED)] == [sj.req_started("a")] * 2
    assert [f["outcome"] for f in finished] == ["completed", "completed"]
    assert [(f["prompt_tokens"], f["completion_tokens"]) for f in finished] == [(7, 5), (7, 6)]
    assert all(f["status"] == 200 and f["ttft_ms"] is not None and f["duration_ms"] >= f["ttft_ms"] for f in finished)
    assert {f["request_id"] for f in finished} == {s["request_id"] for s in started}


async def test_completions_route_and_model_to_pool(engines, core: CoreDriver, start_proxy: StartProxy,
                                                   http: aiohttp.ClientSession) -> None:
    small, big = await engines("s", model="org/small-model"), await engines("b", model="org/big-model")
    await core.register("s", small.url, pool="small")
    seq = await core.register("b", big.url, pool="big")
    proxy = await start_proxy()
    await wait_seq(proxy, "big", seq)
    for model, node in (("small", "s"), ("big", "b"), ("org/big-model", "b"), ("org/small-model", "s")):
        async with http.post(proxy.url + "/v1/completions", json={"model": model, "prompt": "x"}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-laswrr-node"] == node
    async with http.post(proxy.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    async with http.get(proxy.url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["org/big-model", "org/small-model"]


async def test_unknown_model_goes_to_default_pool(engines, core: CoreDriver, start_proxy: StartProxy,
                                                  http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    seq = await core.register("a", engine.url)
    proxy = await start_proxy()
    await wait_seq(proxy, "default", seq)
    for body in ({"model": "whatever", "messages": []}, {"messages": []}):
        async with http.post(proxy.url + CHAT, data=json.dumps(body)) as resp:
            assert resp.status == 200
            assert resp.headers["x-laswrr-node"] == "a"


async def test_a_plan_kept_for_a_name_is_made_again_when_a_snapshot_changes(engines, core: CoreDriver,
                                                                            start_proxy: StartProxy,
                                                                            http: aiohttp.ClientSession) -> None:
    """The proxy keeps each model name's plan until the next snapshot (app._plan): a request
    with no model, refused while no pool ``default`` exists, is routed once one does."""
    small = await engines("s")
    seq = await core.register("s", small.url, pool="small")
    proxy = await start_proxy()
    await wait_seq(proxy, "small", seq)
    for _ in range(2):  # the second is answered from the kept plan
        async with http.post(proxy.url + CHAT, data=json.dumps({"messages": []})) as resp:
            assert resp.status == 404, await resp.text()
    engine = await engines("a")
    seq = await core.register("a", engine.url)
    await wait_seq(proxy, "default", seq)
    async with http.post(proxy.url + CHAT, data=json.dumps({"messages": []})) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-laswrr-node"] == "a"


async def test_redirects_pass_through_and_engine_cookies_are_not_kept(engines, core: CoreDriver,
                                                                       start_proxy: StartProxy,
                                                                       http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    # by host name: a cookie jar would refuse cookies from an IP address and hide the leak
    await wait_seq(proxy, "default", await core.register("a", engine.url.replace("127.0.0.1", "localhost")))
    moved = {"model": "m", "messages": [], "test": {"status": 307, "headers": {"Location": engine.url + CHAT}}}
    async with http.post(proxy.url + CHAT, json=moved, allow_redirects=False) as resp:
        assert resp.status == 307  # the client decides whether to follow, not the proxy
        assert resp.headers["Location"] == engine.url + CHAT
    assert len(engine.received) == 1

    cookie = {"model": "m", "messages": [], "test": {"status": 200, "headers": {"Set-Cookie": "sid=client-1; Path=/"}}}
    async with http.post(proxy.url + CHAT, json=cookie) as resp:
        assert resp.status == 200 and resp.headers["Set-Cookie"].startswith("sid=client-1")
    async with aiohttp.ClientSession() as other_client:  # another client, no cookie of its own
        async with other_client.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as resp:
            assert resp.status == 200
    assert [h.get("Cookie") for h in engine.headers] == [None] * 3  # the proxy never replays an engine's cookie


async def test_the_engine_is_asked_for_the_encoding_the_client_asked_for(engines, core: CoreDriver,
                                                                          start_proxy: StartProxy) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    body = json.dumps({"model": "m", "messages": []}).encode()
    async with aiohttp.ClientSession(skip_auto_headers=("Accept-Encoding",)) as bare:
        async with bare.post(proxy.url + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
        async with bare.post(proxy.url + CHAT, data=body, headers={"Accept-Encoding": "gzip"}) as resp:
            assert resp.status == 200
    assert [h.get("Accept-Encoding") for h in engine.headers] == ["identity", "gzip"]
    assert all(h["x-laswrr-request-id"] for h in engine.headers)
