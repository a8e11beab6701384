"""Every OpenAI POST route through the proxy, the pool name as a model alias, probes, 404 and 405.

Real parts: simulated engines (``laswrr.services.sim_engine``) and a path-echoing engine on free
ports, the real scheduler core feeding LB_WEIGHTS on a real nats-server, the official ``openai``
client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.services.proxy.app import OPENAI_POST_ROUTES
from laswrr.services.proxy.transport import engine_url
from laswrr.services.sim_engine.app import RunningServer, start_server
from laswrr.services.sim_engine.config import SimConfig


@pytest.fixture
async def sims() -> AsyncIterator[list[RunningServer]]:
    """Two simulated engines of one pool serving one model id, ``sim-llm`` (as `laswrr up` runs them)."""
    servers = [await start_server(SimConfig(chip=chip, capacity=4, port=0, speed=20.0, node_id=name, model="sim-llm"))
               for name, chip in (("s1", "910B"), ("s2", "910C"))]
    yield servers
    for server in servers:
        await server.close()


async def _routed(core: CoreDriver, start_proxy: StartProxy, urls: dict[str, str], **config: Any) -> Any:
    seq = 0
    for name, url in urls.items():
        seq = await core.register(name, url)
    proxy = await start_proxy(policy="rr", **config)
    await wait_seq(proxy, "default", seq)
    return proxy


async def test_openai_client_embeddings_and_responses_go_through_the_proxy(
        sims: list[RunningServer], core: CoreDriver, start_proxy: StartProxy) -> None:
    proxy = await _routed(core, start_proxy, {"s1": sims[0].url, "s2": sims[1].url})
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=10)
    try:
        raw = await client.embeddings.with_raw_response.create(model="sim-llm", input=["hello", "world"])
        assert raw.headers["x-laswrr-node"] in {"s1", "s2"}
        embedded = raw.parse()  # the client asked for base64 (its default) and decoded it
        assert [len(e.embedding) for e in embedded.data] == [32, 32]
        assert abs(sum(v * v for v in embedded.data[0].embedding) - 1.0) < 1e-4
        assert embedded.usage.prompt_tokens == 4

        raw = await client.responses.with_raw_response.create(model="sim-llm", input="say hi", max_output_tokens=5)
        assert raw.headers["x-laswrr-node"] in {"s1", "s2"}
        answer = raw.parse()
        assert answer.status == "incomplete" and len(answer.output_text.split()) == 5
        assert answer.usage is not None and answer.usage.output_tokens == 5

        events = [event.type async for event in await client.responses.create(model="sim-llm", input="hi",
                                                                                max_output_tokens=3, stream=True)]
        assert events == ["response.created"] + ["response.output_text.delta"] * 3 + ["response.completed"]
    finally:
        await client.close()


async def test_the_pool_name_is_an_alias_of_the_model_its_engines_serve(
        sims: list[RunningServer], core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await _routed(core, start_proxy, {"s1": sims[0].url, "s2": sims[1].url})
    body = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "sim": {"x": 1.50}}
    for _ in range(2):  # both engines (rr): each answers the id it serves
        async with http.post(proxy.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["model"] == "sim-llm"
    # not a pool, not served, in a pool whose engines serve one model: forwarded as that model (docs/wire.md)
    async with http.post(proxy.url + "/v1/chat/completions", json=dict(body, model="sim-910C")) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["model"] == "sim-llm"


@pytest.fixture
async def echo_path() -> AsyncIterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """An engine that answers any POST with the path and body it received."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body))
        return web.json_response({"path": request.path, "usage": {"prompt_tokens": 2, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_every_openai_post_route_and_extra_ones_are_routed_with_events(
        echo_path: tuple[str, list[Any]], core: CoreDriver, start_proxy: StartProxy, tap: EventTap,
        http: aiohttp.ClientSession) -> None:
    url, seen = echo_path
    proxy = await _routed(core, start_proxy, {"e1": url}, extra_routes=("/v1/classify", "/pooling"))
    paths = [*OPENAI_POST_ROUTES, "/v1/classify", "/pooling"]
    for path in paths:
        async with http.post(proxy.url + path, json={"model": "m", "input": path}) as response:
            assert response.status == 200, path
            assert response.headers["x-laswrr-node"] == "e1"
            assert (await response.json())["path"] == path
    assert [p for p, _ in seen] == paths
    await wait_for(lambda: len(tap.of(sj.REQ_FINISHED)) == len(paths), what="a finished event per route")
    assert {d["outcome"] for _, d in tap.of(sj.REQ_FINISHED)} == {"completed"}
    async with http.post(proxy.url + "/v1/embeddings", data=b"not json") as response:
        assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_json"


async def test_unknown_paths_are_json_404_and_wrong_methods_405_with_allow(
        start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()
    async with http.get(proxy.url + "/v1/nope") as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "not_found"
    async with http.post(proxy.url + "/v2/chat/completions", json={}) as response:
        assert response.status == 404 and response.content_type == "application/json"
    async with http.get(proxy.url + "/v1/chat/completions") as response:
        assert response.status == 405 and response.headers["Allow"] == "POST"
        assert (await response.json())["error"]["code"] == "method_not_allowed"
    async with http.post(proxy.url + "/readiness") as response:
        assert response.status == 405 and response.headers["Allow"] == "GET, HEAD"


async def test_readiness_waits_for_a_snapshot_with_a_routable_node(
        core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy()

    async def probe(path: str) -> tuple[int, dict[str, Any]]:
        async with http.get(proxy.url + path) as response:
            return response.status, json.loads(await response.read())

    assert await probe("/readiness") == (503, {"status": "not_ready", "reason": "no_snapshot", "proxy": "test-proxy"})
    assert (await probe("/health"))[0] == 200 and (await probe("/healthz"))[0] == 200  # alive all the same
    await wait_seq(proxy, "default", await core.register("n1", "http://127.0.0.1:9"))
    assert await probe("/readiness") == (200, {"status": "ready", "proxy": "test-proxy"})
    await wait_seq(proxy, "default", await core.capacity("n1", 0))
    await wait_for(lambda: not proxy.state.router.table.route("default").first.targets, what="n1 not routable")
    assert (await probe("/readiness"))[1]["reason"] == "no_routable_node"


def test_root_routes_reach_the_server_root_whatever_the_node_url() -> None:
    for base in ("http://e:1", "http://e:1/", "http://e:1/v1", "http://e:1/v1/"):
        assert engine_url(base, "/tokenize") == "http://e:1/tokenize"
        assert engine_url(base, "/v1/embeddings?x=1") == "http://e:1/v1/embeddings?x=1"
    assert engine_url("http://gw/engine-a/v1", "/detokenize") == "http://gw/engine-a/detokenize"
