"""The sim-engine honours a router's continuation of a broken stream, and its mid-stream faults.

A continuation sends the text generated so far back as context (completions: appended to the
prompt; chat: a final assistant message with ``continue_final_message: true`` and
``add_generation_prompt: false``); the engine's words after it are those an unbroken run would
have produced next, and the token counts add up. Real HTTP against a real engine on a free port.
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from laswrr.services.sim_engine.app import RunningServer
from laswrr.services.sim_engine.openai_api import FILLER_WORDS, filler_tokens
from tests.sim_engine.conftest import MakeClient, StartEngine
from tests.sim_engine.test_sim_admin import admin, wait_state

MODEL = "sim-910B"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about NPUs"}]


def test_words_continue_their_own_context() -> None:
    whole = filler_tokens(7, "a prompt", 30)
    for k in (1, 5, 29):
        assert filler_tokens(7, "a prompt" + "".join(whole[:k]), 30 - k) == whole[k:]
    assert filler_tokens(8, "a prompt", 30) != whole  # the seed matters
    assert all(len(w) == 4 for w in FILLER_WORDS for w in [w + " "])  # one estimated token per word


async def test_completion_continuation_adds_up(make_client: MakeClient, engine: RunningServer) -> None:
    oai = make_client(engine)
    whole = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20)
    head = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    text = head.choices[0].text
    rest = await oai.completions.create(model=MODEL, prompt="Once upon a time" + text, max_tokens=12)
    assert text + rest.choices[0].text == whole.choices[0].text
    assert whole.usage is not None and rest.usage is not None
    assert rest.usage.prompt_tokens == whole.usage.prompt_tokens + 8
    assert rest.usage.completion_tokens == 12


async def test_chat_continue_final_message_adds_up(make_client: MakeClient, engine: RunningServer) -> None:
    oai = make_client(engine)
    whole = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)  # type: ignore[arg-type]
    full = whole.choices[0].message.content or ""
    words = full.split(" ")
    head = " ".join(words[:5]) + " "
    rest = await oai.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": head}], max_tokens=15,  # type: ignore[list-item]
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert head + (rest.choices[0].message.content or "") == full
    assert whole.usage is not None and rest.usage is not None
    assert rest.usage.prompt_tokens == whole.usage.prompt_tokens + 5


@pytest.mark.parametrize("extra, message", [
    ({"continue_final_message": True}, "Cannot set both"),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": False}, "final assistant message"),
])
async def test_bad_continuation_options_are_400(engine: RunningServer, http: aiohttp.ClientSession,
                                                 extra: dict[str, object], message: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **extra}
    async with http.post(f"{engine.url}/v1/chat/completions", json=body) as r:
        assert r.status == 400
        assert message in (await r.json())["error"]["message"]


async def test_stall_stream_holds_the_connection_after_k_tokens(engine: RunningServer,
                                                                 http: aiohttp.ClientSession) -> None:
    await admin(http, engine, fail="stall_stream", cut_after=3)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
    async with http.post(f"{engine.url}/v1/completions", json=body) as r:
        got = b""
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(1.0):
                async for chunk in r.content.iter_any():
                    got += chunk
        assert got.count(b"data: ") == 3 and not r.content.at_eof()


async def test_refuse_resets_the_streams_in_flight(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{engine.url}/v1/completions", json=body) as r:
            first = await r.content.readany()
            assert first.startswith(b"data: ")
            await admin(http, engine, fail="refuse")
            async for _ in r.content.iter_any():
                pass
    await wait_state(http, engine, lambda s: s["running"] == 0)


async def test_openai_client_sees_a_reset_stream_as_an_error(make_client: MakeClient,
                                                             start_engine: StartEngine) -> None:
    engine = await start_engine(speed=2.0)
    oai = make_client(engine)
    stream = await oai.completions.create(model=MODEL, prompt="x", max_tokens=400, stream=True)
    async with aiohttp.ClientSession() as http:
        with pytest.raises((openai.APIError, aiohttp.ClientPayloadError, openai.APIConnectionError)):
            async for _ in stream:
                await admin(http, engine, fail="refuse")
