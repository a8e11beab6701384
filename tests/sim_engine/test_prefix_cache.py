"""Prefix caching of the simulated engine: hit accounting and eviction against hand-computed cases.

Blocks are 16 tokens = 64 characters of prompt text (the simulator's tokenizer is 4 characters
a token), so a text of 64·k characters has k full blocks.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from laswrr.scheduler.routing.kvindex import KvIndex
from laswrr.schemas.kvcache import CacheChanged, chain_keys, pack_block_keys
from laswrr.services.sim_engine.openai_api import estimate_tokens
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.prefix_cache import PrefixCache, block_keys, token_ids
from laswrr.services.sim_engine.profiles import get_profile
from tests.sim_engine.test_sim_http import MakeClient, StartEngine, _samples
from tests.sim_engine.test_sim_physics import run_until_idle

BLOCK = "".join(chr(ord("a") + i % 26) for i in range(64))  # one 16-token block of text


def text(*blocks: str) -> str:
    """Blocks named by one letter each: 'A' is 64 characters of A."""
    return "".join(b * 64 for b in blocks)


def test_block_keys_are_a_prefix_chain() -> None:
    abc, abd = block_keys(text("A", "B", "C"), 16, 99), block_keys(text("A", "B", "D"), 16, 99)
    assert len(abc) == 3 and abc[:2] == abd[:2] and abc[2] != abd[2]
    assert block_keys(text("B", "B"), 16, 99)[1] != abc[1]  # same block text, different prefix
    assert block_keys(text("A") + "tail", 16, 99) == abc[:1]  # a partial block is not cached
    assert block_keys(text("A", "B", "C"), 16, 2) == abc[:2]


def test_the_token_ids_are_the_texts_4_byte_chunks_and_give_the_routers_keys() -> None:
    """A router computing ``chain_keys`` over the simulator's token ids of a prompt gets the keys
    the simulated cache stores: its KV events need no translation."""
    prompt = text("A", "B", "C") + "tail!"  # 197 characters: 49 whole chunks and a partial one
    ids = token_ids(prompt)
    assert len(ids) == estimate_tokens(prompt) == 50
    assert ids[0] == int.from_bytes(b"AAAA", "little") and ids[-1] == ord("!")  # the last chunk padded
    assert chain_keys(ids, 16) == list(block_keys(prompt, 16, 99)) and len(block_keys(prompt, 16, 99)) == 3
    assert token_ids(prompt[:64]) == ids[:16] and token_ids("") == ()
    assert len(token_ids("é" * 4)) == 2  # UTF-8 bytes: 8 of them


def test_a_router_fed_the_engines_changes_predicts_its_cached_tokens() -> None:
    sim = EngineSim(get_profile("910B"), 10, kv_events=True)
    sim.submit(49, 4, 0.0, text("A", "B", "C"))  # 48 tokens of text, one for the message
    run_until_idle(sim)
    stored, removed = sim.prefix_cache.take_changes()
    view = KvIndex()
    view.apply("n", CacheChanged(n=1, seq=sim.steps, block_size=16, stored=pack_block_keys(stored),
                                 removed=pack_block_keys(removed)))
    for blocks, tokens in (("ABD", 49), ("ABC", 49), ("ABCD", 65), ("XBC", 49)):
        prompt = text(*blocks)
        predicted = view.cached((*token_ids(prompt), 0), ["n"])["n"]
        req = sim.submit(tokens, 1, 100.0, prompt)
        run_until_idle(sim)
        assert predicted == req.cached_tokens, blocks
        sim.prefix_cache.take_changes()


def test_the_change_log_tells_the_blocks_stored_and_evicted() -> None:
    plain = PrefixCache(16)
    plain.acquire(block_keys(text("A"), 16, 1))
    assert plain.changes is None and plain.take_changes() == ([], [])
    cache = PrefixCache(16, log_changes=True)
    abc = block_keys(text("A", "B", "C"), 16, 3)
    cache.acquire(abc[:2])
    cache.acquire(abc)  # A and B again: held twice, stored once
    assert cache.take_changes() == (list(abc), []) and cache.take_changes() == ([], [])
    cache.release(abc)
    cache.release(abc[:2])
    assert cache.take_changes() == ([], [])  # released blocks stay cached
    cache.evict_to(16)  # C, then B, evicted (tail first)
    xy = block_keys(text("X", "Y"), 16, 2)
    cache.acquire(xy)
    cache.release(xy)
    cache.evict_to(16)  # A and Y go too: X was released after A, Y before X
    assert cache.take_changes() == ([xy[0]], [abc[2], abc[1], xy[1], abc[0]])  # Y stored and evicted: removed only
    cache.acquire(abc[:1])  # A back: stored again
    assert cache.take_changes() == ([abc[0]], [])


def test_second_request_hits_the_first_ones_blocks() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    first = sim.submit(48, 4, 0.0, text("A", "B", "C"))  # 3 blocks, 48 tokens
    run_until_idle(sim)
    second = sim.submit(64, 4, 10.0, text("A", "B", "D", "E"))  # shares A, B
    run_until_idle(sim)
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert (sim.prefix_cache.queries, sim.prefix_cache.hits) == (48 + 64, 32)
    snap = sim.snapshot(20.0)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (112, 32)


def test_a_full_hit_still_computes_the_last_token() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    sim.submit(32, 2, 0.0, text("A", "B"))
    run_until_idle(sim)
    again = sim.submit(32, 2, 10.0, text("A", "B"))
    run_until_idle(sim)
    assert again.cached_tokens == 31  # vLLM recomputes the last prompt token


def test_the_cached_prefix_skips_its_prefill() -> None:
    profile = get_profile("910B")
    cold, warm = EngineSim(profile, 10), EngineSim(profile, 10)
    prompt = text(*"ABCDEFGHIJ" * 10)  # 100 blocks, 1600 tokens
    warm.submit(1600, 1, 0.0, prompt)
    run_until_idle(warm)
    a, b = cold.submit(1600, 1, 100.0, prompt), warm.submit(1600, 1, 100.0, prompt)
    run_until_idle(cold)
    run_until_idle(warm)
    assert a.first_token_at is not None and b.first_token_at is not None
    saved = (a.first_token_at - 100.0) - (b.first_token_at - 100.0)
    assert saved == pytest.approx(warm.prefill_s(1599))  # 1599 of 1600 tokens not prefilled


def test_requests_admitted_in_one_step_do_not_hit_each_other() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    reqs = [sim.submit(32, 2, 0.0, text("A", "B")) for _ in range(3)]
    run_until_idle(sim)
    assert [r.cached_tokens for r in reqs] == [0, 0, 0]  # the blocks exist only after the prefill step
    later = sim.submit(32, 2, 10.0, text("A", "B"))
    run_until_idle(sim)
    assert later.cached_tokens == 31


def test_a_request_without_text_never_hits() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    sim.submit(48, 2, 0.0)
    run_until_idle(sim)
    sim.submit(48, 2, 10.0)
    run_until_idle(sim)
    assert (sim.prefix_cache.queries, sim.prefix_cache.hits, len(sim.prefix_cache)) == (96, 0, 0)


def test_eviction_keeps_the_cache_in_the_free_kv_room() -> None:
    # 160 KV tokens = 10 blocks. A (4 blocks) finishes and stays cached; B reserves 96 + 32 = 128
    # tokens, leaving room for 2 unreferenced blocks: A's tail blocks go first (released tail first).
    sim = EngineSim(get_profile("910B"), 10, kv_tokens=160)
    a = text("A", "B", "C", "D")
    sim.submit(64, 1, 0.0, a)
    run_until_idle(sim)
    assert len(sim.prefix_cache) == 4 and len(sim.prefix_cache.free) == 4
    sim.submit(96, 32, 10.0, text(*"UVWXYZ"))
    sim.advance(10.2)  # B admitted: its reservation shrinks the room
    keys = block_keys(a, 16, 4)
    assert list(sim.prefix_cache.free) == list(keys[:2][::-1])  # A's first two blocks survive
    run_until_idle(sim)
    again = sim.submit(64, 1, 30.0, a)
    run_until_idle(sim)
    assert again.cached_tokens == 32


def test_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(16)
    keys = block_keys(text("A", "B", "C"), 16, 3)
    cache.acquire(keys)
    assert cache.evict_to(0) == 0 and len(cache) == 3
    cache.release(keys)
    assert list(cache.free) == [keys[2], keys[1], keys[0]]
    assert cache.evict_to(16) == 2 and list(cache.free) == [keys[0]]
    assert cache.match(keys) == 1


def test_cancelled_request_releases_only_what_it_held() -> None:
    sim = EngineSim(get_profile("910B"), 10)
    sim.submit(32, 2, 0.0, text("A", "B"))
    run_until_idle(sim)
    req = sim.submit(64, 50, 10.0, text("A", "B", "C", "D"))
    sim.advance(10.16)  # admitted (front end 0.15 s), prefill step not over
    assert req.held_blocks == 2
    sim.cancel(req.req_id)
    assert all(v == 0 for v in sim.prefix_cache.refs.values()) and len(sim.prefix_cache) == 2


async def test_metrics_expose_the_prefix_cache_counters(make_client: MakeClient, engine: object,
                                                        http: aiohttp.ClientSession) -> None:
    from laswrr.collectors.prometheus import parse_engine_metrics

    oai = make_client(engine)  # type: ignore[arg-type]
    prompt = BLOCK * 3  # 48 tokens, 3 blocks
    await oai.completions.create(model="sim-910B", prompt=prompt, max_tokens=2)
    await asyncio.sleep(0)
    await oai.completions.create(model="sim-910B", prompt=prompt, max_tokens=2)
    async with http.get(f"{engine.url}/metrics") as r:  # type: ignore[attr-defined]
        body = await r.text()
    s = _samples(body)
    m = (("model_name", "sim-910B"),)
    assert s[("vllm:prefix_cache_queries_total", m)] == 96
    assert s[("vllm:prefix_cache_hits_total", m)] == 47
    parsed = parse_engine_metrics(body)
    assert (parsed.prefix_cache_queries, parsed.prefix_cache_hits) == (96, 47)


_ = StartEngine  # the fixtures' types, shared with test_sim_http
