"""Fixtures: the sim engine the root conftest's ``start_engine`` starts in these tests (FAST) and
official OpenAI clients (the HTTP session is the root conftest's)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import openai
import pytest

from laswrr.services.sim_engine.app import RunningServer
from laswrr.services.sim_engine.config import SimConfig

FAST = SimConfig(chip="910B", capacity=4, port=0, speed=20.0, node_id="node-a")

StartEngine = Callable[..., Awaitable[RunningServer]]  # the root conftest's start_engine


@pytest.fixture
def sim_config() -> SimConfig:
    return FAST


@pytest.fixture
async def engine(start_engine: StartEngine) -> RunningServer:
    return await start_engine()


MakeClient = Callable[[RunningServer], openai.AsyncOpenAI]


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Factory of official OpenAI clients for a server (closed after the test)."""
    clients: list[openai.AsyncOpenAI] = []

    def _make(server: RunningServer) -> openai.AsyncOpenAI:
        oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10)
        clients.append(oai)
        return oai

    yield _make
    for oai in clients:
        await oai.close()
