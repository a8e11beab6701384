"""`laswrr up` as an operator runs it, and ``Stack`` as the benchmark and demo drive it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import redact_url
from laswrr.services.nats_server import free_ports
from laswrr.services.up import (Stack, StackError, load_nodes, parse_nodes, render_nodes,
                         sim_npu_smi_command)
from tests.up_process import finish, no_leftover_stack, start_up

NODES = """
[[node]]
id = "n1"
url = "http://127.0.0.1:9"
chip = "910B"
capacity = 8
"""

# -- nodes.toml (pure) ----------------------------------------------------------------------------


def test_nodes_file_round_trips_and_keeps_collector_keys() -> None:
    nodes = [Node(id="a", url="http://h:1", pool="p", chip="910C", capacity=16, npu_smi='x --url "q"',
                  selector=ChipSelector(npu_ids=(0, 1)), extra={"npu_smi": 'x --url "q"', "npu_ids": [0, 1]}),
             Node(id="b", url="http://h:2", chip="unknown", capacity=8)]
    assert parse_nodes(tomllib.loads(render_nodes(nodes))) == nodes


def test_example_nodes_file_is_valid() -> None:
    nodes = load_nodes(Path(__file__).parents[2] / "nodes.example.toml")
    assert [n.chip for n in nodes] == ["910C", "910B", "910B", "910", "910C"]
    mindie = nodes[-1]
    assert mindie.status_url and mindie.npu_exporter  # the MindIE example names both Ascend sources


@pytest.mark.parametrize("text, message", [
    ("", "no [[node]] tables"),
    ('[[node]]\nid = "a"\nurl = "http://h"\n', "capacity must be an integer > 0"),
    ('[[node]]\nid = "a"\nurl = "http://h"\ncapacity = 0\n', "capacity must be an integer > 0"),
    ('[[node]]\nid = "a.b"\nurl = "http://h"\ncapacity = 1\n', "invalid node id"),
    ('[[node]]\nid = "a"\nurl = "h:1"\ncapacity = 1\n', "not an http(s) URL"),
    ('[[node]]\nid = "a"\nurl = "http://h"\ncapacity = 1\n[[node]]\nid = "a"\nurl = "http://g"\ncapacity = 2\n',
     "is defined twice"),
])
def test_bad_nodes_files_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(StackError, match=re.escape(message)):
        parse_nodes(tomllib.loads(text))


# -- laswrr up --------------------------------------------------------------------------------------


no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)


async def test_up_runs_the_stack_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    (tmp_path / "nodes.toml").write_text(NODES)
    proc, banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(tmp_path / "data"),
                                  "--proxy-port", "0", "--dashboard-port", "0")
    secrets = tmp_path / "data" / "secrets"
    nats_url = (secrets / "operator.env").read_text().strip().removeprefix("NATS_URL=")  # secure by default
    password = urlsplit(nats_url).password
    assert password and password not in banner["operator"] and password not in "".join(v for k, v in banner.items() if k != "operator URL")  # that one start_up read from the secrets file
    assert banner["operator"] == f"{redact_url(nats_url)}  (password in {secrets / 'operator.env'}: " \
                                 f"export $(cat {secrets / 'operator.env'}))"
    assert {p.name: p.stat().st_mode & 0o777 for p in secrets.glob("*.env")} == {
        f"{role}.env": 0o600 for role in ("operator", "scheduler", "proxy", "collector", "recorder", "viewer")}
    assert banner["proxy URL"].startswith("http://127.0.0.1:")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", banner["dashboard"])
    nc = await nats.connect(nats_url)
    kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
    snapshot = json.loads((await kv.get("default")).value)
    assert [n["node"] for n in snapshot["nodes"]] == ["n1"]  # registered before the banner
    await nc.close()
    proc.send_signal(signal.SIGINT)
    code, out, err = await finish(proc)
    assert code == 0, err[-2000:]
    assert out.rstrip().endswith("laswrr up: stopped")
    assert "exited unexpectedly" not in err and "killed" not in err


async def test_up_exits_non_zero_when_a_child_dies(tmp_path: Path, nats_url: str) -> None:
    (tmp_path / "nodes.toml").write_text(NODES)
    proc, banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(tmp_path / "data"),
                                  "--proxy-port", "0", "--dashboard-port", "0", "--nats-url", nats_url,
                                  "--max-restarts", "0")
    assert banner["NATS URL"].startswith(f"{nats_url}  (external")
    os.kill(int(banner["pid scheduler"]), signal.SIGKILL)
    code, _, err = await finish(proc)
    assert code == 1
    assert "scheduler (pid" in err and "exited unexpectedly with -9" in err


async def test_up_rejects_a_bad_nodes_file(tmp_path: Path) -> None:
    (tmp_path / "nodes.toml").write_text('[[node]]\nid = "a"\nurl = "http://h"\ncapacity = -1\n')
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "laswrr", "up", "--nodes",
                                                str(tmp_path / "nodes.toml"), stderr=asyncio.subprocess.PIPE)
    code, _, err = await finish(proc)
    assert code == 2 and err.count("\n") == 1 and "capacity must be an integer > 0" in err


async def test_stack_library_with_a_simulated_engine(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "data", proxy_port=0)
    try:
        await stack.start_nats()
        await stack.start_core()
        nodes = await stack.start_sim_engines([("sim-a", "910B", 4)], speed=20.0)
        assert nodes[0].url.startswith("http://127.0.0.1:") and nodes[0].extra["npu_smi"] == sim_npu_smi_command(nodes[0].url)
        await stack.register(nodes)  # returns once LB_WEIGHTS shows the node
        assert [n.id for n in stack.nodes] == ["sim-a"]
        path = stack.write_nodes_file(nodes)
        assert load_nodes(path) == nodes
    finally:
        await stack.stop()
    assert all(child.process.returncode is not None for child in stack.children)
    assert {c.role for c in stack.children} >= {"scheduler", "sim-engine"}
    assert stack.embedded is not None and stack.embedded.process is not None
    assert stack.embedded.process.poll() is not None


async def test_up_runs_proxy_workers_on_the_proxy_port(tmp_path: Path) -> None:
    import aiohttp

    (tmp_path / "nodes.toml").write_text(NODES)
    proc, banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(tmp_path / "data"),
                                  "--proxy-port", "0", "--dashboard-port", "0", "--proxy-workers", "2")
    url, _, rest = banner["proxy URL"].partition(" ")
    assert rest.startswith("(2 workers)")
    seen: set[str] = set()
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection each time: the kernel picks a worker
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as http:
        for _ in range(60):
            async with http.get(f"{url}/healthz") as response:
                seen.add((await response.json())["proxy"])
            if len(seen) == 2:
                break
    assert seen == {"proxy-0", "proxy-1"}
    proc.send_signal(signal.SIGINT)
    code, out, err = await finish(proc)
    assert code == 0, err[-2000:]
    assert "exited unexpectedly" not in err and "killed" not in err


async def test_up_asks_its_workers_on_the_admin_ports_it_was_given(tmp_path: Path) -> None:
    """``--proxy-arg admin-port=P`` moves each worker's probes to P + k: `up` waits for the proxy
    there (it asked the proxy port, which then serves no probe, for 10 s, and warned "not routing
    yet" of a proxy that routed)."""
    import aiohttp

    (tmp_path / "nodes.toml").write_text(NODES)
    admin = free_ports(2)
    proc, _banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(tmp_path / "data"),
                                   "--proxy-port", "0", "--dashboard-port", "0", "--proxy-workers", "2",
                                   "--proxy-arg", f"admin-port={admin}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for k in range(2):
            async with http.get(f"http://127.0.0.1:{admin + k}/healthz") as response:
                assert (await response.json())["proxy"] == f"proxy-{k}"
    proc.send_signal(signal.SIGINT)
    code, _out, err = await finish(proc)
    assert code == 0, err[-2000:]
    assert "not routing yet" not in err


async def test_up_holds_an_overload_by_default_instead_of_queueing_it_in_the_engine(tmp_path: Path) -> None:
    """Issue 41 item 4: `laswrr up` with no flag runs the proxy with flow control: requests beyond
    the engine's one slot wait in the proxy (its held-requests gauge), not in the engine's queue;
    the banner says so."""
    import aiohttp

    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "sim-engine", "--port", "0", "--capacity", "1", "--model", "m",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert engine.stdout is not None
        engine_url = (await asyncio.wait_for(engine.stdout.readline(), 30)).decode().split("listening on ")[1].strip()
        (tmp_path / "nodes.toml").write_text(f'[[node]]\nid = "n1"\nurl = "{engine_url}"\ncapacity = 1\n')
        proc, banner = await start_up("--nodes", str(tmp_path / "nodes.toml"), "--data-dir", str(tmp_path / "data"),
                                      "--proxy-port", "0", "--dashboard-port", "0")
        assert banner["flow control"].startswith("on: ") and "laswrr_proxy_queue_depth" in banner["flow control"]
        assert banner["API keys"].startswith("none")
        proxy = banner["proxy URL"].split()[0]
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            posts = [asyncio.create_task(http.post(f"{proxy}/v1/chat/completions", json=body)) for _ in range(3)]
            held = waiting = None
            for _ in range(100):  # until the proxy holds the two requests beyond the slot
                async with http.get(f"{proxy}/metrics") as response:
                    metrics = await response.text()
                held = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("laswrr_proxy_queue_depth{"))
                if held >= 2:
                    break
                await asyncio.sleep(0.1)
            async with http.get(f"{engine_url}/metrics") as response:
                waiting = sum(float(line.rsplit(" ", 1)[1]) for line in (await response.text()).splitlines()
                              if line.startswith("vllm:num_requests_waiting"))
            assert (held, waiting) == (2, 0)
            for post in posts:
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
        proc.send_signal(signal.SIGINT)
        code, _, err = await finish(proc)
        assert code == 0, err[-2000:]
    finally:
        engine.terminate()
        await engine.wait()


# -- a dashboard whose port is taken is said so, never listed as running ----------------


async def test_a_dashboard_on_a_taken_port_is_reported_not_listed_with_a_dead_pid(tmp_path: Path, nats_url: str) -> None:
    import io
    import socket

    from laswrr.services.up import banner

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    stack = Stack(tmp_path / "data", nats_url=nats_url, secure=False)
    try:
        with pytest.raises(StackError):
            await stack.start_dashboard(port)
        out = io.StringIO()
        banner(stack, out)
    finally:
        await stack.stop()
        taken.close()
    text = out.getvalue()
    assert "dashboard: NOT STARTED: dashboard exited with 1 before listening" in text, text
    assert "cannot listen on" in text and not re.search(r"^\s+\S+\s+dashboard\s+pid", text, re.M), text
    assert not [c for c in stack.children if c.name == "dashboard"]


async def test_the_dashboard_stops_with_the_stack(tmp_path: Path, nats_url: str) -> None:
    """``Stack.stop`` stops the dashboard too (its role, ``viewer``, was in no stop order: it
    outlived the stack until the process that ran the stack exited)."""
    stack = Stack(tmp_path / "data", nats_url=nats_url, secure=False)
    try:
        await stack.start_dashboard(0)
        board = next(c for c in stack.children if c.name == "dashboard")
        assert board.process.returncode is None
    finally:
        await stack.stop()
    assert board.process.returncode is not None


async def test_the_stack_starts_kv_events_only_for_nodes_that_publish_them(tmp_path: Path, eventually) -> None:
    """A node with ``kv_events`` makes the stack run ``laswrr kv-events``, with the collector's
    credentials (its role publishes ``lb.kv.>``); it connects and keeps running."""
    stack = Stack(tmp_path / "data", proxy_port=0)
    plain = Node(id="n1", url="http://127.0.0.1:9", chip="910B", capacity=8)
    events = Node(id="n2", url="http://127.0.0.1:9", chip="910B", capacity=8,
                  extra={"kv_events": "tcp://127.0.0.1:9"})
    try:
        await stack.start_nats()
        await stack.start_core()
        assert await stack.start_kv_events([plain]) is None
        child = await stack.start_kv_events([plain, events])
        assert child is not None and child.role == "collector"
        await stack.register([events])
        await eventually(lambda: "node n2: subscribed to tcp://127.0.0.1:9" in child.log_path.read_text()
                         or child.process.returncode is not None, timeout=30, what="kv-events subscribing to n2")
        log = child.log_path.read_text()
        assert child.process.returncode is None, log
        assert "to nats://collector:" in log and "node n2: subscribed to tcp://127.0.0.1:9" in log
    finally:
        await stack.stop()
    assert child.process.returncode is not None
