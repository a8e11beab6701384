"""Scenario actions: the true capacity they define, and the runner applying them to a real sim engine
(the health action reaches the engine's npu-smi, exactly what the collector samples)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest

from laswrr.bench.runner import SnapshotWatch, apply_action, run_timeline
from laswrr.bench.scenarios import CRASH_RETURN, Action, Scenario, true_capacity_changes
from laswrr.collectors.npu_smi import parse_info
from laswrr.services.sim_engine.app import RunningServer, start_server
from laswrr.services.sim_engine.config import SimConfig


def _scenario(*actions: Action) -> Scenario:
    return replace(CRASH_RETURN, actions=actions)  # 4×910B of 10 slots


def test_crash_return_is_npu_critical_with_refuse_then_ok_with_none() -> None:
    kinds = {(a.at_s, a.kind, a.node, a.value) for a in CRASH_RETURN.actions}
    assert kinds == {(14.0, "health", "n4", "Critical"), (14.0, "fail", "n4", "refuse"),
                     (28.0, "health", "n4", "OK"), (28.0, "fail", "n4", "none")}
    # Critical and refuse together are one step to 0, not two; OK and none together one step back
    assert true_capacity_changes(CRASH_RETURN) == [(14.0, "n4", 0.0), (28.0, "n4", 10.0)]
    capacity_at = CRASH_RETURN.capacity_at()
    assert (capacity_at("n4", 13.9), capacity_at("n4", 20.0), capacity_at("n4", 30.0)) == (10.0, 0.0, 10.0)


def test_critical_health_alone_or_overlapping_a_refuse_means_no_capacity() -> None:
    actions = (Action(1.0, "health", "n1", "Critical"), Action(2.0, "fail", "n1", "refuse"),
               Action(3.0, "fail", "n1", "none"),  # still Critical: still 0
               Action(4.0, "health", "n1", "Warning"),  # a minor alarm: the chip serves
               Action(5.0, "capacity", "n1", 4), Action(6.0, "health", "n1", "Alarm"))
    assert true_capacity_changes(_scenario(*actions)) == [(1.0, "n1", 0.0), (4.0, "n1", 10.0), (5.0, "n1", 4.0)]
    # the capacity set while Critical is the one it comes back with
    actions = (Action(1.0, "health", "n2", "Critical"), Action(2.0, "capacity", "n2", 3),
               Action(3.0, "health", "n2", "OK"))
    assert true_capacity_changes(_scenario(*actions)) == [(1.0, "n2", 0.0), (3.0, "n2", 3.0)]


@pytest.mark.parametrize("kind, value, message", [
    ("health", "Broken", "health action value must be one of OK, Warning, Alarm, Critical"),
    ("reboot", 1, "action kind must be one of capacity, slowdown, fail, health"),
])
def test_bad_action_is_refused_clearly(kind: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Action(1.0, kind, "n1", value)  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[RunningServer]:
    server = await start_server(SimConfig(chip="910B", capacity=4, port=0, speed=20.0, node_id="n4"))
    yield server
    await server.close()


async def _npu_health(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(f"{url}/sim/npu-smi") as resp:
        assert resp.status == 200
        return {chip.health for chip in parse_info(await resp.text())}


async def _serves(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(f"{url}/v1/models") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_health_action_sets_what_npu_smi_shows(engine: RunningServer) -> None:
    async with aiohttp.ClientSession() as http:
        await apply_action(Action(0.0, "health", "n4", "Alarm"), {"n4": engine.url}, http, SnapshotWatch())
        assert await _npu_health(http, engine.url) == {"Alarm"}


async def test_crash_return_timeline_on_a_real_engine(engine: RunningServer) -> None:
    scaled = CRASH_RETURN.scaled(0.005)  # 14 s, 28 s -> 70 ms, 140 ms
    async with aiohttp.ClientSession() as http:
        t0 = asyncio.get_running_loop().time()
        crash = [a for a in scaled.actions if a.at_s < 0.1]
        done = await run_timeline(crash, t0, {"n4": engine.url}, http, SnapshotWatch())
        assert [label for _, label in done] == ["n4 NPU Critical", "n4 crashes (refuse)"]
        assert await _npu_health(http, engine.url) == {"Critical"} and not await _serves(http, engine.url)
        back = [a for a in scaled.actions if a.at_s >= 0.1]
        done = await run_timeline(back, t0, {"n4": engine.url}, http, SnapshotWatch())
        assert all(t >= 0.14 for t, _ in done)
        assert await _npu_health(http, engine.url) == {"OK"} and await _serves(http, engine.url)
