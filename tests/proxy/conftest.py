"""Fixtures for the proxy tests (helpers and the echo engine live in ``proxy_support``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import pytest

from proxy_support import CoreDriver, EchoEngine, EventTap, StartProxy
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.proxy.app import RunningProxy, start
from laswrr.services.proxy.config import ProxyConfig


@pytest.fixture
def engines(closing: AsyncExitStack) -> Callable[..., Awaitable[EchoEngine]]:
    """Factory: ``await engines("a", ...)`` -> a running echo engine, stopped after the test."""

    async def _start(name: str, **kw: Any) -> EchoEngine:
        engine = await EchoEngine(name=name, **kw).start()
        closing.push_async_callback(engine.stop)
        return engine

    return _start


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Any]:
    client = await connect(nats_url, "proxy-test")
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


@pytest.fixture
async def core(nc: Any) -> CoreDriver:
    return CoreDriver(await nc.jetstream().key_value(sj.WEIGHTS_BUCKET))


@pytest.fixture
async def start_proxy(nats_url: str, nc: Any) -> AsyncIterator[StartProxy]:
    """``await start_proxy(max_retries=1, ...)`` -> a running proxy, stopped after the test."""
    running: list[RunningProxy] = []
    base = ProxyConfig(nats_url=nats_url, host="127.0.0.1", port=0, proxy_id="test-proxy", grace_s=5.0,
                       heartbeat_s=0.5, connect_timeout_s=1.0)

    async def _start(**overrides: Any) -> RunningProxy:
        proxy = await start(replace(base, **overrides))
        running.append(proxy)
        return proxy

    yield _start
    for proxy in running:
        if not proxy.state.stopping:
            await proxy.stop()


@pytest.fixture
async def tap(nc: Any) -> AsyncIterator[EventTap]:
    tapped = await EventTap().start(nc.jetstream())
    yield tapped
    await tapped.sub.unsubscribe()
