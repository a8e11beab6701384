"""`laswrr up` on a prefill/decode pool, as an operator runs it: two sim-engine processes speaking
SGLang's protocol (the prefill one with its bootstrap port), a nodes.toml naming their roles, the
whole stack (NATS, scheduler, recorder, collector, proxy) routing pairs, then `laswrr report` and
`laswrr replay` on the recorded log."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from laswrr.services.nats_server import free_port
from laswrr.services.sim_engine.cli import LISTEN_PREFIX
from laswrr.services.sim_engine.openai_api import filler_tokens
from tests.up_process import finish, start_up

PROMPT = "Once upon a time, on an Ascend NPU,"


async def _engine(node: str, *flags: str) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr.services.sim_engine.cli", "sim-engine", "--port", "0", "--chip", "910B",
        "--capacity", "4", "--speed", "10", "--node-id", node, *flags,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
    assert line.startswith(LISTEN_PREFIX), line
    return process, line.removeprefix(LISTEN_PREFIX)


async def _completion(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    body = {"model": "sim-910B", "prompt": PROMPT, "max_tokens": 10, "stream": True}
    text = ""
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.text()
        async for line in resp.content:
            data = line.strip().removeprefix(b"data:").strip()
            if data.startswith(b"{"):
                text += "".join(c.get("text") or "" for c in json.loads(data).get("choices") or ())
    return 200, text


async def test_up_routes_an_sglang_pool_as_pairs(tmp_path: Path) -> None:
    port = free_port()
    engines = [await _engine("p1", "--pd-role", "prefill", "--pd-protocol", "sglang", "--bootstrap-port", str(port)),
               await _engine("d1", "--pd-role", "decode", "--pd-protocol", "sglang")]
    try:
        (p1, p1_url), (_, d1_url) = engines
        (tmp_path / "nodes.toml").write_text(
            f'[[node]]\nid = "p1"\nurl = "{p1_url}"\nchip = "910B"\ncapacity = 4\nrole = "prefill"\n'
            f'pd_protocol = "sglang"\nbootstrap_port = {port}\n\n'
            f'[[node]]\nid = "d1"\nurl = "{d1_url}"\nchip = "910B"\ncapacity = 4\nrole = "decode"\n'
            f'pd_protocol = "sglang"\n')
        data = tmp_path / "data"
        proc, banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(data),
                                      "--proxy-port", "0", "--dashboard-port", "0")
        url = banner["proxy URL"].split()[0]
        expected = "".join(filler_tokens(0, PROMPT, 10))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for _ in range(100):  # until the proxy holds a snapshot with both roles
                status, text = await _completion(http, url)
                if status != 503:
                    break
                await asyncio.sleep(0.2)
            assert (status, text) == (200, expected)
            answers = await asyncio.gather(*(_completion(http, url) for _ in range(4)))
        assert answers == [(200, expected)] * 4
        proc.send_signal(signal.SIGINT)
        code, _, err = await finish(proc)
        assert code == 0, err[-2000:]
    finally:
        for process, _ in engines:
            if process.returncode is None:
                process.kill()
                await process.wait()
    db = str(data / "events.duckdb")
    report = subprocess.run([sys.executable, "-m", "laswrr", "report", "--db", db, "--json"], capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    facts = json.loads(report.stdout)
    assert facts["zero_interruptions"] and facts["completed"] == 5 and facts["retried_attempts"] == 0
    assert facts["pd"] == {"pair_requests": 5, "decode_only_requests": 0, "prefill_legs": 5,
                           "prefill_legs_not_completed": 0, "decode_legs": 5, "decode_legs_not_completed": 0}
    replay = subprocess.run([sys.executable, "-m", "laswrr", "replay", "--db", db], capture_output=True, text=True,
                            timeout=120)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
