"""The sim-engine as a real HTTP server: OpenAI API (official client), /metrics, /health."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from laswrr.services.sim_engine.app import RunningServer

StartEngine = Callable[..., Awaitable[RunningServer]]


MakeClient = Callable[[RunningServer], openai.AsyncOpenAI]


async def test_chat_non_streamed_with_openai_client(make_client: MakeClient, engine: RunningServer) -> None:
    raw = await make_client(engine).chat.completions.with_raw_response.create(
        model="sim-910B", messages=[{"role": "user", "content": "hello " * 40}], max_tokens=7)
    assert raw.headers["x-sim-node"] == "node-a"
    resp = raw.parse()
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content is not None
    assert len(resp.choices[0].message.content.split()) == 7
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    assert resp.usage.prompt_tokens == 61  # 240 chars / 4 + 1 message


async def test_chat_streamed_with_openai_client(make_client: MakeClient, engine: RunningServer) -> None:
    stream = await make_client(engine).chat.completions.create(
        model="sim-910B", messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len("".join(texts).split()) == 12
    assert finish == "length"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (2, 12)


async def test_completions_stream_and_text(make_client: MakeClient, engine: RunningServer, http: aiohttp.ClientSession) -> None:
    resp = await make_client(engine).completions.create(model="sim-910B", prompt="abc", max_tokens=5)
    assert len(resp.choices[0].text.split()) == 5
    async with http.post(f"{engine.url}/v1/completions",
                         json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        body = (await r.read()).decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 5  # 3 tokens + finish chunk + [DONE]
    assert '"finish_reason":"length"' in events[-2]


async def test_output_is_deterministic_given_seed_and_prompt(make_client: MakeClient, start_engine: StartEngine) -> None:
    a, b = await start_engine(seed=7), await start_engine(seed=8)
    texts = []
    for server in (a, a, b):
        resp = await make_client(server).completions.create(model="sim-910B", prompt="same prompt", max_tokens=20)
        texts.append(resp.choices[0].text)
    assert texts[0] == texts[1] != texts[2]


async def test_sim_field_sets_lengths_and_stop(make_client: MakeClient, engine: RunningServer) -> None:
    resp = await make_client(engine).completions.create(
        model="sim-910B", prompt="x", max_tokens=50, extra_body={"sim": {"output_tokens": 3, "prompt_tokens": 900}})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (900, 3)


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "invalid_value"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400,
         "invalid_value"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "invalid_value"),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model_not_found"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 400000}', 400, "context_length_exceeded"),
        ("/admin", b'{"fail": "explode"}', 400, "invalid_value"),
        ("/admin", b'{"speed": 3}', 400, "invalid_value"),
    ],
)
async def test_bad_requests_get_openai_style_errors(engine: RunningServer, http: aiohttp.ClientSession,
                                                    path: str, body: bytes, status: int, code: str) -> None:
    async with http.post(engine.url + path, data=body) as r:
        assert r.status == status
        error = (await r.json())["error"]
    assert error["code"] == code and error["message"] and error["type"]


async def test_models_health_and_node_header(make_client: MakeClient, engine: RunningServer, http: aiohttp.ClientSession) -> None:
    models = await make_client(engine).models.list()
    assert [m.id for m in models.data] == ["sim-910B"]
    async with http.get(f"{engine.url}/health") as r:
        assert r.status == 200 and r.headers["x-sim-node"] == "node-a"


async def test_default_node_id_is_chip_and_bound_port(start_engine: StartEngine,
                                                      http: aiohttp.ClientSession) -> None:
    server = await start_engine(node_id=None, chip="910C")
    async with http.get(f"{server.url}/health") as r:
        assert r.headers["x-sim-node"] == f"910C-{server.url.rsplit(':', 1)[1]}"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_count_the_requests_served(make_client: MakeClient, engine: RunningServer, http: aiohttp.ClientSession) -> None:
    oai = make_client(engine)
    await asyncio.gather(*(oai.completions.create(model="sim-910B", prompt="abcd" * 10, max_tokens=4)
                           for _ in range(6)))
    await oai.completions.create(model="sim-910B", prompt="x", extra_body={"sim": {"output_tokens": 2}})
    async with http.get(f"{engine.url}/metrics") as r:
        text = await r.text()
    s = _samples(text)
    m = (("model_name", "sim-910B"),)
    assert s[("vllm:request_success_total", (("finished_reason", "length"),) + m)] == 6
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),) + m)] == 1
    assert s[("vllm:generation_tokens_total", m)] == 6 * 4 + 2
    assert s[("vllm:prompt_tokens_total", m)] == 6 * 10 + 1
    assert s[("vllm:time_to_first_token_seconds_count", m)] == 7
    assert s[("vllm:e2e_request_latency_seconds_count", m)] == 7
    assert s[("vllm:request_queue_time_seconds_count", m)] == 7
    assert s[("vllm:num_requests_running", m)] == 0
    assert s[("vllm:num_requests_waiting", m)] == 0
    assert s[("vllm:kv_cache_usage_perc", m)] == s[("vllm:gpu_cache_usage_perc", m)] == 0


async def test_metrics_show_load_and_queue(make_client: MakeClient, start_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    server = await start_engine(capacity=2, kv_tokens=5000)
    oai = make_client(server)
    tasks = [asyncio.create_task(oai.completions.create(
        model="sim-910B", prompt="x", max_tokens=200, extra_body={"sim": {"prompt_tokens": 1000}}))
        for _ in range(4)]
    m = (("model_name", "sim-910B"),)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:  # until the next step boundary after all four arrived (a fixed sleep was flaky on a busy box)
        async with http.get(f"{server.url}/metrics") as r:
            s = _samples(await r.text())
        running, waiting = s[("vllm:num_requests_running", m)], s[("vllm:num_requests_waiting", m)]
        if (running, running + waiting) == (2, 4) or loop.time() > deadline:
            break
        await asyncio.sleep(0.02)
    assert s[("vllm:num_requests_running", m)] == 2
    assert s[("vllm:num_requests_waiting", m)] == 2
    assert s[("vllm:kv_cache_usage_perc", m)] > 0.4  # 2 x (1000 + generated) of 5000
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_body_limit_follows_the_proxys(engine: RunningServer, http: aiohttp.ClientSession,
                                                start_engine: StartEngine) -> None:
    """Issue 43 item 11: a 3 MiB body (under the proxy's 4 MiB --max-body-bytes) is served, not
    answered aiohttp's plain-text 413 at 1 MiB; over the engine's own limit the 413 is what an
    engine sends, which the proxy turns into an OpenAI-style error (services/proxy/engine_errors.py)."""
    import json

    from laswrr.services.proxy.config import ProxyConfig
    from laswrr.services.proxy.engine_errors import as_openai_error
    from laswrr.services.sim_engine.config import SimConfig

    assert SimConfig().max_body_bytes == ProxyConfig().max_body_bytes
    body = {"model": "sim-910B", "max_tokens": 2, "messages": [{"role": "user", "content": "a" * (3 << 20)}]}
    async with http.post(f"{engine.url}/v1/chat/completions", json=body) as r:  # read whole: its own answer
        assert r.status != 413 and r.content_type == "application/json", (await r.text())[:300]
    small = await start_engine(max_body_bytes=1 << 20)
    async with http.post(f"{small.url}/v1/chat/completions", json=body) as r:
        status, kind, text = r.status, r.content_type, await r.read()
    assert status == 413 and kind == "text/plain"
    assert json.loads(as_openai_error(status, kind, text, dict(r.headers))[0])["error"]["code"] == "request_too_large"
