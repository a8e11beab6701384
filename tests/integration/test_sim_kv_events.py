"""The exact cache view end to end on simulated engines: a real nats-server and scheduler (``Stack``),
a ``laswrr sim-engine`` process publishing its KV events on vLLM's wire (``--kv-events``, with the
tiny model's tokenizer), the ``laswrr kv-events`` service and a proxy with the same tokenizer.
After requests through the proxy, its view of the node holds exactly the blocks of their prompts
as the proxy tokenizes them; after the engine process is killed and restarted (same ports, an
empty cache, its batches counted from 0 again) the view is dropped and rebuilt from the new
engine's blocks alone."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import aiohttp

from laswrr.collectors.nodes import Node
from laswrr.schemas.kvcache import chain_keys
from laswrr.services.children import RestartPolicy
from laswrr.services.nats_server import free_port
from laswrr.services.proxy.tokens import PromptTokenizer
from laswrr.services.up import SIM_MODEL, Stack

BLOCK = 16  # the simulated engine's block size


def _messages(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{topic}: the load guard bounds what affinity may cost. " * 6},
            {"role": "user", "content": f"What does the guard do for {topic}?"}]


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> None:
    body = {"model": SIM_MODEL, "messages": messages, "max_tokens": 3}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


async def test_the_proxy_holds_the_sim_engine_s_blocks_and_drops_them_at_a_restart(
        tmp_path: Path, model_dir: Path, http: aiohttp.ClientSession, eventually) -> None:
    tokenizer = PromptTokenizer(model_dir)

    def blocks(*topics: str) -> int:  # distinct blocks of the prompts, as the proxy keys them
        keys: set[int] = set()
        for topic in topics:
            tokens = tokenizer.encode(_messages(topic), None)
            assert tokens is not None and len(tokens) >= 4 * BLOCK
            keys.update(chain_keys(tokens, BLOCK))
        return len(keys)

    stack = Stack(tmp_path / "data", proxy_port=0, restart=RestartPolicy(), tick_ms=50)
    pub, replay, metrics_port = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port())
    try:
        stack.allow_hosts([], sims=True)
        await stack.start_nats()
        await stack.start_core()
        engine = await stack.spawn(
            "n1", "sim-engine", "--port", str(free_port()), "--chip", "910B", "--capacity", "4", "--node-id", "n1",
            "--speed", "20", "--model", SIM_MODEL, "--kv-events", pub, "--kv-events-replay", replay,
            "--tokenizer", str(model_dir), role="sim-engine", wait_listening=True)
        assert engine.url is not None
        node = Node(id="n1", url=engine.url, chip="910B", capacity=4,
                    extra={"kv_events": pub, "kv_events_replay": replay})
        await stack.register([node])
        await stack.spawn("kv-events", "kv-events", "--metrics-port", str(metrics_port), role="collector")
        url = await stack.start_proxy(port=0, extra_args=("--tokenizer", str(model_dir)))

        async def view_holds(want: int) -> bool:
            return await _metric(http, url, 'laswrr_proxy_kv_view_blocks{node="n1"}') == want

        await eventually(lambda: _subscribed(http, engine.url), what="the service subscribed to n1's events")
        for topic in ("alpha", "beta"):
            await _chat(http, url, _messages(topic))
        want = blocks("alpha", "beta")
        await eventually(lambda: view_holds(want), what=f"the {want} blocks of the prompts in the proxy's view")
        assert await _metric(http, url, 'laswrr_proxy_kv_view_exact{node="n1"}') == 1

        old_pid = engine.pid
        os.kill(old_pid, signal.SIGKILL)  # the stack restarts it: same ports, an empty cache
        await eventually(lambda: _restarted(stack, "n1", old_pid), timeout=30, what="n1 restarted")
        await eventually(lambda: _subscribed(http, engine.url), timeout=30, what="the service subscribed again")
        for topic in ("gamma", "delta"):
            await _chat(http, url, _messages(topic))
        want = blocks("gamma", "delta")
        assert want < blocks("alpha", "beta", "gamma", "delta")
        await eventually(lambda: view_holds(want), what=f"only the new engine's {want} blocks")
        assert await _metric(http, f"http://127.0.0.1:{metrics_port}",
                             'laswrr_kv_events_cleared_total{node="n1",reason="restart"}') == 1
    finally:
        await stack.stop()


def _restarted(stack: Stack, name: str, old_pid: int) -> bool:
    return any(c.name == name and c.pid != old_pid and c.process.returncode is None for c in stack.children)


async def _subscribed(http: aiohttp.ClientSession, url: str) -> bool:
    """The engine serves, and its KV event publisher has a subscriber: the next batch reaches it."""
    try:
        async with http.get(f"{url}/sim/state") as resp:
            return resp.status == 200 and (await resp.json())["kv_events_subscribers"] > 0
    except aiohttp.ClientError:
        return False


async def test_the_stack_s_simulated_engines_publish_with_the_proxy_s_tokenizer(
        tmp_path: Path, model_dir: Path, http: aiohttp.ClientSession) -> None:
    """``laswrr up --proxy-arg tokenizer=DIR`` (``Stack.start_sim_engines(tokenizer=)``): each vLLM-flavoured
    simulated engine publishes its KV events and its node names the endpoints; a MindIE one does not."""
    stack = Stack(tmp_path / "data", proxy_port=0)
    try:
        nodes = await stack.start_sim_engines([("v1", "910B", 2), ("m1", "910B", 2, "mindie")], speed=20,
                                              tokenizer=str(model_dir))
        by_id = {node.id: node for node in nodes}
        assert set(by_id["v1"].extra) >= {"kv_events", "kv_events_replay"}
        assert "kv_events" not in by_id["m1"].extra
        assert by_id["v1"].registration().kv_events == by_id["v1"].extra["kv_events"]
        for node, subscribers in (("v1", 0), ("m1", None)):
            async with http.get(f"{by_id[node].url}/sim/state") as resp:
                assert (await resp.json())["kv_events_subscribers"] == subscribers
    finally:
        await stack.stop()
