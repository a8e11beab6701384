"""The proxy's exact cache view end to end (``--tokenizer``): the cache changes ``laswrr
kv-events`` publishes on ``lb.kv.<node>`` reach the proxy's ``KvIndex`` over a real nats-server,
a chat request is tokenized with the model's tokenizer and chat template (the tiny model's, as
bench/tiny_model.py builds it), the node its engine says holds the prompt takes it although the
estimated view believes another does, and ``lb.req.started`` records the tokens predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq
from laswrr.schemas import subjects as sj
from laswrr.schemas.kvcache import CACHE_ENCODER, CacheChanged, chain_keys, pack_block_keys
from laswrr.services.proxy.tokens import PromptTokenizer

CHAT = "/v1/chat/completions"
BLOCK = 16


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> None:
    body = {"model": "m", "stream": True, "messages": messages, "test": {"chunks": 1, "delay": 0}}
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200
        await resp.read()


@pytest.mark.parametrize("flow_control", [False, True])
async def test_the_engine_s_view_takes_the_request(engines, core: CoreDriver, start_proxy: StartProxy,
                                                   http: aiohttp.ClientSession, nc: Any, tap: EventTap,
                                                   model_dir: Path, flow_control: bool) -> None:
    a, b = await engines("a"), await engines("b")
    proxy = await start_proxy(tokenizer=str(model_dir), flow_control=flow_control)
    await core.register("a", a.url)
    await wait_seq(proxy, "default", await core.register("b", b.url))
    messages = [{"role": "system", "content": "The load guard bounds what affinity may cost. " * 12},
                {"role": "user", "content": "What does the guard do?"}]
    await _chat(http, proxy.url, messages)  # no node publishes events yet: the estimated view alone
    first = "a" if a.received else "b"
    other = "b" if first == "a" else "a"
    tokens = PromptTokenizer(model_dir).encode(messages, None)
    assert tokens is not None and len(tokens) >= 4 * BLOCK
    held = chain_keys(tokens, BLOCK)[:3]  # the other engine holds three blocks; the first holds none (evicted)
    for node, keys in ((other, held), (first, [])):
        change = CacheChanged(n=1, seq=0, block_size=BLOCK, stored=pack_block_keys(keys), cleared=True, reason="cleared")
        await nc.publish(sj.kv(node), CACHE_ENCODER.encode(change))
    kv = proxy.state.router.table.kv
    await wait_for(lambda: kv.exact("a") and kv.exact("b"), what="both nodes' exact views")
    await _chat(http, proxy.url, messages)
    engine = a if other == "a" else b
    assert len(engine.received) == 1  # the estimated view would have sent it to `first` again
    await wait_for(lambda: len(tap.of(sj.REQ_STARTED)) == 2, what="two started events")
    (_, plain), (subject, picked) = tap.of(sj.REQ_STARTED)
    assert "cached_tokens" not in plain  # no tokens were known: no prediction recorded
    assert subject.endswith("." + other) and picked["cached_tokens"] == 3 * BLOCK
    assert picked["prompt_tokens"] == len(tokens)  # the engine's count, not the estimate
    await nc.publish(sj.kv(other), b"\xc1 not msgpack")
    await wait_for(lambda: proxy.state.bus.kv_rejected == 1, what="a bad change counted")
    assert kv.exact(other)
    async with http.get(proxy.url + "/health") as resp:
        view = (await resp.json())["kv_view"]
    assert view == {"exact": ["a", "b"], "stale": [], "rejected": 1}
    async with http.get(proxy.url + "/metrics") as resp:
        metrics = await resp.text()
    assert f'laswrr_proxy_kv_view_exact{{node="{other}"}} 1.0' in metrics
    assert f'laswrr_proxy_kv_view_blocks{{node="{other}"}} 3.0' in metrics
    gap = CacheChanged(n=5, seq=4, block_size=BLOCK, stored=pack_block_keys([]), cleared=False, reason="")
    await nc.publish(sj.kv(other), CACHE_ENCODER.encode(gap))  # changes 2..4 lost: the view is stale
    await wait_for(lambda: not kv.exact(other), what="the view stale after a gap")
    async with http.get(proxy.url + "/metrics") as resp:
        metrics = await resp.text()
    assert f'laswrr_proxy_kv_view_exact{{node="{other}"}} 0.0' in metrics  # routed on the estimated view, visibly
    async with http.get(proxy.url + "/health") as resp:
        assert (await resp.json())["kv_view"]["stale"] == [other]


async def _metric_value(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    async with http.get(url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


@pytest.mark.parametrize("in_flight", [True, False])
async def test_a_request_in_flight_counts_its_prompt_as_held_on_its_node(
        engines, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession, nc: Any, tap: EventTap,
        model_dir: Path, in_flight: bool) -> None:
    """Both engines' views exact and empty. While the first request of a system prompt is still
    streaming on its node (the engine has not said it stored anything), a second of the same
    prompt is predicted to find the prompt's whole blocks there and goes there; the count ends
    with the first request. ``--no-kv-in-flight``: the second is predicted to find nothing."""
    a, b = await engines("a"), await engines("b")
    proxy = await start_proxy(tokenizer=str(model_dir), kv_in_flight=in_flight)
    await core.register("a", a.url)
    await wait_seq(proxy, "default", await core.register("b", b.url))
    for node in ("a", "b"):
        change = CacheChanged(n=1, seq=0, block_size=BLOCK, stored=pack_block_keys([]), cleared=True, reason="cleared")
        await nc.publish(sj.kv(node), CACHE_ENCODER.encode(change))
    kv = proxy.state.router.table.kv
    await wait_for(lambda: kv.exact("a") and kv.exact("b"), what="both nodes' exact views")
    messages = [{"role": "system", "content": "A held prefix is worth a queue of one. " * 12},
                {"role": "user", "content": "Where does the second go?"}]
    tokens = PromptTokenizer(model_dir).encode(messages, None)
    assert tokens is not None
    whole = len(chain_keys(tokens[:-1], BLOCK)) * BLOCK
    slow = {"model": "m", "stream": True, "messages": messages, "test": {"chunks": 20, "delay": 0.1}}
    async with http.post(proxy.url + CHAT, json=slow) as first:  # streaming for ~2 s
        assert first.status == 200
        await first.content.readline()
        node = "a" if a.received else "b"
        gauge = f'laswrr_proxy_kv_view_in_flight_blocks{{node="{node}"}}'
        assert await _metric_value(http, proxy.url, gauge) == (len(chain_keys(tokens, BLOCK)) if in_flight else 0)
        await _chat(http, proxy.url, messages)
        await wait_for(lambda: len(tap.of(sj.REQ_STARTED)) == 2, what="two started events")
        (_, one), (subject, two) = tap.of(sj.REQ_STARTED)
        assert one["cached_tokens"] == 0
        if in_flight:
            assert subject.endswith("." + node) and two["cached_tokens"] == whole > 0
        else:
            assert two["cached_tokens"] == 0
        await first.read()
    await wait_for(lambda: not kv.nodes[node].pending, what="the count ended with the requests")
    assert await _metric_value(http, proxy.url, gauge) == 0
