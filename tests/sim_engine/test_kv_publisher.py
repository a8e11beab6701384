"""The simulated engine's KV events on vLLM's wire (``--kv-events``, services/sim_engine/kv_publisher.py):
what its prefix cache logs becomes vLLM's events, which ``laswrr kv-events``'s decoder folds into
the keys a router computes from the prompt's tokens; the replay endpoint answers as vLLM's does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from laswrr.collectors.kv_events import NamedRemoved, NamedStored, NodeCache, decode_frames, decode_replay
from laswrr.schemas.kvcache import chain_keys
from laswrr.services.nats_server import free_port
from laswrr.services.proxy.tokens import PromptTokenizer
from laswrr.services.sim_engine.kv_publisher import batch_events
from laswrr.services.sim_engine.prefix_cache import BlockChange, token_ids


def test_a_chained_run_is_one_block_stored_and_evictions_one_block_removed() -> None:
    events = batch_events([BlockChange(1, True, None, (1, 1)), BlockChange(2, True, 1, (2, 2)),
                           BlockChange(3, True, 1, (3, 3)),  # another child of 1: a run of its own
                           BlockChange(2, False), BlockChange(1, False), BlockChange(4, True, None, (4, 4))], 2)
    assert events == [
        NamedStored(block_hashes=[1, 2], token_ids=[1, 1, 2, 2], block_size=2, parent_block_hash=None, medium="GPU"),
        NamedStored(block_hashes=[3], token_ids=[3, 3], block_size=2, parent_block_hash=1, medium="GPU"),
        NamedRemoved(block_hashes=[2, 1], medium="GPU"),
        NamedStored(block_hashes=[4], token_ids=[4, 4], block_size=2, parent_block_hash=None, medium="GPU")]
    assert batch_events([], 2) == []


async def test_the_engine_publishes_its_prompt_s_blocks_and_replays_them(start_engine, http: aiohttp.ClientSession,
                                                                        eventually) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    engine = await start_engine(kv_events=pub, kv_events_replay=replay)
    ctx = zmq.asyncio.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)

        await eventually(lambda: _subscribers(http, engine.url), what="the engine to hear the subscription")
        prompt = "The load guard bounds what affinity may cost, block by block. " * 4
        body = {"model": "sim-910B", "prompt": prompt, "max_tokens": 2}
        async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        frames = await asyncio.wait_for(sub.recv_multipart(), 10)
        batch = decode_frames(frames)
        assert batch is not None and batch.seq == 0 and batch.encoding == "named"
        change = NodeCache().fold(batch)
        ids = token_ids(prompt)
        assert change is not None and change.block_size == 16
        assert change.stored_keys == chain_keys(ids, 16) and len(change.stored_keys) == len(ids) // 16
        dealer.connect(replay)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answer = await asyncio.wait_for(dealer.recv_multipart(), 10)
        assert answer == [b"", *frames] and decode_replay(answer) == batch  # vLLM's shape: the topic kept
        assert decode_replay(await asyncio.wait_for(dealer.recv_multipart(), 10)) is None  # the end marker
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


async def test_with_the_model_s_tokenizer_the_engine_counts_and_caches_its_tokens(
        start_engine, http: aiohttp.ClientSession, model_dir: Path, eventually) -> None:
    """``--tokenizer``: a chat prompt is the model's chat template's tokens, as the proxy's exact view
    computes them; the usage and the blocks published are of those tokens."""
    pub = f"tcp://127.0.0.1:{free_port()}"
    engine = await start_engine(kv_events=pub, tokenizer=str(model_dir))
    messages = [{"role": "system", "content": "The load guard bounds what affinity may cost. " * 6},
                {"role": "user", "content": "What does the guard do?"}]
    tokens = PromptTokenizer(model_dir).encode(messages, None)
    assert tokens is not None and len(tokens) >= 3 * 16
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        await eventually(lambda: _subscribers(http, engine.url), what="the engine to hear the subscription")
        async with http.post(f"{engine.url}/v1/chat/completions",
                             json={"model": "sim-910B", "messages": messages, "max_tokens": 2}) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["prompt_tokens"] == len(tokens)
        change = NodeCache().fold(decode_frames(await asyncio.wait_for(sub.recv_multipart(), 10)))  # type: ignore[arg-type]
        assert change is not None and change.stored_keys == chain_keys(tokens, 16)
    finally:
        sub.close(0)
        ctx.term()


async def _subscribers(http: aiohttp.ClientSession, url: str) -> int:
    """How many subscribers the engine's publisher has heard (the next batch reaches them)."""
    async with http.get(f"{url}/sim/state") as resp:
        return int((await resp.json())["kv_events_subscribers"])
