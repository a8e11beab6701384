"""compose.yaml's services, run as local processes, work together (no Docker engine needed).

``deploy/compose_local.py`` starts every service of ``docker compose --profile sim up`` as its
own process: a real nats-server for ``nats``, the two scheduler replicas, the recorder, the
collector, the one-shot ``register``, both proxies and the four simulated engines, each with the
file's command, environment, volumes and health checks translated to free local ports. Then:

1. a streamed chat completion through proxy-a comes back as SSE with ``x-laswrr-node``;
2. ``lb.admin.capacity.sim-910b-1 {"capacity": 0}`` published like ``nats pub`` (plain JSON,
   core NATS) makes ``laswrr nodes --json`` show the node not routable, both proxies drop it, and
   new requests through either proxy avoid it;
3. on ``down`` every service stops cleanly (exit 0), and the recorder's volume holds the DuckDB
   log with the capacity event in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import nats

from deploy.compose_local import COMPOSE_FILE, LocalStack
from laswrr.services.accounts import ROLES

PASSWORDS = {f"LASWRR_NATS_PASSWORD_{role.upper()}": f"{role}-{os.getpid()}-secret" for role in ROLES}
NODES = {"sim-910c", "sim-910b-1", "sim-910b-2", "sim-910"}
DRAINED = "sim-910b-1"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def routable(proxy: str) -> set[str]:
    pools = get_json(f"{proxy}/healthz")["pools"]
    return set(pools["default"]["routable"]) if "default" in pools else set()


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stream_chat(proxy: str, text: str) -> tuple[str, list[str]]:
    """POST a streamed chat completion; (x-laswrr-node, SSE data lines)."""
    body = json.dumps({"model": "sim-llm", "stream": True, "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(f"{proxy}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        node = response.headers["x-laswrr-node"]
        lines = [line.decode().strip() for line in response]
    return node, [line[len("data: "):] for line in lines if line.startswith("data: ")]


def laswrr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "laswrr", *args], capture_output=True, text=True, timeout=20)


async def nats_pub(url: str, subject: str, payload: bytes) -> None:
    """What `nats pub SUBJECT PAYLOAD` does: a core publish, no headers."""
    nc = await nats.connect(url)
    try:
        await nc.publish(subject, payload)
        await nc.flush()
    finally:
        await nc.close()


def node_views(nats_url: str) -> dict[str, dict[str, Any]]:
    result = laswrr("nodes", "--json", "--nats-url", nats_url)
    assert result.returncode == 0, result.stderr
    return {view["node"]: view for view in json.loads(result.stdout)["pools"]["default"]["nodes"]}


def test_compose_services_route_a_stream_and_follow_a_capacity_drop(tmp_path: Path) -> None:
    env = {**os.environ, "SIM_SPEED": "20", **PASSWORDS}
    stack = LocalStack.from_file(COMPOSE_FILE, tmp_path, profiles=["sim"], env=env)
    assert set(stack.instances) == {"nats", "scheduler-a", "scheduler-b", "recorder", "collector", "register",
                                    "proxy-a", "proxy-b"} | NODES
    stack.up(timeout_s=90)  # a bound for a loaded machine, not a speed goal; every health check passed, `register` exited 0
    try:
        nats_url = stack.env_of("register")["NATS_URL"]  # the operator's (register's) credentials
        assert nats_url == f"nats://operator:{PASSWORDS['LASWRR_NATS_PASSWORD_OPERATOR']}@127.0.0.1:{stack.port('nats', 4222)}"
        proxies = [stack.url("proxy-a", 8000), stack.url("proxy-b", 8000)]
        wait_until(lambda: all(routable(p) == NODES for p in proxies), 10, "both proxies to route to 4 nodes")

        node, events = stream_chat(proxies[0], "hello")
        assert node in NODES
        assert events[-1] == "[DONE]" and len(events) >= 3
        assert json.loads(events[0])["object"] == "chat.completion.chunk"

        asyncio.run(nats_pub(nats_url, f"lb.admin.capacity.{DRAINED}", b'{"capacity": 0}'))
        wait_until(lambda: not node_views(nats_url)[DRAINED]["routable"], 5, "the scheduler to drain the node")
        views = node_views(nats_url)
        assert views[DRAINED]["capacity"] == 0 and views[DRAINED]["phase"] in ("draining", "drained")
        assert all(views[n]["routable"] for n in NODES - {DRAINED})
        wait_until(lambda: all(routable(p) == NODES - {DRAINED} for p in proxies), 5, "the proxies to drop it")

        served = Counter(stream_chat(proxies[i % 2], f"after {i}")[0] for i in range(12))
        assert DRAINED not in served and sum(served.values()) == 12
        assert len(served) >= 2, served  # still balanced over the others
        assert stack.unexpected_exits() == {}
    finally:
        codes = stack.down()
    assert codes == dict.fromkeys(stack.instances, 0), "every service stops cleanly on SIGTERM"

    database = tmp_path / "volumes" / "recorder-data" / "events.duckdb"
    with duckdb.connect(str(database), read_only=True) as db:
        (capacity_events,) = db.execute("SELECT count(*) FROM events WHERE subject = ?",
                                        [f"lb.admin.capacity.{DRAINED}"]).fetchone()
        (registrations,) = db.execute("SELECT count(DISTINCT subject) FROM events "
                                      "WHERE subject LIKE 'lb.admin.node.%'").fetchone()
    assert capacity_events == 1 and registrations == len(NODES)
