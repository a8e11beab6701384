"""Test helper: `laswrr up` as a real child process, its banner, and a load of real clients.

``start_up(*args)`` runs ``python -m laswrr up ARGS`` in its own session and returns the
process and the banner's ``name: value`` lines (``banner["pid scheduler"]`` and so on, and
``banner["operator URL"]``, read from the secrets file the banner names) once it is printed;
``up_stderr`` keeps reading its stderr afterwards (a full pipe would block it).
``no_leftover_stack`` (use it as an autouse fixture) stops every `laswrr up` a failed test left
behind, by its own pid. ``Load`` runs ``workers`` clients that post chat completions to a proxy
until stopped, counting what was served and what failed (with the first reasons); with
``stream=True`` each reads an SSE stream to its ``data: [DONE]``, and a stream that began (200)
but ended without it counts as ``cut`` too.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import aiohttp

STARTED: list[asyncio.subprocess.Process] = []


async def interrupt(proc: asyncio.subprocess.Process, timeout_s: float = 60.0) -> None:
    """Ctrl-C ``proc`` (if still running), as an operator would, and wait; SIGKILL after ``timeout_s``."""
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


async def no_leftover_stack() -> AsyncIterator[None]:
    yield
    while STARTED:
        await interrupt(STARTED.pop())


async def start_up(*args: str, env: dict[str, str] | None = None) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """Run `laswrr up ARGS` (``env``: added to this process's environment); returns the process
    and the banner's "name: value" lines once printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "up", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env={**os.environ, **env} if env else None)
    STARTED.append(proc)
    assert proc.stdout is not None
    banner: dict[str, str] = {}
    while "Ctrl-C" not in banner.get("last", ""):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            err = await proc.stderr.read() if proc.stderr else b""
            raise AssertionError(f"laswrr up exited early: {err.decode()[-2000:]}")
        banner["last"] = line
        key, _, value = line.strip().partition(": ")
        if value:
            banner[key] = value.strip()
        match = re.match(r"\s+(\w[\w-]*)\s+(\S+)\s+pid (\d+)", line)
        if match:
            banner[f"pid {match.group(2)}"] = match.group(3)
    secrets = re.search(r"\(password in (.+?): export ", banner.get("operator", ""))
    if secrets:  # the banner masks the password and names the file that holds it: read that
        banner["operator URL"] = Path(secrets.group(1)).read_text().strip().removeprefix("NATS_URL=")
    return proc, banner


async def finish(proc: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, (out or b"").decode(), (err or b"").decode()


class UpStderr:
    """Every stderr line of a running `laswrr up`, read in the background."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.lines: list[str] = []
        self._task = asyncio.create_task(self._read(proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            self.lines.append(line.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.lines)

    async def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            matches = list(re.finditer(pattern, self.text()))
            if len(matches) >= count:
                return matches[count - 1]
            assert time.monotonic() < deadline, f"no {pattern!r} (x{count}) in laswrr up's stderr:\n{self.text()[-3000:]}"
            await asyncio.sleep(0.05)


@dataclass
class Load:
    """``workers`` clients posting chat completions to ``url`` until ``stop()``."""

    url: str
    model: str = "default"
    workers: int = 8
    stream: bool = False
    max_tokens: int = 8
    headers: dict[str, str] = field(default_factory=dict)
    served: int = 0
    failed: int = 0
    cut: int = 0  # of the failed: streams that began and did not end with [DONE]
    reasons: list[str] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)

    def start(self) -> None:
        self._running = True
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        self._running = False
        await asyncio.gather(*self._tasks)

    async def _worker(self) -> None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream,
                "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=self.headers) as http:
            while self._running:
                began = False
                try:
                    async with http.post(f"{self.url}/v1/chat/completions", json=body) as response:
                        began = response.status == 200
                        data = await response.read()
                        ok = response.status == 200 and (not self.stream or data.rstrip().endswith(b"data: [DONE]"))
                        reason = f"HTTP {response.status}" if response.status != 200 else "stream without [DONE]"
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    ok, reason = False, f"{type(exc).__name__}: {exc}"
                if not ok and began:
                    self.cut += 1
                if ok:
                    self.served += 1
                else:
                    self.failed += 1
                    self.failed_at.append(time.monotonic())
                    if len(self.reasons) < 5:
                        self.reasons.append(reason)
                    await asyncio.sleep(0.05)


@dataclass
class LogAudit:
    """What a stopped stack's log holds against its streams: the messages each stream published,
    the rows recorded per stream, the distinct (stream, seq) among them, the requests the views
    count as cut by the router, and `laswrr replay`'s summary (exact, or the test failed)."""

    published: dict[str, int]
    rows: dict[str, int]
    distinct: int
    cut: int
    replay: str

    def line(self) -> str:
        return f"cut by the router (views) {self.cut}; published {self.published} recorded {self.rows}; replay: {self.replay}"

    def assert_whole(self) -> None:
        """Every published message recorded once, and no request cut by the router."""
        assert self.rows == self.published and self.distinct == sum(self.rows.values())
        assert self.cut == 0


async def audit_log(nc: Any, db: Path) -> LogAudit:
    """Audit the log of a stack that has stopped (closes ``nc``, the test's NATS connection)."""
    from laswrr.replay import store
    from laswrr.schemas import subjects as sj
    from tests.replay_cli import replay_exact

    js = nc.jetstream()
    published = {s: (await js.stream_info(s)).state.messages for s in (sj.EVENTS_STREAM, sj.OUT_STREAM)}
    await nc.close()
    with store.open_read(db) as con:
        rows = dict(con.execute("SELECT stream, count(*) FROM events GROUP BY stream").fetchall())
        (distinct,) = con.execute("SELECT count(DISTINCT (stream, seq)) FROM events").fetchone()
        (cut,) = con.execute("SELECT count(*) FROM interruptions").fetchone()
    return LogAudit(published, rows, distinct, cut, replay_exact(db))

