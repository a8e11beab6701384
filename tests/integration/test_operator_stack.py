"""What an operator meets on a real `laswrr up` (README, "Operators"; docs/security.md): one stack of
real processes (embedded nats-server with a user per role, scheduler, recorder, collector, proxy,
dashboard, four simulated engines), driven by the `laswrr` commands as an operator types them and
by plain-JSON publishes as the stock `nats` CLI sends them."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import nats
import pytest

from laswrr.schemas import subjects as sj

LONG_ID = "sim-910b-2-replacement-in-rack-17-slot-3"  # wider than any column at 80 characters


@dataclass
class Up:
    proc: subprocess.Popen[str]
    data: Path
    banner: str
    lines: dict[str, str]
    nodes: dict[str, str]  # id -> url

    def url(self, role: str) -> str:
        return (self.data / "secrets" / f"{role}.env").read_text().strip().removeprefix("NATS_URL=")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    data = tmp_path_factory.mktemp("up") / "data"
    err = open(data.parent / "up.stderr", "w")
    proc = subprocess.Popen([sys.executable, "-m", "laswrr", "up", "--data-dir", str(data), "--proxy-port", "0",
                             "--dashboard-port", "0", "--sim-speed", "20"],
                            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        text, lines, nodes = "", {}, {}
        deadline = time.monotonic() + 90
        while "Ctrl-C" not in text:
            assert time.monotonic() < deadline, text
            line = proc.stdout.readline()
            assert line, f"laswrr up exited: {(data.parent / 'up.stderr').read_text()[-2000:]}"
            text += line
            key, _, value = line.strip().partition(": ")
            if value:
                lines.setdefault(key, value.strip())
            parts = line.split()
            if parts[:1] == ["node"]:
                nodes[parts[1]] = parts[-1]
        yield Up(proc, data, text, lines, nodes)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()


def laswrr(*args: str, url: str, timeout: float = 90, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "laswrr", *args, "--nats-url", url], capture_output=True,
                          text=True, timeout=timeout, env=env)


# -- item 7: no password on the terminal; the dashboard reads with a read-only role -----------------


def test_the_banner_masks_the_operator_password_and_names_its_file(up: Up) -> None:
    operator = up.url("operator")
    password = urlsplit(operator).password
    assert password and password not in up.banner
    for role in ("scheduler", "proxy", "collector", "recorder", "viewer"):
        assert urlsplit(up.url(role)).password not in up.banner
    env_file = up.data / "secrets" / "operator.env"
    assert up.lines["operator"].startswith("nats://operator:***@127.0.0.1:")
    assert f"password in {env_file}" in up.lines["operator"] and f"export $(cat {env_file})" in up.banner
    assert "laswrr nodes" in up.banner  # the command, spelled as it runs from here (.venv/bin/laswrr or laswrr)


async def test_the_dashboard_connects_as_the_read_only_viewer(up: Up) -> None:
    pid = _pid(up, "dashboard")
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    assert urlsplit(environ["NATS_URL"]).username == "viewer"
    async with aiohttp.ClientSession() as http:  # and it works with it: every node on the page's table
        deadline = time.monotonic() + 20
        while True:
            async with http.get(up.lines["dashboard"] + "api/state") as response:
                state = await response.json()
            names = {n["node"] for pool in state["pools"].values() for n in pool["nodes"]}
            if set(up.nodes) <= names or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    assert set(up.nodes) <= names
    # the viewer's credentials cannot act: the server refuses, and the command says so at once
    done = laswrr("drain", next(iter(up.nodes)), "--wait", "120", url=up.url("viewer"), timeout=100)
    assert done.returncode == 2 and "permissions violation" in done.stderr.lower(), done.stderr
    assert "user 'viewer' may not send admin commands" in done.stderr


def _pid(up: Up, name: str) -> int:
    for line in up.banner.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == name and parts[2] == "pid":
            return int(parts[3])
    raise AssertionError(f"no pid of {name} in the banner:\n{up.banner}")


# -- item 6: the wrong role's credentials are reported at once ------------------------------------


def test_capacity_with_the_proxy_credentials_reports_the_violation_at_once(up: Up) -> None:
    node = next(iter(up.nodes))
    # --wait 120 and a 100 s limit: a command that waited for an ack (as before: --wait, then "is
    # stream LB_EVENTS set up?") would be killed here instead of answering
    done = laswrr("capacity", node, "1", "--wait", "120", url=up.url("proxy"), timeout=100)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "permissions violation" in done.stderr.lower() and "LB_EVENTS" not in done.stderr, done.stderr
    assert f"the NATS server refused lb.admin.capacity.{node}" in done.stderr
    # the refused admin publish is what is named, not the subscription to lb.out.> made before it
    assert f'publish to "lb.admin.capacity.{node}"' in done.stderr.lower() and "subscription" not in done.stderr.lower()
    assert "user 'proxy' may not send admin commands" in done.stderr and "operator.env" in done.stderr
    assert urlsplit(up.url("proxy")).password not in done.stderr


# -- items 3 and 5: a sanity limit on capacity; every admin command gets a verdict ------------------


async def test_an_absurd_capacity_is_rejected_and_config_changes_get_a_verdict(up: Up) -> None:
    node = "sim-910b-2"
    assert node in up.nodes
    done = laswrr("capacity", node, "999999999999", url=up.url("operator"))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith("rejected: capacity 999999999999 for node 'sim-910b-2' is above max_capacity 4096")
    assert "laswrr config max_capacity=" in done.stdout
    assert "max_capacity=999999999999" not in done.stdout  # never suggests the typo as the new limit

    nc = await nats.connect(up.url("operator"))
    try:
        outputs: asyncio.Queue[tuple[str, dict[str, object]]] = asyncio.Queue()

        async def on_out(msg: object) -> None:
            await outputs.put((msg.subject, json.loads(msg.data)))  # type: ignore[attr-defined]

        await nc.subscribe("lb.out.>", cb=on_out)
        js = nc.jetstream()

        async def verdict(subject: str, body: bytes) -> tuple[str, dict[str, object]]:
            """Publish as `nats pub` does (plain JSON, no headers); the verdict for that input."""
            seq = (await js.publish(subject, body)).seq
            deadline = time.monotonic() + 10
            while True:
                got, payload = await asyncio.wait_for(outputs.get(), max(0.1, deadline - time.monotonic()))
                if payload.get("as_of_seq") == seq and (got in (sj.OUT_REJECTED, sj.OUT_CONFIG)
                                                        or got.startswith(sj.OUT_SNAPSHOT)):
                    return got, payload

        got, payload = await verdict(sj.admin_capacity(node), b'{"capacity": 99999999999}')
        assert got == sj.OUT_REJECTED and "above max_capacity 4096" in str(payload["reason"])
        got, payload = await verdict(sj.admin_node("n-huge"), json.dumps(
            {"url": up.nodes[node], "capacity": 5000}).encode())  # registrations too
        assert got == sj.OUT_REJECTED and "capacity 5000 for node 'n-huge' is above max_capacity" in str(payload["reason"])

        # a valid lb.admin.config gets its "applied" verdict (before: nothing at all)
        got, payload = await verdict(sj.ADMIN_CONFIG, b'{"set": {"slow_start_window_ms": 6000}}')
        assert got == sj.OUT_CONFIG and payload["set"] == {"slow_start_window_ms": 6000}
        assert isinstance(payload["config"], dict) and payload["config"]["slow_start_window_ms"] == 6000
        got, payload = await verdict(sj.ADMIN_CONFIG, b'{"set": {"max_capacty": 9000}}')
        assert got == sj.OUT_REJECTED and "unknown configuration key(s): max_capacty" in str(payload["reason"])
    finally:
        await nc.close()

    done = laswrr("config", "max_capacity=8192", url=up.url("operator"))
    assert done.returncode == 0 and done.stdout.startswith("applied: lb.admin.config"), (done.stdout, done.stderr)
    assert "now in force: max_capacity=8192" in done.stdout
    done = laswrr("capacity", node, "5000", url=up.url("operator"))
    assert done.returncode == 0 and "capacity 5000" in done.stdout, (done.stdout, done.stderr)
    done = laswrr("capacity", node, "9000", url=up.url("operator"))
    assert done.returncode == 1 and "above max_capacity 8192" in done.stdout
    for args in (("capacity", node, "8"), ("config", "max_capacity=4096", "slow_start_window_ms=5000")):
        assert laswrr(*args, url=up.url("operator")).returncode == 0


# -- item 8: node ids are never cut ---------------------------------------------------------------


async def test_nodes_and_watch_never_cut_a_node_id(up: Up) -> None:
    done = laswrr("register", LONG_ID, "--url", up.nodes["sim-910b-2"], "--chip", "910B", "--capacity", "8",
                  url=up.url("operator"))
    assert done.returncode == 0, (done.stdout, done.stderr)
    try:
        for columns in (80, 120):
            for watch in ((), ("--watch", "--interval-s", "200ms")):
                screen, errors = await _on_terminal(["nodes", *watch, "--nats-url", up.url("viewer")], columns)
                for node in (*up.nodes, LONG_ID):
                    assert node in screen, (columns, watch, node, screen, errors)
                assert "…" not in screen.split("┏")[1] if "┏" in screen else True
                flat = " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).split())
                assert f"hidden at {columns} columns" in flat  # what gave way instead, said
    finally:
        assert laswrr("remove", LONG_ID, url=up.url("operator")).returncode == 0


async def _on_terminal(args: list[str], columns: int) -> tuple[str, str]:
    """``laswrr ARGS`` on a pseudo-terminal ``columns`` wide: the screen text once a table is whole,
    and what it wrote to stderr."""
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", *args, stdout=slave, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": str(columns), "LINES": "60", "TERM": "xterm"})
    os.close(slave)
    screen = b""
    try:
        deadline = time.monotonic() + 60
        while screen.count("└".encode()) < 1 and time.monotonic() < deadline:
            ready, _, _ = await asyncio.to_thread(select.select, [master], [], [], 0.5)
            if ready:
                try:
                    screen += os.read(master, 65536)
                except OSError:
                    break
        if proc.returncode is None and "--watch" in args:
            proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)
    assert proc.stderr is not None
    return screen.decode(errors="replace"), (await proc.stderr.read()).decode(errors="replace")


# -- item 9: the analyst views tell applied from rejected; what happened to node X --------------------


async def test_views_mark_rejected_commands_and_history_tells_a_node_story(up: Up) -> None:
    from laswrr.replay import store
    from laswrr.services.recorder_copy import copy_from_recorder

    node, operator = "sim-910-1", up.url("operator")
    assert laswrr("capacity", node, "-1", url=operator).returncode == 1
    assert laswrr("drain", "sim-910-9", url=operator).returncode == 1  # a typo'd node id
    nc = await nats.connect(operator)
    try:
        await nc.jetstream().publish(sj.admin_capacity(node), b'{"capacity": 2.5}')  # as `nats pub` would
    finally:
        await nc.close()
    assert laswrr("capacity", node, "1", url=operator).returncode == 0
    assert laswrr("capacity", node, "4", url=operator).returncode == 0
    db = up.data / "events.duckdb"
    deadline = time.monotonic() + 30
    def read() -> list[tuple[object, ...]]:
        with store.open_read(db, copy_from_recorder(operator)) as con:  # the recorder holds the file: a copy
            return con.execute("SELECT node, kind, capacity, applied, rejected_reason, settle_ms, ramp IS NULL "
                               "FROM drain_timeline WHERE node IN (?, 'sim-910-9') ORDER BY event_seq",
                               [node]).fetchall()

    while True:  # the recorder commits in batches: wait until it holds the last command's verdict
        rows = await asyncio.to_thread(read)
        if sum(1 for r in rows if r[0] == node and r[3]) >= 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    rejected = [r for r in rows if not r[3]]
    assert [(r[0], r[1]) for r in rejected] == [(node, "capacity"), ("sim-910-9", "drain"), (node, "capacity")], rows
    assert all(r[5] is None and r[6] for r in rejected)  # no settle time, no ramp for what did not happen
    assert ">= 0" in rejected[0][4] and "unknown node 'sim-910-9'" in rejected[1][4]
    assert [r[2] for r in rows if r[3] and r[0] == node][-2:] == [1, 4]

    done = subprocess.run([sys.executable, "-m", "laswrr", "history", node, "--db", str(db), "--nats-url", operator],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    kinds = [line.split()[4] + (" " + line.split()[5] if line.split()[4] == "admin" else "") for line in lines]
    assert kinds[0] == "admin node" and "phase" in kinds  # registered, then active
    story = "\n".join(lines)
    assert 'REJECTED {"capacity":-1}' in story and 'REJECTED {"capacity": 2.5}' in story
    down = re.search(r"capacity +\d+ -> 1$", story, re.M)
    assert down is not None, story
    assert story.index('REJECTED {"capacity": 2.5}') < down.start() < story.index("1 -> 4")
    at = next(line for line in lines if line.endswith("1 -> 4")).split()[1]  # --at keeps the window around it
    done = subprocess.run([sys.executable, "-m", "laswrr", "history", node, "--db", str(db), "--at", at[:8],
                           "--window-s", "2", "--nats-url", operator], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "1 -> 4" in done.stdout and "admin node" not in done.stdout, done.stdout


# -- item 11: export --parquet holds every view an analyst needs -------------------------------------


def test_export_writes_continuations_attempts_and_phase_changes(up: Up, tmp_path: Path) -> None:
    out = tmp_path / "archive"
    done = subprocess.run([sys.executable, "-m", "laswrr", "export", "--db", str(up.data / "events.duckdb"),
                           "--parquet", str(out), "--nats-url", up.url("operator")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for view in ("continuations", "attempts", "phase_changes", "rejections", "node_timeline"):
        assert (out / f"{view}.parquet").exists(), view
    import duckdb
    registered = duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{out / 'phase_changes.parquet'}') "
                            "WHERE from_phase = 'new'").fetchone()
    assert registered is not None and registered[0] >= 4  # the four engines' registrations


# -- a second `laswrr up` on a data dir in use is refused at once ------------


def test_a_second_up_on_the_same_data_dir_is_refused_at_once_touching_nothing(up: Up) -> None:
    watched = [up.data / "secrets" / f"{role}.env" for role in ("operator", "viewer")]
    watched += [up.data / "nats-server.conf", up.data / "secrets" / "nats-server.conf"]
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in watched if path.exists()}
    assert before, "the running stack wrote no secrets?"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "laswrr", "up", "--data-dir", str(up.data), "--proxy-port", "0",
                           "--dashboard-port", "0"], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    print(f"second `laswrr up` on a data dir in use: refused in {took:.2f} s (exit {done.returncode})")
    assert done.returncode != 0 and "running" not in done.stdout, (done.stdout, done.stderr)
    assert f"data dir {up.data} in use by pid {up.proc.pid}" in done.stderr, done.stderr
    assert took < 15, took  # the Python start-up, no NATS nor DuckDB wait (26 s before)
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in before} == before
    assert up.proc.poll() is None
    # the first stack still answers with its credentials
    nodes = laswrr("nodes", "--json", url=up.url("viewer"), timeout=60)
    assert nodes.returncode == 0 and "sim-910c-1" in nodes.stdout, nodes.stderr


# -- round two, item 3: the read-only viewer reads the live log; a refusal names the role needed -------------


def test_the_viewer_reads_the_live_log_and_a_forbidden_role_fails_fast(up: Up) -> None:
    db = str(up.data / "events.duckdb")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "laswrr", "report", "--db", db, "--json", "--nats-url",
                           up.url("viewer")], capture_output=True, text=True, timeout=90)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["events"] > 0
    query = subprocess.run([sys.executable, "-m", "laswrr", "query", "--db", db, "--nats-url", up.url("viewer"),
                            "SELECT count(*) AS n FROM requests"], capture_output=True, text=True, timeout=90)
    assert query.returncode == 0 and query.stdout.splitlines()[0] == "n", (query.stdout, query.stderr)
    started = time.monotonic()
    refused = subprocess.run([sys.executable, "-m", "laswrr", "report", "--db", db, "--nats-url", up.url("collector")],
                             capture_output=True, text=True, timeout=90)
    refused_s = time.monotonic() - started
    print(f"report --db of the live log: viewer {took:.2f} s; collector refused in {refused_s:.2f} s")
    assert refused.returncode != 0 and refused_s < 20, (refused_s, refused.stderr)
    assert "user 'collector' may not ask the recorder for a copy" in refused.stderr, refused.stderr
    assert "viewer.env" in refused.stderr and urlsplit(up.url("collector")).password not in refused.stderr
    # and the viewer still cannot act on anything (its role is read-only)
    act = laswrr("capacity", "sim-910-1", "1", url=up.url("viewer"))
    assert act.returncode == 2 and "may not send admin commands" in act.stderr
