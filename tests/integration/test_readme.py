"""The README and docs/ work as written: their command blocks run against a real `laswrr up`.

The blocks are read from README.md when the test runs, so an edit to the README is tested as
it stands. Every ```sh block line is one command (``\\`` continuations joined). What runs:

* ``curl`` lines (the client examples), with ``localhost:8000`` pointed at the stack's proxy
  (it listens on a free port) and ``--fail-with-body -sS`` added so an HTTP error fails;
* ``nats`` lines (the operator examples): the real ``nats`` CLI when installed, else the same
  operation done here with nats-py (``pub``, ``sub`` until the first message, ``kv get``);
* ``laswrr`` lines except ``up`` (the test's own stack), ``bench`` and ``demo`` (minutes long)
  and the long-running services (``scheduler``, ``proxy``, ...): the operator CLI, ``nodes``,
  ``report``, ``replay``, ``export``, ``history``.

The README's run first, then those of every docs/*.md file (name order). They run in that order, in a scratch directory laid out as a checkout after ``make venv``
(``.venv`` and ``docs`` linked, ``.laswrr`` the stack's data dir, ``nodes.toml`` the stack's
nodes), with ``NATS_URL`` set. Each must exit 0, and nothing the README sends may be rejected
(``lb.out.rejected`` stays empty). Every ``laswrr`` invocation of any block (Docker ones too)
must at least parse with the real argument parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from laswrr.cli import build_parser
from laswrr.schemas import subjects as sj
from tests.up_process import interrupt

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = {"up", "bench", "demo",  # the stack itself; runs that take minutes
           "scheduler", "recorder", "collector", "proxy", "sim-engine", "dashboard"}  # services: they never exit
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def document_commands() -> list[tuple[str, str]]:
    """(file name, command) of every ```sh block of the README, then of each docs/*.md."""
    return [(path.name, command) for path in DOCUMENTS for command in readme_commands(path.read_text())]
COMMAND_TIMEOUT_S = 60.0


def readme_commands(text: str) -> list[str]:
    """The commands of every ```sh block, continuation lines joined, comment lines dropped."""
    commands: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        pending = ""
        for line in block.splitlines():
            if pending:
                line = pending + " " + line.strip()
                pending = ""
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1].rstrip()
                continue
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def laswrr_invocations(command: str) -> list[list[str]]:
    """The argument lists of each ``laswrr`` call in ``command`` (``a; b``, ``docker ... laswrr x``)."""
    calls = []
    for part in re.split(r";|&&", command):
        words = shlex.split(part, comments=True)
        for i, word in enumerate(words):
            if word == "laswrr" or word.endswith("/laswrr"):
                calls.append(words[i + 1:])
                break
    return calls


def test_every_laswrr_command_in_the_readme_and_docs_parses() -> None:
    parser = build_parser()
    calls = [(name, call) for name, command in document_commands() for call in laswrr_invocations(command)]
    assert len(calls) > 20 and {name for name, _ in calls} >= {"README.md", "analysts.md", "configuration.md"}
    for name, call in calls:
        try:
            parser.parse_args(call)
        except SystemExit as exc:
            raise AssertionError(f"{name}: `laswrr {shlex.join(call)}` does not parse") from exc


def test_readme_commands_are_split_as_a_shell_would() -> None:
    text = "x\n```sh\na --b \\\n  c   # note\n# only a comment\n\nd; e\n```\n```toml\nnot = 1\n```\n"
    assert readme_commands(text) == ["a --b c   # note", "d; e"]
    assert laswrr_invocations("laswrr drain n1; .venv/bin/laswrr nodes --json") == [["drain", "n1"], ["nodes", "--json"]]


# -- against a running stack ---------------------------------------------------------------------------


@dataclass
class Running:
    workdir: Path
    nats_url: str
    proxy: str  # host:port
    env: dict[str, str]


async def _banner(proc: asyncio.subprocess.Process) -> dict[str, str]:
    assert proc.stdout is not None
    banner: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        if not line:
            raise AssertionError("laswrr up exited before its banner")
        key, _, value = line.strip().partition(": ")
        if value:
            banner.setdefault(key, value.strip())
        if "Ctrl-C" in line:
            return banner


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Running]:
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "docs").symlink_to(ROOT / "docs")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("NATS_URL", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "up", "--proxy-port", "0", "--allow-upstream", "10.0.0.0/8",  # the README's n5
        "--dashboard-port", "0", cwd=workdir, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    try:
        banner = await _banner(proc)
        masked, _, file = banner["operator"].partition("  (password in ")
        assert ":***@" in masked, banner["operator"]  # the banner never shows the password
        nats_url = (workdir / ".laswrr" / "secrets" / "operator.env").read_text().strip().removeprefix("NATS_URL=")
        assert file.startswith(str(workdir / ".laswrr" / "secrets" / "operator.env")) or file.startswith(
            ".laswrr/secrets/operator.env"), banner["operator"]
        proxy = banner["proxy URL"].split()[0].removeprefix("http://")
        shutil.copy(workdir / ".laswrr" / "nodes.toml", workdir / "nodes.toml")
        yield Running(workdir, nats_url, proxy, dict(env, NATS_URL=nats_url))
    finally:
        await interrupt(proc)


def _runnable(command: str) -> bool:
    first = shlex.split(command, comments=True)[0]
    if first in ("curl", "nats"):
        return True
    calls = laswrr_invocations(command)
    return bool(calls) and first.endswith("laswrr") and all(call and call[0] not in NOT_RUN for call in calls)


async def _shell(command: str, stack: Running) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=stack.workdir, env=stack.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        return -9, out.decode(errors="replace")
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def _nats_here(command: str, env: dict[str, str]) -> tuple[int, str]:
    """What the ``nats`` CLI would do, with nats-py (for machines without the CLI); the command's own
    connection options (``-s``, ``--creds``, ``--user``/``--password``) with its variables expanded."""
    parser = argparse.ArgumentParser(prog="nats", exit_on_error=False)
    parser.add_argument("-s", "--server")
    parser.add_argument("--creds")
    parser.add_argument("--user")
    parser.add_argument("--password")
    parser.add_argument("words", nargs="+")
    words = [_expand(word, env) for word in shlex.split(command, comments=True)[1:]]
    options = parser.parse_args(words)
    words = options.words
    connect: dict[str, object] = {"servers": options.server or env.get("NATS_URL")}
    if options.creds:
        connect["user_credentials"] = options.creds
    if options.user:
        connect.update(user=options.user, password=options.password)
    nc = await nats.connect(**connect)  # type: ignore[arg-type]
    try:
        if words[0] == "pub":
            await nc.publish(words[1], words[2].encode() if len(words) > 2 else b"")
            await nc.flush()
            return 0, ""
        if words[0] == "sub":
            sub = await nc.subscribe(words[1])
            msg = await sub.next_msg(timeout=10)
            return 0, f"[#1] Received on {msg.subject}\n{msg.data.decode()}"
        if words[:2] == ["stream", "info"]:
            info = await nc.jetstream().stream_info(words[2])
            return 0, f"Information for Stream {info.config.name}\nReplicas: {info.config.num_replicas}"
        if words[:2] == ["kv", "get"]:
            entry = await (await nc.jetstream().key_value(words[2])).get(words[3])
            return 0, (entry.value or b"").decode()
    finally:
        await nc.close()
    raise AssertionError(f"no stand-in for `{command}`: install the nats CLI or extend _nats_here")


def _expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), word)


async def _run_one(command: str, stack: Running) -> tuple[int, str]:
    words = shlex.split(command, comments=True)
    if words[0] == "curl":
        return await _shell(command.replace("localhost:8000", stack.proxy) + " --fail-with-body -sS", stack)
    if words[0] == "nats" and shutil.which("nats") is None:
        return await _nats_here(command, stack.env)
    if words[0] == "nats" and "sub" in words:
        code, out = await _shell(f"timeout 10 {command} --count 1", stack)
        return (0 if code == 0 and out else code), out
    return await _shell(command, stack)


@pytest.mark.timeout(600)  # ~40 s alone; some twenty CLI start-ups take longer on a shared, busy machine
async def test_readme_and_docs_command_blocks_run_against_laswrr_up(stack: Running) -> None:
    commands = [(name, c) for name, c in document_commands() if _runnable(c)]
    kinds = {shlex.split(c)[0].rsplit("/", 1)[-1] for _, c in commands}
    assert {"curl", "nats", "laswrr"} <= kinds and {name for name, _ in commands} >= {"README.md", "analysts.md"}
    nc = await nats.connect(stack.nats_url)
    rejected: list[str] = []
    marker, marked = sj.admin_capacity("readme-test-marker"), asyncio.Event()

    async def on_rejected(msg: nats.aio.msg.Msg) -> None:
        body = json.loads(msg.data)
        if body.get("subject") == marker:
            marked.set()
            return
        # A collector sample already on its way when the README removes a node is rejected as an
        # unknown node: that is the collector racing the removal, not something the README sent.
        if not (body.get("subject", "").startswith(("lb.metrics.", "lb.health.")) and "unknown node" in body["reason"]):
            rejected.append(msg.data.decode())

    await nc.subscribe(sj.OUT_REJECTED, cb=on_rejected)
    failures = []
    try:
        for name, command in commands:
            started = time.monotonic()
            code, out = await _run_one(command, stack)
            took = f"{time.monotonic() - started:.1f} s"
            if code != 0:
                failures.append(f"{name}: $ {command}\n(exit {code} after {took})\n{out[-1500:]}")
            elif command.startswith("curl") and ('"error"' in out or
                                                 ('"stream": true' in command and "data: [DONE]" not in out)):
                failures.append(f"{name}: $ {command}\nanswered an error or an unfinished stream:\n{out[-1500:]}")
        # the scheduler's verdicts come in the log's order: the one on this unknown node's capacity,
        # published after every command, comes after the verdict on the last admin message they sent
        await nc.jetstream().publish(marker, b'{"capacity": 1}')
        await asyncio.wait_for(marked.wait(), 60)
    finally:
        await nc.close()
    assert not failures, "README or docs commands failed:\n\n" + "\n\n".join(failures)
    assert not rejected, f"the scheduler rejected what the README or docs sent: {json.dumps(rejected, indent=1)}"
