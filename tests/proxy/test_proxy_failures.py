"""Failure paths: retry before the first byte, cut after it, client cancel, 503/404/400/413, caps."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.services.nats_server import free_port

CHAT = "/v1/chat/completions"
STREAM = {"model": "m", "stream": True, "messages": []}


async def test_retry_before_first_byte_goes_to_an_untried_node(engines, core: CoreDriver, start_proxy: StartProxy,
                                                               http: aiohttp.ClientSession, tap: EventTap) -> None:
    good = await engines("good")
    broken = await engines("broken", fail="http500")
    dropper = await engines("dropper", fail="drop")
    await core.register("refused", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    await core.register("broken", broken.url)
    await core.register("dropper", dropper.url)
    seq = await core.register("good", good.url)
    proxy = await start_proxy(max_retries=3, policy="rr")
    await wait_seq(proxy, "default", seq)

    for i in range(8):
        body = dict(STREAM, stream=i % 2 == 0, test={"chunks": 2})
        async with http.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-laswrr-node"] == "good"
            await resp.read()
    assert len(good.received) == 8
    assert broken.received, "round robin must have tried the broken node at least once"

    await wait_for(lambda: sum(d["outcome"] == "completed" for _, d in tap.of(sj.REQ_FINISHED)) == 8,
                   what="eight completed requests")
    finished = [d for _, d in tap.of(sj.REQ_FINISHED)]
    failed = [d for d in finished if d["outcome"] == "upstream_error"]
    assert failed and all(d["error"].startswith("retried: ") and d["ttft_ms"] is None for d in failed)
    assert any(d["status"] == 500 for d in failed)
    subjects = {s for s, d in tap.of(sj.REQ_FINISHED) if d["outcome"] == "upstream_error"}
    assert subjects == {sj.req_finished(n) for n in ("refused", "broken", "dropper")}
    # each retry is its own attempt: <id>.k on another node
    retried_ids = [d["request_id"] for d in finished if d["outcome"] == "completed" and "." in d["request_id"]]
    assert retried_ids and all(rid.rsplit(".", 1)[1].isdigit() for rid in retried_ids)
    metrics = await (await http.get(proxy.url + "/metrics")).text()
    assert "laswrr_proxy_retries_total" in metrics


async def test_no_retry_left_passes_the_engine_5xx_through(engines, core: CoreDriver, start_proxy: StartProxy,
                                                           http: aiohttp.ClientSession, tap: EventTap) -> None:
    broken = await engines("broken", fail="http500")
    proxy = await start_proxy(max_retries=2)
    await wait_seq(proxy, "default", await core.register("broken", broken.url))
    async with http.post(proxy.url + CHAT, json=STREAM) as resp:
        assert resp.status == 500
        assert resp.headers["x-laswrr-node"] == "broken"
        assert (await resp.json())["error"]["message"] == "broken broken"
    assert len(broken.received) == 1  # the only node was tried once: retries never repeat a node
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 1)
    [(_, finished)] = tap.of(sj.REQ_FINISHED)
    assert finished["outcome"] == "upstream_error" and finished["status"] == 500
    assert not finished["error"].startswith("retried")


async def test_an_engines_plain_text_error_reaches_the_client_as_an_openai_error(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """A non-JSON error answer (aiohttp's own 413, a gateway's 502 page) keeps its status and the
    engine's text, in the OpenAI error shape every other error has (a JSON one passes unchanged)."""
    plain = await engines("plain")
    proxy = await start_proxy(max_retries=0)
    await wait_seq(proxy, "default", await core.register("plain", plain.url))
    for status, text, code in ((413, "Maximum request body size 1048576 exceeded", "request_too_large"),
                               (502, "<html>bad gateway</html>", None)):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "test": {"status": status, "text": text}}
        async with http.post(proxy.url + CHAT, json=body) as resp:
            assert resp.status == status and resp.content_type == "application/json"
            error = (await resp.json())["error"]
        assert error["code"] == code and text in error["message"], error


async def test_unreachable_only_node_is_502(core: CoreDriver, start_proxy: StartProxy,
                                            http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("refused", f"http://127.0.0.1:{free_port()}"))
    async with http.post(proxy.url + CHAT, json=STREAM) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_unreachable"


async def test_an_engine_that_never_answers_is_504(core: CoreDriver, start_proxy: StartProxy,
                                                  http: aiohttp.ClientSession, tap: EventTap) -> None:
    """A timeout is told by its failure kind, not by its text: 504 ``upstream_timeout``."""
    held: list[asyncio.StreamWriter] = []  # the connections, kept open and never answered

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        proxy = await start_proxy(upstream_timeout_s=0.3)
        await wait_seq(proxy, "default", await core.register("silent", f"http://127.0.0.1:{port}"))
        async with http.post(proxy.url + CHAT, json=STREAM) as resp:
            assert resp.status == 504
            body = await resp.json()
        assert body["error"]["code"] == "upstream_timeout" and "silent timed out" in body["error"]["message"]
        assert held, "the proxy must have reached the engine"
        await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 1)
        [(_, finished)] = tap.of(sj.REQ_FINISHED)
        assert finished["outcome"] == "upstream_error" and finished["status"] is None
    finally:
        server.close()
        for writer in held:
            writer.close()


async def test_cut_after_first_byte_ends_with_an_sse_error(engines, core: CoreDriver, start_proxy: StartProxy,
                                                           http: aiohttp.ClientSession, tap: EventTap) -> None:
    engine = await engines("a")
    await engines("b")
    proxy = await start_proxy(max_retries=2)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    async with http.post(proxy.url + CHAT, json=dict(STREAM, test={"chunks": 5, "cut_after": 2})) as resp:
        assert resp.status == 200
        data = await resp.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 3 and b"[DONE]" not in data
    assert events[:2] == [engine.chunk(0, {}).strip(), engine.chunk(1, {}).strip()]
    error = json.loads(events[2].removeprefix(b"data: "))["error"]
    assert error["type"] == "upstream_error" and "a" in error["message"]
    assert len(engine.received) == 1  # never retried after the first byte
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 1)
    [(subject, finished)] = tap.of(sj.REQ_FINISHED)
    assert subject == sj.req_finished("a")
    assert finished["outcome"] == "upstream_error" and finished["ttft_ms"] is not None


async def test_client_disconnect_cancels_upstream(engines, core: CoreDriver, start_proxy: StartProxy,
                                                  tap: EventTap) -> None:
    engine = await engines("a")
    proxy = await start_proxy()
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    body = json.dumps(dict(STREAM, test={"chunks": 50, "delay": 0.05, "tag": "bye"})).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    await reader.readuntil(b"\n\n")  # first SSE chunk arrived
    writer.close()  # the client goes away mid-stream
    await wait_for(lambda: engine.cancelled == ["bye"], what="the engine to see the cancel")
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == 1)
    [(_, finished)] = tap.of(sj.REQ_FINISHED)
    assert finished["outcome"] == "client_cancelled" and finished["ttft_ms"] is not None
    assert proxy.state.router.table.load.total == 0


async def test_no_routable_node_is_503_with_retry_after(engines, core: CoreDriver, start_proxy: StartProxy,
                                                        http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    async with http.post(proxy.url + CHAT, json=STREAM) as resp:  # no snapshot at all yet
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "no_snapshot"
    engine = await engines("a")
    await core.register("a", engine.url)
    await wait_seq(proxy, "default", await core.capacity("a", 0))
    async with http.post(proxy.url + CHAT, json=STREAM) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert set(error) >= {"message", "type", "code"} and error["code"] == "no_routable_node"
    assert engine.received == []


async def test_bad_json_is_400_and_big_body_413(engines, core: CoreDriver, start_proxy: StartProxy,
                                                http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy(max_body_bytes=1024)
    await wait_seq(proxy, "default", await core.register("a", engine.url))
    for payload in (b"{not json", b"[1, 2]", b'{"model": 5}', b""):
        async with http.post(proxy.url + CHAT, data=payload, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400, payload
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    async with http.post(proxy.url + CHAT, data=big) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"

    async def chunked() -> object:  # no Content-Length: the limit is enforced while reading
        yield big

    async with http.post(proxy.url + CHAT, data=chunked()) as resp:
        assert resp.status == 413
    assert engine.received == []


async def test_inflight_cap_excludes_a_node_at_cap(engines, core: CoreDriver, start_proxy: StartProxy,
                                                   http: aiohttp.ClientSession) -> None:
    engine = await engines("a")
    proxy = await start_proxy(inflight_cap_per_capacity=0.5)  # capacity 4 -> at most 2 in flight
    await wait_seq(proxy, "default", await core.register("a", engine.url, capacity=4))
    slow = dict(STREAM, test={"chunks": 3, "delay": 0.3})
    held = [await http.post(proxy.url + CHAT, json=slow) for _ in range(2)]
    async with http.post(proxy.url + CHAT, json=slow) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "no_routable_node" and "at its in-flight cap" in error["message"]
    for resp in held:
        assert resp.status == 200 and (await resp.read()).endswith(b"[DONE]\n\n")
    async with http.post(proxy.url + CHAT, json=slow) as resp:
        assert resp.status == 200
