"""The simulated npu-smi (pure readings, table parsed by collectors.npu_smi) and the CLI
commands run as real subprocesses (`--port 0`, URL read from the first stdout line)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from laswrr.collectors.npu import NpuSmiError, run_npu_smi, split_command
from laswrr.collectors.npu_smi import parse_info
from laswrr.services.sim_engine import npu_smi
from laswrr.services.sim_engine.app import RunningServer
from laswrr.services.sim_engine.cli import LISTEN_PREFIX
from laswrr.services.sim_engine.profiles import get_profile
from laswrr.services.up import sim_npu_smi_command

StartEngine = Callable[..., Awaitable[RunningServer]]
CLI = [sys.executable, "-m", "laswrr.services.sim_engine.cli"]


def test_readings_follow_the_batch_and_preallocation() -> None:
    p = get_profile("910B")
    idle, half, full = (npu_smi.readings(p, n, 8, True) for n in (0, 4, 8))
    assert (idle.aicore_pct, half.aicore_pct, full.aicore_pct) == (0, 25, 40)
    assert idle.hbm_used_mb == full.hbm_used_mb and 0.9 <= idle.hbm_used_mb / idle.hbm_total_mb < 0.96
    assert idle.power_w < half.power_w < full.power_w and idle.temp_c < full.temp_c
    down = npu_smi.readings(p, 0, 8, False)
    assert down.hbm_used_mb < 4000 and down.aicore_pct == 0


def _state(chip: str, running: int, health: str = "OK") -> dict[str, object]:
    p = get_profile(chip)
    r = npu_smi.readings(p, running, 8, True)
    return {"health": health, "npu": {"name": p.npu_name, "chips": p.chips_per_npu, "aicore_pct": r.aicore_pct,
                                      "hbm_used_mb": r.hbm_used_mb, "hbm_total_mb": r.hbm_total_mb,
                                      "power_w": r.power_w, "temp_c": r.temp_c}}


def test_rendered_table_matches_real_layout_and_parses() -> None:
    text = npu_smi.render(_state("910B", 8, "Warning"), npu_id=3)
    lines = text.splitlines()
    assert {len(line) for line in lines} == {98}  # the real 910B column layout
    assert lines[3] == ("| NPU   Name                | Health        | Power(W)    Temp(C)"
                        "           Hugepages-Usage(page)|")
    (chip,) = parse_info(text)
    assert (chip.npu_id, chip.chip_id, chip.name, chip.health) == (3, 0, "910B3", "Warning")
    assert chip.aicore_util == pytest.approx(0.40)
    assert chip.hbm_total_mb == 65536 and chip.hbm_used_mb is not None and chip.hbm_used_mb > 58000
    assert chip.power_w == pytest.approx(165.0)


def test_910c_npu_has_two_chips() -> None:
    chips = parse_info(npu_smi.render(_state("910C", 0)))
    assert [(c.chip_id, c.name) for c in chips] == [(0, "Ascend910"), (1, "Ascend910")]
    assert chips[0].power_w is not None and chips[1].power_w is None


async def test_sim_state_and_npu_smi_command_show_load(start_engine: StartEngine,
                                                       http: aiohttp.ClientSession) -> None:
    server = await start_engine(capacity=2)
    body = {"prompt": "x", "max_tokens": 100_000}
    hogs = [asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body)) for _ in range(2)]
    for _ in range(100):
        async with http.get(f"{server.url}/sim/state") as r:
            st = await r.json()
        if st["running"] == 2:
            break
        await asyncio.sleep(0.02)
    assert st["npu"]["aicore_pct"] == 40
    await http.post(f"{server.url}/admin", json={"health": "Alarm"})
    proc = await asyncio.create_subprocess_exec(*CLI, "sim-npu-smi", "--url", server.url, "--npu-id", "5",
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    (chip,) = parse_info(out.decode())
    assert (chip.npu_id, chip.health, chip.aicore_util) == (5, "Alarm", pytest.approx(0.4))
    for hog in hogs:
        hog.cancel()
    await asyncio.gather(*hogs, return_exceptions=True)


async def test_sim_npu_smi_endpoint_parses_and_survives_refuse(start_engine: StartEngine,
                                                                 http: aiohttp.ClientSession) -> None:
    server = await start_engine(chip="910C")
    async with http.get(f"{server.url}/sim/npu-smi") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        chips = parse_info(await r.text())
    assert [(c.npu_id, c.chip_id, c.health) for c in chips] == [(0, 0, "OK"), (0, 1, "OK")]
    up_hbm = chips[0].hbm_used_mb
    assert up_hbm is not None and up_hbm > 0.9 * chips[0].hbm_total_mb  # pre-allocated by the engine
    async with http.post(f"{server.url}/admin", json={"health": "Critical", "fail": "refuse"}) as r:
        assert r.status == 200
    with pytest.raises(aiohttp.ClientError):  # the engine is down ...
        async with http.get(f"{server.url}/v1/models") as r:
            await r.read()
    async with http.get(f"{server.url}/sim/npu-smi") as r:  # ... its NPU still answers npu-smi
        assert r.status == 200
        chips = parse_info(await r.text())
    assert {c.health for c in chips} == {"Critical"}
    assert chips[0].hbm_used_mb is not None and chips[0].hbm_used_mb < 4000  # nothing allocated: the floor
    await http.post(f"{server.url}/admin", json={"health": "OK", "fail": "none"})
    async with http.get(f"{server.url}/sim/npu-smi") as r:
        assert {c.health for c in parse_info(await r.text())} == {"OK"}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
async def test_sampling_command_line_runs_as_the_collector_runs_it(start_engine: StartEngine,
                                                                    http: aiohttp.ClientSession) -> None:
    server = await start_engine()
    await http.post(f"{server.url}/admin", json={"health": "Warning"})
    command = sim_npu_smi_command(server.url + "/")
    assert command.startswith("curl ")
    chips = await run_npu_smi(split_command(command), timeout_s=10)
    assert [(c.name, c.health) for c in chips] == [("910B3", "Warning")]
    with pytest.raises(NpuSmiError):  # no engine there: curl fails, the collector counts an error
        await run_npu_smi(split_command(sim_npu_smi_command("http://127.0.0.1:1")), timeout_s=10)


def test_npu_smi_command_fails_cleanly_without_engine() -> None:
    proc = subprocess.run([*CLI, "sim-npu-smi", "--url", "http://127.0.0.1:1"], capture_output=True, text=True,
                          timeout=20)
    assert proc.returncode == 1
    assert "cannot read engine state" in proc.stderr and proc.stdout == ""


@pytest.fixture
async def engine_process() -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "sim-engine", "--port", "0", "--chip", "910C", "--capacity", "4", "--speed", "20",
        "--node-id", "proc-1", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
    assert line.startswith(LISTEN_PREFIX), line
    yield proc, line.removeprefix(LISTEN_PREFIX)
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_engine_subprocess_prints_url_and_serves(engine_process: tuple[asyncio.subprocess.Process, str],
                                                       http: aiohttp.ClientSession) -> None:
    proc, url = engine_process
    async with http.post(f"{url}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) as r:
        assert r.status == 200 and r.headers["x-sim-node"] == "proc-1"
        assert (await r.json())["model"] == "sim-910C"
    proc.terminate()
    assert await asyncio.wait_for(proc.wait(), 10) == 0  # SIGTERM = clean shutdown


def test_bad_engine_options_exit_2() -> None:
    proc = subprocess.run([*CLI, "sim-engine", "--port", "0", "--speed", "0"], capture_output=True, text=True,
                          timeout=20)
    assert proc.returncode == 2 and "--speed must be > 0" in proc.stderr


def test_registered_with_the_laswrr_dispatcher() -> None:
    from laswrr.cli import COMMAND_MODULES

    assert "laswrr.services.sim_engine.cli" in COMMAND_MODULES
