"""laswrr in front of real vLLM engines (CPU build, tests/real/conftest.py): `laswrr up --nodes` with
two real servers of `--max-num-seqs 4`, driven as a user would (the `openai` client, `laswrr
capacity`/`drain`, `kill -9` of an engine's process tree), checked against the engines' own
`/metrics` and the recorded DuckDB log.

The engines are shared by the whole session; the kill test runs last and restarts what it killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from nats.js.api import DeliverPolicy

from laswrr.bench import real_vllm
from laswrr.collectors.prometheus import parse_engine_metrics
from laswrr.replay.store import open_read
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import decode_event
from laswrr.schemas.events import EngineSampled
from tests.real.conftest import REAL_TIMEOUT_S, RealStack, real_stack
from tests.up_process import Load, no_leftover_stack

pytestmark = pytest.mark.timeout(REAL_TIMEOUT_S)
no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
Engines = list[real_vllm.VllmServer]


def engine_metrics(engine: real_vllm.VllmServer) -> Any:
    return parse_engine_metrics(engine.metrics())


def counter(engine: real_vllm.VllmServer, name: str) -> float:
    """A vLLM counter summed over its series (vllm:request_success_total has one per finish reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(engine.metrics()):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def recorded(data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    with open_read(data_dir / "events.duckdb") as db:  # the analysts' views too
        return db.execute(sql).fetchall()


async def laswrr_cli(stack: RealStack, *args: str) -> tuple[int, str]:
    env = {**os.environ, "NATS_URL": stack.banner["operator URL"]}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "laswrr", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


# -- the collector reads the real /metrics ----------------------------------------------------------


async def test_collector_reads_the_real_engines_metrics(vllm_engines: Engines, tmp_path: Path) -> None:
    before = {e.name: engine_metrics(e) for e in vllm_engines}
    # flow control off (up turns it on): it would hold the excess in the proxy, and the test needs
    # the engines' own queue to read
    async with real_stack(tmp_path, vllm_engines, "--no-flow-control") as stack:
        idle = await stack.nodes()
        assert all(n["load"]["running"] == 0 and n["load"]["queue"] == 0 for n in idle.values()), idle
        load = Load(stack.proxy_url, workers=14, max_tokens=120, stream=True)
        load.start()
        # until each engine has been seen full (the snapshot's load: running per slot 1, some queue,
        # KV in use): the load once stopped when one was, and the other had been seen at 1 running
        busy: dict[str, dict[str, float]] = {e.name: {} for e in vllm_engines}

        def full(name: str) -> bool:
            seen = busy[name]
            return seen.get("running", 0) >= 1.0 and seen.get("queue", 0) > 0 and seen.get("kv", 0) > 0

        # The snapshot's running is dead-reckoned from in-flight counts, so it can read full before
        # any scrape caught the engine at max_num_seqs (a sample between a finish and the next
        # admission reads running 3, waiting 1): hold the load for several scrapes (0.5 s each)
        # after each engine has been seen full, on its own /metrics too.
        saturated = {e.name: False for e in vllm_engines}
        try:
            deadline, held = time.monotonic() + 90, None
            while time.monotonic() < deadline and (held is None or time.monotonic() < held):
                for name, node in (await stack.nodes()).items():
                    for key in ("queue", "running", "kv"):
                        busy[name][key] = max(busy[name].get(key, 0.0), node["load"][key])
                for engine in vllm_engines:
                    own = await asyncio.to_thread(engine_metrics, engine)
                    saturated[engine.name] |= own.running == engine.max_num_seqs
                if held is None and all(saturated.values()) and all(full(name) for name in busy):
                    held = time.monotonic() + 3.0
                await asyncio.sleep(0.2)
        finally:
            await load.stop()
        assert all(full(name) for name in busy) and all(saturated.values()), (busy, saturated)
        assert load.failed == 0 and load.served > 0, load.reasons
        settled = await stack.wait_nodes(lambda ns: all(n["load"]["running"] == 0 and n["load"]["queue"] == 0
                                                        for n in ns.values()), 30, "idle again")
        assert all(n["load"]["kv"] < busy[name]["kv"] for name, n in settled.items())
        # a prompt of several 128-token blocks, twice on each engine: the second finds it cached
        async with aiohttp.ClientSession() as http:
            for engine in vllm_engines:
                for _ in range(2):
                    body = {"model": real_vllm.MODEL_NAME, "max_tokens": 2,
                            "messages": [{"role": "user", "content": _prefix_text("metrics", 0)}]}
                    async with http.post(f"{engine.url}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200
        await sampled_since(stack, vllm_engines)  # the collector's next scrape, published
        await stack.stop()
    after = {e.name: engine_metrics(e) for e in vllm_engines}
    for name in after:  # the engines' own prefix-cache counters moved
        assert after[name].prefix_cache_queries > before[name].prefix_cache_queries
        assert after[name].prefix_cache_hits >= before[name].prefix_cache_hits + 128
    samples = recorded(stack.data_dir, """
        SELECT key, max(CAST(j->>'running' AS INT)), max(CAST(j->>'waiting' AS INT)),
               max(CAST(j->>'kv_cache_usage' AS DOUBLE)), any_value(j->>'engine'),
               max(CAST(j->>'prefix_cache_queries' AS DOUBLE)), max(CAST(j->>'prefix_cache_hits' AS DOUBLE))
        FROM input_events WHERE family = 'lb.metrics.engine' GROUP BY key ORDER BY key""")
    assert [row[0] for row in samples] == sorted(e.name for e in vllm_engines)
    for node, running, waiting, kv, engine, queries, hits in samples:
        assert engine == "vllm" and running == real_vllm_seqs(vllm_engines, node) and waiting > 0 and kv > 0, samples
        assert queries is not None and hits is not None and 128 <= hits <= queries, samples


async def sampled_since(stack: RealStack, engines: Engines, timeout_s: float = 30.0) -> None:
    """Until the collector has published, for each engine, a sample whose prefix-cache hits reach
    what the engine counts now (a scrape after the requests just made)."""
    want = {e.name: engine_metrics(e).prefix_cache_hits for e in engines}
    reached: set[str] = set()
    done = asyncio.Event()

    async def on_sample(msg: Any) -> None:
        node, sample = decode_event(msg.subject, msg.data)
        assert isinstance(sample, EngineSampled)
        if node in want and (sample.prefix_cache_hits or 0) >= want[node]:
            reached.add(node)
            if reached == set(want):
                done.set()

    sub = await stack.nc.jetstream().subscribe(f"{sj.METRICS_ENGINE}.>", cb=on_sample, ordered_consumer=True,
                                               deliver_policy=DeliverPolicy.NEW)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()


def real_vllm_seqs(engines: Engines, name: str) -> int:
    return next(e.max_num_seqs for e in engines if e.name == name)


# -- the openai client through the proxy ------------------------------------------------------------


async def test_openai_client_chat_and_completions_streamed_and_not(vllm_engines: Engines, tmp_path: Path) -> None:
    async with real_stack(tmp_path, vllm_engines) as stack:
        client = openai.AsyncOpenAI(base_url=f"{stack.proxy_url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What does a load-aware router do?"}]
        prompt = "Smooth weighted round robin picks"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.proxy_url}/tokenize", json={"model": "default", "messages": messages}) as r:
                chat_prompt_tokens = (await r.json())["count"]
            async with http.post(f"{stack.proxy_url}/tokenize", json={"model": "default", "prompt": prompt}) as r:
                text_prompt_tokens = (await r.json())["count"]
        models = await client.models.list()
        assert [m.id for m in models.data] == [real_vllm.MODEL_NAME]

        chat = await client.chat.completions.create(model="default", messages=messages, max_tokens=24)  # type: ignore[arg-type]
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        assert chat.model == real_vllm.MODEL_NAME
        assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens,
                                           chat.usage.total_tokens) == (chat_prompt_tokens, 24, chat_prompt_tokens + 24)

        text = await client.completions.create(model="default", prompt=prompt, max_tokens=16)
        assert text.choices[0].text and text.usage is not None
        assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (text_prompt_tokens, 16)

        stream = await client.chat.completions.create(model="default", messages=messages, max_tokens=32,  # type: ignore[arg-type]
                                                      stream=True, stream_options={"include_usage": True})
        ids, pieces, usage = set(), [], None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(ids) == 1 and "".join(pieces)
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (chat_prompt_tokens, 32)

        stream2 = await client.completions.create(model="default", prompt=prompt, max_tokens=20, stream=True,
                                                  stream_options={"include_usage": True})
        texts, usage = [], None
        async for chunk in stream2:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(texts) and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (text_prompt_tokens, 20)
        await client.close()


# -- capacity drop and drain under load ---------------------------------------------------------------


async def test_capacity_drop_to_one_and_drain_under_load_cut_nothing(vllm_engines: Engines, tmp_path: Path) -> None:
    a = vllm_engines[0]
    async with real_stack(tmp_path, vllm_engines) as stack:
        load = Load(stack.proxy_url, workers=6, max_tokens=60, stream=True)
        load.start()
        try:
            await asyncio.sleep(3)
            code, out = await laswrr_cli(stack, "capacity", a.name, "1", "--wait", "30")
            assert code == 0 and "applied" in out, out
            dropped = await stack.wait_nodes(lambda ns: ns[a.name]["capacity"] == 1
                                             and ns[a.name]["effective_weight"] < 0.5 * ns[vllm_engines[1].name][
                                                 "effective_weight"], 60, "the weight follows the drop")
            assert dropped[a.name]["routable"]
            await asyncio.sleep(3)
            code, out = await laswrr_cli(stack, "drain", a.name, "--wait", "30")
            assert code == 0 and "applied" in out, out
            drained = await stack.wait_nodes(lambda ns: ns[a.name]["phase"] == "drained", 90, "drained")
            assert drained[a.name]["inflight"] == 0
            served_at_drained = counter(a, "vllm:request_success_total")
            served_load = load.served
            await asyncio.sleep(4)
        finally:
            await load.stop()
        assert load.served > served_load  # the load went on, on the other engine
        assert counter(a, "vllm:request_success_total") == served_at_drained  # nothing new reached the drained one
        assert engine_metrics(a).running == 0
        assert (load.failed, load.cut) == (0, 0), load.reasons
        code, out = await laswrr_cli(stack, "undrain", a.name, "--wait", "30")
        assert code == 0, out


# -- an engine-side error reaches the client as it was ---------------------------------------------


async def test_engine_error_reaches_the_client_with_its_status_and_body(vllm_engines: Engines,
                                                                        tmp_path: Path) -> None:
    too_long = " ".join(f"word{k}" for k in range(3000))  # > 2048 tokens (--max-model-len)
    body = {"model": real_vllm.MODEL_NAME, "prompt": too_long, "max_tokens": 8}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{vllm_engines[0].url}/v1/completions", json=body) as resp:
            direct_status, direct = resp.status, await resp.json()
        assert direct_status == 400 and "maximum context length" in json.dumps(direct), direct
        async with real_stack(tmp_path, vllm_engines) as stack:
            async with http.post(f"{stack.proxy_url}/v1/completions", json={**body, "model": "default"}) as resp:
                status, got = resp.status, await resp.json()
                request_id = resp.headers["x-laswrr-request-id"]
                node = resp.headers["x-laswrr-node"]
            assert (status, got) == (direct_status, direct)
            nodes = await stack.nodes()  # a client's error is no mark against the engine
            assert all(n["routable"] and n["phase"] == "active" for n in nodes.values()), nodes
            await stack.stop()
    rows = recorded(stack.data_dir, f"""
        SELECT key, j->>'outcome', CAST(j->>'status' AS INT), j->>'error' FROM input_events
        WHERE family = 'lb.req.finished' AND j->>'request_id' = '{request_id}'""")
    assert len(rows) == 1 and rows[0][:3] == (node, "engine_error", 400), rows


# -- prefix affinity raises the engines' own prefix-cache hits ------------------------------------


PREFIXES = 9  # odd: two engines taking turns would otherwise each see a fixed half of them
REPEATS = 4


def _prefix_text(run: str, k: int, chars: int = 1200) -> str:
    source = (Path(real_vllm.__file__).parents[1] / "docs" / "design.md").read_text()
    start = 1500 * k
    return f"[{run} context {k}] " + source[start:start + chars]


async def _prefix_run(stack: RealStack, engines: Engines, run: str, chars: int) -> float:
    before = sum(engine_metrics(e).prefix_cache_hits for e in engines)
    async with aiohttp.ClientSession() as http:
        async def one(k: int, r: int) -> None:
            body = {"model": "default", "max_tokens": 4, "messages": [
                {"role": "system", "content": _prefix_text(run, k, chars)},
                {"role": "user", "content": f"question {r} about part {k}"}]}
            async with http.post(f"{stack.proxy_url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()

        for r in range(REPEATS):  # prefixes in turn, two at a time
            order = list(range(PREFIXES))
            for i in range(0, PREFIXES, 2):
                await asyncio.gather(*(one(k, r) for k in order[i:i + 2]))
    return sum(engine_metrics(e).prefix_cache_hits for e in engines) - before


async def test_prefix_affinity_raises_the_engines_prefix_cache_hits(vllm_engines: Engines, tmp_path: Path) -> None:
    from tests.real.conftest import BLOCK_TOKENS, NUM_BLOCKS

    room = NUM_BLOCKS * BLOCK_TOKENS
    # The sizing: all prefixes overflow one engine's KV, half fit. The text is the docs' own, whose
    # characters per token change as the docs do: the prefix's length in characters is set from a
    # first count so that it holds the middle of that window in tokens.
    target = (1.2 * room / PREFIXES + 0.8 * room / ((PREFIXES + 1) // 2)) / 2

    async def tokens(chars: int) -> int:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{vllm_engines[0].url}/tokenize",
                                 json={"model": real_vllm.MODEL_NAME, "prompt": _prefix_text("x", 3, chars)}) as resp:
                return int((await resp.json())["count"])

    chars = round(1200 * target / await tokens(1200))
    prefix_tokens = await tokens(chars)
    assert PREFIXES * prefix_tokens > 1.2 * room and (PREFIXES + 1) // 2 * prefix_tokens < 0.8 * room, prefix_tokens
    hits = {}
    for mode in ("none", "prefix"):
        # flow control off (up turns it on): the engines, not the proxy, hold the requests in flight,
        # as in the runs the margins below were measured on
        async with real_stack(tmp_path / mode, vllm_engines, "--no-flow-control",
                              env={"LASWRR_AFFINITY": mode}) as stack:
            hits[mode] = await _prefix_run(stack, vllm_engines, run=mode, chars=chars)
    print(f"REAL prefix-cache hit tokens: affinity none {hits['none']:.0f}, prefix {hits['prefix']:.0f} "
          f"({PREFIXES} prefixes of {prefix_tokens} tokens x {REPEATS}, KV room {room} tokens per engine)")
    ideal = PREFIXES * (REPEATS - 1) * (prefix_tokens // BLOCK_TOKENS * BLOCK_TOKENS)  # whole blocks hit
    # Without affinity, which engine gets a prefix again is close to a coin toss (the pair in flight
    # splits by the order of two concurrent picks, and the weights move with load): 27 tosses hit
    # about half of `ideal`, 0.19 to 0.63 of it in the runs measured. With affinity each prefix stays
    # on its engine: 0.92 of `ideal` in every run measured. So the test holds the affinity run to most
    # of the ideal and above the affinity-blind run by a margin a coin toss passes less than 1 in 100.
    assert hits["prefix"] > 0.8 * ideal, (hits, ideal)
    assert hits["prefix"] > 1.2 * hits["none"], hits


# -- kill -9 of one engine's process tree mid-stream (last: it restarts the engine) ---------------


STORY_TOKENS = 600
FOLLOWED = 16  # tokens of greedy decoding a continuation must follow
NEAR_TIE = 0.5  # nats: how far below the greedy token a token the continuation took may lie
NEAR_TIES = 3  # how many times in FOLLOWED tokens it may do so


async def _engine_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """POST straight to an engine (not through the router); once more when the pooled keep-alive
    connection it took had been closed by the engine meanwhile (aiohttp retries no POST itself)."""
    for attempt in (1, 2):
        try:
            async with http.post(url, json=body) as resp:
                return await resp.json()
        except aiohttp.ServerDisconnectedError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _follows(http: aiohttp.ClientSession, engine: real_vllm.VllmServer, messages: list[dict[str, Any]],
                   text: str) -> tuple[int, list[str], str]:
    """How many tokens of greedy decoding ``text`` follows (up to FOLLOWED) when ``engine``
    continues the final assistant message of ``messages``; the near ties through which it left
    the greedy token (each one a token within NEAR_TIE of it); and, when it left at no near tie,
    where ("" when it did not).

    Token by token on the token ids: the prompt is the engine's own tokenization of ``messages``
    (the continuation's chat template), each step a greedy ``/v1/completions`` of that prompt plus
    the tokens matched so far, so a near tie the continuation took is followed from there on.
    Texts are compared without U+FFFD: the tiny model writes bytes that are not UTF-8, which the
    stream's incremental detokenizer and a whole decode render as different runs of U+FFFD."""
    def token_id(token: str) -> int:
        return int(token.removeprefix("token_id:"))

    text = text.replace("\ufffd", "")

    async def agrees(ids: list[int]) -> bool:
        reply = await _engine_json(http, f"{engine.url}/detokenize", {"model": real_vllm.MODEL_NAME, "tokens": ids})
        shown = str(reply["prompt"]).replace("\ufffd", "")
        return text.startswith(shown) or shown.startswith(text)

    prompt = (await _engine_json(http, f"{engine.url}/tokenize", {
        "model": real_vllm.MODEL_NAME, "messages": messages, "continue_final_message": True,
        "add_generation_prompt": False}))["tokens"]
    matched: list[int] = []
    ties: list[str] = []
    while len(matched) < FOLLOWED:
        reply = await _engine_json(http, f"{engine.url}/v1/completions", {
            "model": real_vllm.MODEL_NAME, "prompt": prompt + matched, "max_tokens": FOLLOWED - len(matched),
            "temperature": 0, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True})
        logprobs = reply["choices"][0]["logprobs"]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                       strict=True):
            if await agrees(matched + [token_id(token)]):
                matched.append(token_id(token))
                continue
            near = [alt for alt, alt_logprob in sorted(top.items(), key=lambda kv: -kv[1])
                    if alt != token and logprob - alt_logprob <= NEAR_TIE]
            for alt in near:
                if await agrees(matched + [token_id(alt)]):
                    ties.append(f"{alt} for {token} ({top[alt]:.3f} against {logprob:.3f})")
                    matched.append(token_id(alt))
                    break
            else:
                return len(matched), ties, f"at {token} ({logprob:.3f}), top {top}"
            break  # decode again from the near tie taken
    return len(matched), ties, ""


async def _read_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       out: dict[str, Any], on_event: Callable[[], None] = lambda: None) -> None:
    async with http.post(url, json=body) as resp:
        out["status"] = resp.status
        out["node"] = resp.headers.get("x-laswrr-node")
        out["request_id"] = resp.headers.get("x-laswrr-request-id")
        out["events"] = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                out["events"].append((time.monotonic(), line[6:]))
                on_event()


async def test_kill_one_engine_tree_mid_stream_every_stream_completes(vllm_engines: Engines,
                                                                      tmp_path: Path) -> None:
    a, b = vllm_engines
    async with real_stack(tmp_path, vllm_engines) as stack:
        messages = [{"role": "user", "content": "Tell a long story about weights."}]
        # 600 tokens: on a quiet machine 8 streams of 200 ended within 1.1 s, before the kill could
        # land mid-stream; 4 streams of 617 tokens still fit an engine's KV room (NUM_BLOCKS)
        body = {"model": "default", "messages": messages, "max_tokens": STORY_TOKENS, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        streams: list[dict[str, Any]] = [{} for _ in range(8)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            # each engine answers once first: a cold engine's first answer takes seconds longer (run
            # alone, this test saw the warm engine finish its streams before the cold one began its own)
            for engine in vllm_engines:
                warm = {"model": real_vllm.MODEL_NAME, "messages": messages, "max_tokens": 2}
                async with http.post(f"{engine.url}/v1/chat/completions", json=warm) as resp:
                    assert resp.status == 200, await resp.text()
            # the kill lands as soon as every stream has its node and those on a have 5 events, from
            # the reading tasks themselves: the two engines share 2 cores, one can start its batch a
            # second after the other and then run 600 tokens in about 2 s (polling every 50 ms, a's
            # streams once stood at 504 events at the kill, and in another run had ended)
            ready = asyncio.Event()

            def check() -> None:
                if all(s.get("events") is not None for s in streams) and all(
                        len(s["events"]) >= 5 for s in streams if s["node"] == a.name):
                    ready.set()

            tasks = [asyncio.create_task(_read_stream(http, f"{stack.proxy_url}/v1/chat/completions", body, s, check))
                     for s in streams]
            await asyncio.wait_for(ready.wait(), 60)
            on_a = [s for s in streams if s["node"] == a.name]
            assert on_a and len(on_a) < len(streams), [s["node"] for s in streams]
            assert not any(t.done() for s, t in zip(streams, tasks) if s["node"] == a.name)
            at_kill = sorted(len(s["events"]) for s in on_a)
            killed_at = time.monotonic()
            pids = a.kill_tree()
            assert len(pids) >= 3  # API server, engine core, worker
            await asyncio.wait_for(asyncio.gather(*tasks), 240)

            for s in streams:
                payloads = [p for _, p in s["events"]]
                assert s["status"] == 200 and payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
                chunks = [json.loads(p) for p in payloads[:-1]]
                assert not any("error" in c for c in chunks), chunks[-3:]
                assert len({c["id"] for c in chunks}) == 1
                usage = [c["usage"] for c in chunks if c.get("usage")]
                assert usage and usage[-1]["completion_tokens"] == STORY_TOKENS, usage
                s["text"] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        ejected = await stack.wait_nodes(lambda ns: not ns[a.name]["routable"], 60, "the killed node ejected")
        assert ejected[a.name]["phase"] == "ejected", ejected[a.name]
        restart_began = time.monotonic()
        a.launch()  # in this thread: the engine gets SIGTERM when the thread that started it ends
        await asyncio.to_thread(a.wait_ready)
        back = await stack.wait_nodes(lambda ns: ns[a.name]["routable"], 120, "the restarted node back")
        assert back[a.name]["phase"] in ("recovering", "active")
        print(f"REAL kill -9 of {len(pids)} processes {time.monotonic() - killed_at:.1f}s ago: {len(on_a)} of "
              f"{len(streams)} streams (at {at_kill[0]}-{at_kill[-1]} events) continued on {b.name}; restart took {a.started_s:.0f}s, routable "
              f"{time.monotonic() - restart_began:.0f}s after it began")
        await stack.stop()
    rows = recorded(stack.data_dir, "SELECT request_id, tokens_before FROM continuations "
                                    "WHERE kind = 'continued' AND next_outcome = 'completed'")
    assert sorted(r[0] for r in rows) == sorted(s["request_id"] for s in on_a), (rows, [s["request_id"] for s in on_a])
    # the text after the break continues the text before it. The text before it is what the proxy
    # had forwarded from the killed engine: its first `tokens_before` chunks with text (the proxy
    # counts one token a chunk with text when no usage came, and records that count), which the
    # continuation sent back as the assistant's message to continue. What came after it is what the
    # surviving engine writes from there, greedy: compared token by token with greedy decoding
    # on that engine, it follows FOLLOWED tokens, leaving the greedy token only at near ties (the
    # tiny model's distributions are flat and its logits bf16: 10 or more of 200 greedy tokens tie
    # exactly). One CI run saw a continuation take a token that greedy decoding of the context the
    # test then took (cut at the longest silence after the kill) places 0.25 below the greedy one;
    # whether that cut was wrong or the numbers moved with the batch was not established.
    # The check fails on a wrong text: text the client got twice (the last chunk before the break
    # repeated) or never (the first one or two chunks after it dropped) left the greedy path at
    # its first token in 12 of 12 such checks, 4 streams in one run.
    tokens_before = dict(rows)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for s in on_a:
            chunks = [json.loads(p) for _, p in s["events"][:-1]]
            said = [part for c in chunks if c["choices"] and (part := c["choices"][0]["delta"].get("content"))]
            before_text = "".join(said[:tokens_before[s["request_id"]]])
            rest = s["text"][len(before_text):]
            assert s["text"].startswith(before_text) and before_text and rest
            same, ties, left = await _follows(http, b, messages + [{"role": "assistant", "content": before_text}], rest)
            assert same >= FOLLOWED and len(ties) <= NEAR_TIES, (same, ties, left, rest[:80])
            if ties:
                print(f"REAL continuation: {FOLLOWED} greedy tokens followed through {len(ties)} near ties: {ties}")
