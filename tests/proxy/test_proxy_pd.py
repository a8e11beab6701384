"""Prefill/decode pairs through the proxy (the vllm and sglang protocols, docs/proxy.md
"Prefill/decode pairs"): real sim-engine processes started with --pd-role (and
--pd-protocol sglang, each prefill instance with its bootstrap port), a real nats-server, a proxy
in this process routing on the real scheduler core's snapshots. Faults are engine processes
killed by their own PID."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from proxy_support import CoreDriver, EventTap, StartProxy, wait_for, wait_seq

from laswrr.schemas import subjects as sj
from laswrr.services.nats_server import free_port
from laswrr.services.proxy.app import RunningProxy
from laswrr.services.sim_engine.cli import LISTEN_PREFIX
from laswrr.services.sim_engine.openai_api import filler_tokens

pytestmark = pytest.mark.timeout(120)
MODEL = "sim-910B"
PROMPT = "Once upon a time, on an Ascend NPU,"


@dataclass
class Engine:
    node: str
    role: str
    process: asyncio.subprocess.Process
    url: str
    protocol: str = "vllm"
    bootstrap_port: int | None = None

    async def admin(self, http: aiohttp.ClientSession, **changes: Any) -> None:
        async with http.post(self.url + "/admin", json=changes) as resp:
            assert resp.status == 200, await resp.text()

    async def running(self, http: aiohttp.ClientSession) -> int:
        return int((await self.state(http))["running"])

    async def state(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.get(self.url + "/sim/state") as resp:
            return dict(await resp.json())

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)  # by its own PID, mid-request
        await self.process.wait()


StartEngine = Callable[..., Awaitable[Engine]]


@pytest.fixture
async def engines() -> AsyncIterator[StartEngine]:
    started: list[Engine] = []

    async def _start(node: str, role: str, protocol: str = "vllm", *flags: str) -> Engine:
        port = free_port() if protocol == "sglang" and role == "prefill" else None
        extra = ["--pd-protocol", protocol, *flags] + ([] if port is None else ["--bootstrap-port", str(port)])
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "laswrr.services.sim_engine.cli", "sim-engine", "--port", "0", "--chip", "910B",
            "--capacity", "4", "--speed", "10", "--node-id", node, "--pd-role", role, *extra,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        assert line.startswith(LISTEN_PREFIX), line
        engine = Engine(node, role, process, line.removeprefix(LISTEN_PREFIX), protocol, port)
        started.append(engine)
        return engine

    yield _start
    for engine in started:
        if engine.process.returncode is None:
            engine.process.kill()
            await engine.process.wait()


async def register(core: CoreDriver, proxy: RunningProxy, *engines: Engine) -> None:
    """Register each engine with its role and tick until the proxy can pick it for its role."""
    for engine in engines:
        registration: dict[str, Any] = {"url": engine.url, "capacity": 4, "role": engine.role,
                                        "pd_protocol": engine.protocol}
        if engine.bootstrap_port is not None:
            registration["bootstrap_port"] = engine.bootstrap_port
        seq = await core.send(sj.admin_node(engine.node), registration)
        await wait_seq(proxy, "default", seq)
    for _ in range(100):
        route = proxy.state.router.table.route("default")
        picked = {**route.first.targets, **route.decode.targets}
        if all(e.node in picked for e in engines):
            return
        await wait_seq(proxy, "default", await core.tick())
    raise AssertionError("the engines never became routable")


def body(max_tokens: int, prompt_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}
    if prompt_tokens is not None:
        out["sim"] = {"prompt_tokens": prompt_tokens}
    return out


async def stream(http: aiohttp.ClientSession, proxy: RunningProxy, payload: dict[str, Any],
                 seen: asyncio.Queue[int] | None = None) -> tuple[str, str, list[Any]]:
    """(request id, text, error events) of one streamed completion through the proxy; ``seen``
    gets how many text chunks arrived so far, at each one."""
    text, errors, count = "", [], 0
    async with http.post(proxy.url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        request_id = resp.headers["x-laswrr-request-id"]
        async for line in resp.content:
            data = line.strip().removeprefix(b"data:").strip()
            if not data or data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    text += choice["text"]
                    count += 1
                    if seen is not None:
                        seen.put_nowait(count)
    return request_id, text, errors


def legs(tap: EventTap, request_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The request's finished events (node, payload), in attempt order."""
    return [(s.rsplit(".", 1)[1], d) for s, d in tap.of(sj.REQ_FINISHED)
            if d["request_id"].split(".")[0] == request_id]


async def test_requests_complete_through_a_pair(engines: StartEngine, core: CoreDriver, start_proxy: StartProxy,
                                                http: aiohttp.ClientSession, tap: EventTap) -> None:
    p1, p2, d1 = await engines("p1", "prefill"), await engines("p2", "prefill"), await engines("d1", "decode")
    proxy = await start_proxy(affinity="none")
    await register(core, proxy, p1, p2, d1)
    expected = "".join(filler_tokens(0, PROMPT, 12))
    answers = await asyncio.gather(*(stream(http, proxy, body(12)) for _ in range(6)))
    assert [(text, errors) for _, text, errors in answers] == [(expected, [])] * 6
    prefill_nodes = set()
    for request_id, _, _ in answers:
        await wait_for(lambda rid=request_id: len(legs(tap, rid)) == 2, what=f"{request_id}'s two legs")
        (pnode, prefill), (dnode, decode) = legs(tap, request_id)
        prefill_nodes.add(pnode)
        assert (prefill["request_id"], prefill["role"], prefill["outcome"], prefill["next_attempt"]) == (
            request_id, "prefill", "completed", None)  # not a retry: the views read it as the first attempt
        assert prefill["ttft_ms"] is None and prefill["completion_tokens"] == 1
        assert (dnode, decode["request_id"], decode["role"], decode["outcome"]) == (
            "d1", f"{request_id}.1", "decode", "completed")
        assert decode["completion_tokens"] == 12
    assert prefill_nodes == {"p1", "p2"}  # both prefill nodes took legs (equal weights)
    started = [d for _, d in tap.of(sj.REQ_STARTED)]
    assert {d.get("role") for d in started} == {"prefill", "decode"}



async def _prefill_killed_mid_request(protocol: str, engines: StartEngine, core: CoreDriver,
                                      start_proxy: StartProxy, http: aiohttp.ClientSession) -> str:
    """A prefill engine killed by its pid while it prefills 4,000 tokens (~5 s at its slowdown), a
    second prefill engine registered just before: the client's stream must still be whole."""
    doomed, d1 = await engines("doomed", "prefill", protocol), await engines("d1", "decode", protocol)
    rescuer = await engines("rescuer", "prefill", protocol)
    await doomed.admin(http, slowdown=50.0)
    proxy = await start_proxy(affinity="none", max_retries=1)
    await register(core, proxy, doomed, d1)
    reading = asyncio.create_task(stream(http, proxy, body(20, prompt_tokens=4000)))
    for _ in range(500):
        if await doomed.running(http):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the prefill leg never reached the doomed engine")
    await register(core, proxy, rescuer)
    await doomed.kill()
    request_id, text, errors = await asyncio.wait_for(reading, 30)
    assert errors == [] and text == "".join(filler_tokens(0, PROMPT, 20))
    return request_id

async def test_a_prefill_engine_killed_mid_request_is_retried_on_the_other(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    request_id = await _prefill_killed_mid_request("vllm", engines, core, start_proxy, http)
    await wait_for(lambda: len(legs(tap, request_id)) == 3, what="three attempts")
    (n0, killed), (n1, retried), (n2, decoded) = legs(tap, request_id)
    assert (n0, killed["role"], killed["outcome"], killed["next_attempt"]) == (
        "doomed", "prefill", "upstream_error", f"{request_id}.1")
    assert killed["error"].startswith("retried: ")
    assert (n1, retried["role"], retried["outcome"]) == ("rescuer", "prefill", "completed")
    assert (n2, decoded["request_id"], decoded["role"], decoded["outcome"]) == (
        "d1", f"{request_id}.2", "decode", "completed")


async def test_a_drained_prefill_node_is_drained_when_its_own_legs_end(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    """The core is fed the proxy's request events as they come: p1's drain ends with its prefill
    leg, while the decode leg of the same request still runs on d1."""
    p1, d1 = await engines("p1", "prefill"), await engines("d1", "decode")
    await p1.admin(http, slowdown=20.0)  # prefill ~2 s
    await d1.admin(http, slowdown=20.0)  # 60 tokens ~4 s
    proxy = await start_proxy(affinity="none")
    await register(core, proxy, p1, d1)
    relayed = 0
    drained_by: list[tuple[str, str | None]] = []  # the input on which p1 turned drained

    async def relay() -> None:
        nonlocal relayed
        while True:
            for subject, data in tap.messages[relayed:]:
                if subject.startswith((sj.REQ_STARTED + ".", sj.REQ_FINISHED + ".")):
                    before = core.core.state.nodes["p1"].phase
                    await core.send(subject, data)
                    if before != "drained" and core.core.state.nodes["p1"].phase == "drained":
                        drained_by.append((subject, data.get("role")))
                relayed += 1
            await asyncio.sleep(0.01)

    relaying = asyncio.create_task(relay())
    try:
        reading = asyncio.create_task(stream(http, proxy, body(60, prompt_tokens=4000)))
        nodes = core.core.state.nodes
        await wait_for(lambda: nodes["p1"].inflight == 1, timeout=10, what="the prefill leg open in the core")
        await core.send(sj.admin_drain("p1"), {})
        assert nodes["p1"].phase == "draining"
        await wait_for(lambda: nodes["p1"].phase == "drained", timeout=15, what="p1 drained")
        assert not reading.done()  # drained while its request still runs: the decode leg on d1
        await wait_for(lambda: bool(drained_by), what="the relay's record")
        assert drained_by == [(sj.req_finished("p1"), "prefill")]  # on its own last leg's end, not the pool's
        await wait_for(lambda: nodes["d1"].inflight == 1, timeout=10, what="the decode leg open in the core")
        assert nodes["p1"].phase == "drained" and not reading.done()
        request_id, text, errors = await asyncio.wait_for(reading, 30)
        assert errors == [] and text == "".join(filler_tokens(0, PROMPT, 60))
        await wait_for(lambda: nodes["d1"].inflight == 0, timeout=10, what="the decode leg finished in the core")
    finally:
        relaying.cancel()


async def test_sglang_pairs_run_both_legs_at_once_with_one_bootstrap_room(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    p1, p2 = await engines("p1", "prefill", "sglang"), await engines("p2", "prefill", "sglang")
    d1 = await engines("d1", "decode", "sglang")
    proxy = await start_proxy(affinity="none")
    await register(core, proxy, p1, p2, d1)
    expected = "".join(filler_tokens(0, PROMPT, 12))
    answers = await asyncio.gather(*(stream(http, proxy, body(12)) for _ in range(6)))
    assert [(text, errors) for _, text, errors in answers] == [(expected, [])] * 6
    prefill_nodes = set()
    for request_id, _, _ in answers:
        await wait_for(lambda rid=request_id: len(legs(tap, rid)) == 2, what=f"{request_id}'s two legs")
        by_role = {d["role"]: (node, d) for node, d in legs(tap, request_id)}
        (pnode, prefill), (dnode, decode) = by_role["prefill"], by_role["decode"]
        prefill_nodes.add(pnode)
        assert (prefill["request_id"], prefill["outcome"], prefill["next_attempt"], prefill["completion_tokens"]) == (
            request_id, "completed", None, 1)
        assert (dnode, decode["request_id"], decode["outcome"], decode["completion_tokens"]) == (
            "d1", f"{request_id}.1", "completed", 12)
    assert prefill_nodes == {"p1", "p2"}
    for engine in (p1, p2):
        assert (await engine.state(http))["bootstrap_rooms"] == 0  # every room's KV was taken, none left open


async def test_sglang_a_decode_killed_cancels_its_prefill_at_once_and_a_new_pair_answers(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    """The decode engine dies while its pair's prefill runs: the prefill leg (which would hold its
    room until --bootstrap-timeout-s, 30 s) is cancelled within 1 s, and a new pair answers."""
    p1 = await engines("p1", "prefill", "sglang")
    doomed, rescuer = await engines("doomed", "decode", "sglang"), await engines("rescuer", "decode", "sglang")
    await p1.admin(http, slowdown=50.0)  # its prefill of 4,000 tokens: ~5 s
    proxy = await start_proxy(affinity="none", max_retries=1)
    await register(core, proxy, p1, doomed)
    reading = asyncio.create_task(stream(http, proxy, body(20, prompt_tokens=4000)))
    await wait_for(lambda: bool(tap.of(sj.REQ_STARTED)) and len(tap.of(sj.REQ_STARTED)) == 2, what="both legs started")
    for _ in range(500):
        if (await p1.state(http))["bootstrap_rooms"] == 1:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the prefill leg never opened its room")
    await register(core, proxy, rescuer)
    await p1.admin(http, slowdown=1.0)  # the new pair's prefill at full speed
    await doomed.kill()
    killed = time.monotonic()
    request_id = tap.of(sj.REQ_STARTED)[0][1]["request_id"]
    await wait_for(lambda: any(d["request_id"] == request_id for _, d in legs(tap, request_id)), timeout=5,
                   what="the first prefill leg's end")
    assert time.monotonic() - killed < 1.0  # cancelled at once, not after the room's timeout
    _, text, errors = await asyncio.wait_for(reading, 30)
    assert errors == [] and text == "".join(filler_tokens(0, PROMPT, 20))
    await wait_for(lambda: len(legs(tap, request_id)) == 4, what="two pairs")
    attempts = {d["request_id"]: (node, d) for node, d in legs(tap, request_id)}
    node, first = attempts[request_id]
    assert (node, first["role"], first["outcome"]) == ("p1", "prefill", "upstream_error")
    assert first["error"].startswith("cancelled: its decode leg on doomed failed")
    node, broken = attempts[f"{request_id}.1"]
    assert (node, broken["role"], broken["outcome"], broken["next_attempt"]) == (
        "doomed", "decode", "upstream_error", f"{request_id}.2")
    assert [(n, d["role"], d["outcome"]) for n, d in (attempts[f"{request_id}.2"], attempts[f"{request_id}.3"])] == [
        ("p1", "prefill", "completed"), ("rescuer", "decode", "completed")]
    assert (await p1.state(http))["bootstrap_rooms"] == 0


async def test_sglang_a_prefill_killed_cancels_its_decode_and_a_new_pair_answers(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    request_id = await _prefill_killed_mid_request("sglang", engines, core, start_proxy, http)
    await wait_for(lambda: len(legs(tap, request_id)) == 4, what="two pairs")
    attempts = {d["request_id"]: (node, d) for node, d in legs(tap, request_id)}
    node, killed = attempts[request_id]
    assert (node, killed["role"], killed["outcome"]) == ("doomed", "prefill", "upstream_error")
    node, cancelled = attempts[f"{request_id}.1"]
    assert (node, cancelled["role"], cancelled["outcome"], cancelled["next_attempt"]) == (
        "d1", "decode", "upstream_error", f"{request_id}.2")
    # cancelled at once, or (both ending in the same turn) its bootstrap broke by its prefill's death
    assert cancelled["error"].startswith(("retried: cancelled: its prefill leg failed", "retried: HTTP 500 beside its "
                                          "failed prefill leg"))
    assert [(n, d["role"], d["outcome"]) for n, d in (attempts[f"{request_id}.2"], attempts[f"{request_id}.3"])] == [
        ("rescuer", "prefill", "completed"), ("d1", "decode", "completed")]  # d1 was not at fault: it serves again


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_a_decode_engine_killed_mid_stream_is_continued_on_a_new_pair(
        protocol: str, engines: StartEngine, core: CoreDriver, start_proxy: StartProxy,
        http: aiohttp.ClientSession, tap: EventTap) -> None:
    p1 = await engines("p1", "prefill", protocol)
    doomed, rescuer = await engines("doomed", "decode", protocol), await engines("rescuer", "decode", protocol)
    await doomed.admin(http, fail="stall_stream", cut_after=7)
    proxy = await start_proxy(affinity="none")
    await register(core, proxy, p1, doomed)
    seen: asyncio.Queue[int] = asyncio.Queue()
    reading = asyncio.create_task(stream(http, proxy, body(30), seen))
    while await asyncio.wait_for(seen.get(), 20) < 7:
        pass
    await register(core, proxy, rescuer)
    await doomed.kill()
    request_id, text, errors = await asyncio.wait_for(reading, 30)
    assert errors == [] and text == "".join(filler_tokens(0, PROMPT, 30))  # nothing lost, nothing twice
    await wait_for(lambda: len(legs(tap, request_id)) == 4, what="two pairs")
    attempts = {d["request_id"]: (node, d) for node, d in legs(tap, request_id)}
    node, broken = attempts[f"{request_id}.1"]
    assert (node, broken["role"], broken["outcome"], broken["next_attempt"], broken["completion_tokens"]) == (
        "doomed", "decode", "continued", f"{request_id}.2", 7)
    assert [(n, d["role"], d["outcome"]) for n, d in (attempts[f"{request_id}.2"], attempts[f"{request_id}.3"])] == [
        ("p1", "prefill", "completed"), ("rescuer", "decode", "completed")]
    assert attempts[f"{request_id}.3"][1]["completion_tokens"] == 23


async def test_a_short_prompt_goes_to_its_decode_node_alone(
        engines: StartEngine, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession,
        tap: EventTap) -> None:
    """--pd-decode-only-tokens 64: a ~10-token prompt is one attempt on the decode node (its
    engine prefills it), a ~370-token one a pair; both answers whole."""
    p1, d1 = await engines("p1", "prefill"), await engines("d1", "decode", "vllm", "--pd-local-prefill")
    proxy = await start_proxy(affinity="none", pd_decode_only_tokens=64)
    await register(core, proxy, p1, d1)
    short_id, short_text, short_errors = await stream(http, proxy, body(12))
    long_prompt = {**body(12), "prompt": PROMPT * 40}
    long_id, long_text, long_errors = await stream(http, proxy, long_prompt)
    assert (short_text, short_errors) == ("".join(filler_tokens(0, PROMPT, 12)), [])
    assert (long_text, long_errors) == ("".join(filler_tokens(0, PROMPT * 40, 12)), [])
    await wait_for(lambda: len(legs(tap, long_id)) == 2, what="the long request's two legs")
    assert [(node, d["request_id"], d["role"], d["outcome"]) for node, d in legs(tap, short_id)] == [
        ("d1", short_id, "decode", "completed")]
    assert [(node, d["role"]) for node, d in legs(tap, long_id)] == [("p1", "prefill"), ("d1", "decode")]
    assert proxy.state.router.table.load.own == {}  # the prefill admission given back for the short one
