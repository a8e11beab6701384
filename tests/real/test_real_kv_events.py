"""`laswrr kv-events` against a real vLLM (the CPU build, the tiny model): after a chat request,
the node's cache changes hold the keys of the request's whole blocks, computed from the engine's
own tokens of the request (its /tokenize, the chat template applied); the engine's reported
``cached_tokens`` of the same request sent again equals those blocks, and so does what the proxy's
exact view predicts from its own tokens of the request (``services.proxy.tokens``: the model's chat
template and tokenizer, equal to the engine's /tokenize); after the engine restarts,
the node's index is dropped (reason ``restart``) and rebuilt from the new engine's events.

One engine of its own (``--kv-events-config`` with a PUB and a replay endpoint), beside the
tier's shared two: three at most."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from laswrr.bench import real_vllm
from laswrr.schemas import subjects as sj
from laswrr.scheduler.routing.kvindex import KvIndex
from laswrr.schemas.kvcache import CACHE_DECODER, CacheChanged, chain_keys
from laswrr.services import kv_events
from laswrr.services.natsbus import ensure_streams
from laswrr.services.proxy.tokens import PromptTokenizer
from tests.real.conftest import BLOCK_TOKENS, NUM_BLOCKS, REAL_TIMEOUT_S, _unavailable

pytestmark = pytest.mark.timeout(REAL_TIMEOUT_S)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kv_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[real_vllm.VllmServer, str, str]]:
    try:
        engine = real_vllm.server(4, "vllm-kv", tmp_path_factory.mktemp("vllm-kv-logs"), num_blocks=NUM_BLOCKS,
                                  extra_args=["--enable-prompt-tokens-details"], kv_events=True)
    except real_vllm.VllmUnavailable as exc:
        _unavailable(str(exc))
        raise
    assert engine.kv_events is not None
    engine.start()
    try:
        yield engine, *engine.kv_events
    finally:
        engine.stop()


def held_after(changes: list[CacheChanged]) -> set[int]:
    held: set[int] = set()
    for change in changes:
        if change.cleared:
            held.clear()
        held |= set(change.stored_keys)
        held -= set(change.removed_keys)
    return held


async def until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout_s:.0f} s"
        await asyncio.sleep(0.1)


async def arrived(changes: list[CacheChanged], timeout_s: float) -> bool:
    """Whether ``changes`` holds one within ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not changes and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return bool(changes)


async def test_the_index_holds_the_requests_blocks_and_is_dropped_on_a_restart(
        kv_engine: tuple[real_vllm.VllmServer, str, str], nats_url: str) -> None:
    engine, pub, replay = kv_engine
    nc = await nats.connect(nats_url)
    await ensure_streams(nc.jetstream())
    changes: list[CacheChanged] = []

    async def on_kv(msg: Any) -> None:
        changes.append(CACHE_DECODER.decode(msg.data))

    await nc.subscribe(sj.kv("vllm-kv"), cb=on_kv)
    stop = asyncio.Event()
    service = asyncio.create_task(kv_events.serve(nats_url, stop=stop))
    await nc.jetstream().publish(sj.admin_node("vllm-kv"), json.dumps(
        {"url": engine.url, "capacity": 4, "kv_events": pub, "kv_events_replay": replay}).encode())
    system = (ROOT / "docs" / "algorithm.md").read_text()[:2500]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does the guard do?"}]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            async def chat(messages: list[dict[str, str]] = messages) -> dict[str, Any]:
                async with http.post(f"{engine.url}/v1/chat/completions", json={
                        "model": real_vllm.MODEL_NAME, "messages": messages, "max_tokens": 4,
                        "temperature": 0}) as resp:
                    assert resp.status == 200, await resp.text()
                    return dict(await resp.json())

            async with http.post(f"{engine.url}/tokenize", json={
                    "model": real_vllm.MODEL_NAME, "messages": messages, "add_generation_prompt": True}) as resp:
                assert resp.status == 200, await resp.text()
                tokens = (await resp.json())["tokens"]
            keys = chain_keys(tokens, BLOCK_TOKENS)
            assert len(keys) >= 4
            own = PromptTokenizer(real_vllm.model_dir()).encode(messages, None)
            assert own == tokens  # the proxy renders the chat template and tokenizes as the engine does
            # the service subscribed: a warm-up prompt's blocks come through (each try a new prompt, so
            # that it stores blocks again; a batch missed while subscribing is replayed with the next)
            for attempt in range(10):
                await chat([{"role": "user", "content": f"warm-up {attempt}: {system[1000:]}"}])
                if await arrived(changes, 5.0):
                    break
            assert changes, "no cache change from the engine after 10 warm-up prompts"
            await chat()
            await until(lambda: set(keys) <= held_after(changes), 30, "the request's blocks in the node's index")
            again = await chat()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(keys) * BLOCK_TOKENS
            view = KvIndex()  # the proxy's fold of the same changes predicts what the engine reported
            assert all(view.apply("vllm-kv", c) for c in changes)
            assert view.cached(own, ["vllm-kv", "no-events"]) == {"vllm-kv": len(keys) * BLOCK_TOKENS}
            before = len(changes)
            await asyncio.to_thread(engine.restart)
            await chat()
            await until(lambda: any(c.cleared and c.reason == "restart" for c in changes[before:]), 60,
                        "the index dropped after the restart")
            await until(lambda: set(keys) <= held_after(changes), 30, "the index rebuilt from the new engine")
            restart = next(c for c in changes[before:] if c.cleared)
            assert restart.seq <= max(c.seq for c in changes[:before])  # the new engine counts from 0 again
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await nc.close()
