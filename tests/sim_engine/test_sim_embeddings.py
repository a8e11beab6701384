"""The simulated engine's /v1/embeddings and /v1/responses: shapes, determinism, bad input."""

from __future__ import annotations

import aiohttp
import pytest

from laswrr.services.sim_engine.app import RunningServer
from laswrr.services.sim_engine.embeddings import parse_embedding_request, vector
from laswrr.services.sim_engine.openai_api import ApiError


def test_same_text_same_unit_vector() -> None:
    a, b = vector(0, "hello", 8), vector(0, "hello", 8)
    assert a == b and vector(0, "other", 8) != a and vector(1, "hello", 8) != a
    assert abs(sum(v * v for v in a) - 1.0) < 1e-9


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": [1.5]}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
])
def test_bad_embedding_requests_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_embedding_request(body, "m")
    assert caught.value.status == 400 and caught.value.param == param


async def test_embeddings_as_floats_and_token_ids(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-910B", "input": [[1, 2, 3], "abcdefgh"], "dimensions": 4, "encoding_format": "float"}
    async with http.post(engine.url + "/v1/embeddings", json=body) as response:
        answer = await response.json()
    assert response.status == 200 and response.headers["x-sim-node"] == "node-a"
    assert [len(d["embedding"]) for d in answer["data"]] == [4, 4]
    assert answer["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    async with http.post(engine.url + "/v1/embeddings", json=dict(body, model="other")) as response:
        assert response.status == 404


async def test_responses_answer_and_bad_input(engine: RunningServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-910B", "instructions": "be short", "max_output_tokens": 4,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    async with http.post(engine.url + "/v1/responses", json=body) as response:
        answer = await response.json()
    assert answer["object"] == "response" and answer["status"] == "incomplete"
    assert len(answer["output"][0]["content"][0]["text"].split()) == 4
    async with http.post(engine.url + "/v1/responses", json={"model": "sim-910B", "input": 3}) as response:
        assert response.status == 400 and (await response.json())["error"]["param"] == "input"
