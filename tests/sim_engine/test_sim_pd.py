"""The sim engine plays vLLM's prefill/decode protocol (--pd-role): a prefill instance answers a
do_remote_decode request with one token and kv_transfer_params; a decode instance refuses a
request without them, and decodes one with them without prefilling it. Real HTTP on free ports,
the proxy's own leg bodies (scheduler/routing/pd.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from laswrr.scheduler.routing import pd
from laswrr.services.sim_engine.openai_api import filler_tokens
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile
from tests.sim_engine.conftest import StartEngine

BODY = {"model": "sim-910B", "prompt": "a long shared system prompt " * 40, "max_tokens": 12, "stream": True}


async def _post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    async with http.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


async def test_a_prefill_then_a_decode_leg_make_the_whole_answer(start_engine: StartEngine,
                                                                  http: aiohttp.ClientSession) -> None:
    prefill = await start_engine(pd_role="prefill", node_id="p1")
    decode = await start_engine(pd_role="decode", node_id="d1")
    raw = json.dumps(BODY).encode()
    status, refused = await _post(http, decode.url, raw)  # no KV params: a decode instance cannot serve it
    assert status == 400 and json.loads(refused)["error"]["code"] == "kv_transfer_params_missing"
    status, answer = await _post(http, prefill.url, pd.prefill_body(raw))
    assert status == 200
    first = json.loads(answer)
    assert first["usage"]["completion_tokens"] == 1
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "p1"
    status, stream = await _post(http, decode.url, pd.decode_body(raw, pd.kv_transfer_params(answer)))
    assert status == 200
    events = [json.loads(line[6:]) for line in stream.decode().splitlines()
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == "".join(filler_tokens(0, BODY["prompt"], 12))  # type: ignore[arg-type]
    async with http.get(f"{decode.url}/sim/state") as r:
        state = await r.json()
    assert state["pd_role"] == "decode" and state["requests_finished"] == 1
    # a prefill instance still serves a whole request (vLLM's kv_producer does)
    status, whole = await _post(http, prefill.url, json.dumps({**BODY, "stream": False}).encode())
    assert status == 200 and "kv_transfer_params" not in json.loads(whole)


def test_decode_skips_the_prefill_it_received() -> None:
    """A decode instance's request holds its prompt's KV but its first step computes no prefill."""
    both, received = EngineSim(get_profile("910B"), capacity=4), EngineSim(get_profile("910B"), capacity=4)
    whole = both.submit(4000, 4, 0.0)
    decoded = received.submit(4000, 4, 0.0, kv_received=True)
    both.advance(100.0)
    received.advance(100.0)
    assert whole.first_token_at is not None and decoded.first_token_at is not None
    prefill_s = 4000 / both.params.prefill_tokens_per_s / both.profile.prefill_speed
    assert whole.first_token_at - decoded.first_token_at > 0.9 * prefill_s > 0


async def test_sglang_legs_meet_in_their_bootstrap_room_and_fail_when_the_other_cannot_come(
        start_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    """--pd-protocol sglang: one body with bootstrap_host/port/room to both; the decode pulls the
    KV from the prefill's bootstrap port; either side fails (bounded) when its counterpart never comes."""
    from laswrr.services.nats_server import free_port
    port = free_port()
    prefill = await start_engine(pd_role="prefill", pd_protocol="sglang", bootstrap_port=port, node_id="p1",
                                 bootstrap_timeout_s=0.5)
    decode = await start_engine(pd_role="decode", pd_protocol="sglang", node_id="d1", bootstrap_timeout_s=0.5)
    raw = json.dumps(BODY).encode()
    status, refused = await _post(http, decode.url, raw)
    assert status == 400 and json.loads(refused)["error"]["code"] == "bootstrap_missing"
    status, refused = await _post(http, prefill.url, raw)
    assert status == 400 and json.loads(refused)["error"]["code"] == "bootstrap_room_missing"
    paired = pd.sglang_body(raw, "127.0.0.1", port, 42)
    (p_status, p_answer), (d_status, d_answer) = await asyncio.gather(_post(http, prefill.url, paired),
                                                                       _post(http, decode.url, paired))
    assert (p_status, d_status) == (200, 200)
    assert json.loads(p_answer)["usage"]["completion_tokens"] == 1
    text = "".join(json.loads(line[5:])["choices"][0]["text"] for line in d_answer.decode().split("\n\n")
                   if line.startswith("data: {"))
    assert text == "".join(filler_tokens(0, BODY["prompt"], 12))
    status, lonely = await _post(http, decode.url, pd.sglang_body(raw, "127.0.0.1", port, 43))  # no prefill comes
    assert status == 500 and json.loads(lonely)["error"]["code"] == "bootstrap_failed"
    status, abandoned = await _post(http, prefill.url, pd.sglang_body(raw, "127.0.0.1", port, 44))  # no decode comes
    assert status == 500 and json.loads(abandoned)["error"]["code"] == "bootstrap_timeout"
    status, used = await _post(http, prefill.url, paired)  # a room serves one pair
    assert status == 400 and json.loads(used)["error"]["code"] == "bootstrap_room_used"
    async with http.get(prefill.url + "/sim/state") as resp:
        assert (await resp.json())["bootstrap_rooms"] == 0
