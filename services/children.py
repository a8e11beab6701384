"""The child processes of ``laswrr up`` (``services.up.Stack``): start, watch, stop in order.

Theory of operation. Each child is ``python -m laswrr <command> <args>`` (or, given
``program``, any other program: a benchmark's engine, a peer router, nats-server) in its own
session, so a terminal's Ctrl-C reaches only the parent, which stops the children in order; each
child also gets SIGTERM if the parent itself dies (Linux ``PR_SET_PDEATHSIG``). Its stderr goes
to ``<log_dir>/<name>.log`` and so does its stdout, through a pump (a full pipe would block the
child); a child that prints ``... listening on URL`` can be waited for, and the URL is recorded.
A child that exits on its own (not during ``stop``, not marked ``expected_exit``) is reported by
``wait_unexpected_exit``, unless a ``RestartPolicy`` is given: then it is restarted, the same
command with the same arguments (a ``--port 0`` pinned to the port it had, so its URL stays
valid), after a backoff that doubles from ``first_backoff_s`` up to ``max_backoff_s``, each
death logged with its exit status. A child that dies more than ``max_restarts`` times within
``window_s`` is not restarted again: it is reported by ``wait_unexpected_exit`` (``laswrr up``
then stops the rest and exits 1). ``stop(order)`` ends any pending restart first, then takes the
roles in ``order``, all children of one role at once: SIGTERM, up to the role's stop timeout,
then SIGKILL to its process group (its own session's: anything it started goes too). Only
these processes are signalled, by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("laswrr.up")

LISTENING = re.compile(r"listening on (\S+)")
DEFAULT_STOP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0


def exited(pid: int) -> bool:
    """The process ``pid`` is gone, or all that is left of it is its zombie: it has exited and its
    sockets are closed.

    Its main thread alone is not enough: a zombie main thread's process can still have other
    threads (an executor's) on their way out, and its files (its listening socket) close with the
    last of them. So every thread must be gone or a zombie. Its /proc entries can vanish between
    the listing and the read (an OSError): gone too."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] not in ("Z", "X"):
                    return False
        except OSError:
            continue
    return True


class StackError(RuntimeError):
    """The stack cannot start (bad nodes file, a child that failed to come up); one line."""


_LIBC: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (PR_SET_PDEATHSIG = 1).

    Linux ties this to the *thread* that forked: spawn from a thread that lives as long as the
    child should (the event loop's, or the main thread), not from a worker thread."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)


def preexec() -> Any:
    """``preexec_fn`` for a child that must not outlive its parent (None where unsupported)."""
    return die_with_parent if _LIBC is not None else None


def interrupt_on_sigterm() -> None:
    """Make SIGTERM stop a foreground command the way Ctrl-C does (KeyboardInterrupt), so its
    cleanup runs and no child (nats-server, engines) is left behind by ``kill``."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again (module header)."""

    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # deaths within window_s beyond this: the child keeps dying, give up
    window_s: float = 60.0

    def backoff_s(self, recent_deaths: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, recent_deaths - 1))


@dataclass
class Child:
    name: str
    role: str
    process: asyncio.subprocess.Process
    log_path: Path
    url: str | None = None
    expected_exit: bool = False
    watcher: asyncio.Task[None] | None = None
    pump: asyncio.Task[None] | None = None
    argv: tuple[str, ...] = ()  # the laswrr command and its arguments, to restart it
    program: tuple[str, ...] | None = None  # what runs argv; None: python -m laswrr
    cwd: Path | None = None
    wait_listening: bool = False
    env: Mapping[str, str] | None = None  # its environment (None: this process's), the same at a restart
    deaths: list[float] = field(default_factory=list)  # monotonic times of unexpected exits
    restarts: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 8) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class ChildProcesses:
    """Every child started through ``spawn``, in start order (module header)."""

    def __init__(self, log_dir: Path, python: str = sys.executable,
                 stop_timeout_s: Mapping[str, float] | None = None, restart: RestartPolicy | None = None) -> None:
        self.log_dir, self.python = log_dir, python
        self.stop_timeout_s = dict(stop_timeout_s or {})  # per role; others DEFAULT_STOP_TIMEOUT_S
        self.restart = restart
        self.children: list[Child] = []
        self._failures: asyncio.Queue[Child] = asyncio.Queue()
        self._stopping = False
        self._stop_requested = asyncio.Event()
        self._restarting: set[asyncio.Task[None]] = set()

    async def spawn(self, name: str, command: str, *args: str, role: str = "other",
                    wait_listening: bool = False, env: Mapping[str, str] | None = None,
                    program: Sequence[str] | None = None, cwd: Path | None = None) -> Child:
        """Start ``python -m laswrr COMMAND ARGS`` as a child (``program``: ``PROGRAM COMMAND
        ARGS`` instead; environment ``env``, default this process's; working directory ``cwd``,
        default this process's); with ``wait_listening``, wait for its ``... listening on URL``
        stdout line and record the URL."""
        program = tuple(program) if program is not None else None
        process, log_path = await self._exec(name, (command, *args), env, program, cwd)
        child = Child(name=name, role=role, process=process, log_path=log_path, argv=(command, *args),
                      wait_listening=wait_listening, env=env, program=program, cwd=cwd)
        self.children.append(child)
        await self._started(child)
        return child

    async def _exec(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                    program: Sequence[str] | None = None,
                    cwd: Path | None = None) -> tuple[asyncio.subprocess.Process, Path]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        command = (*(program if program is not None else (self.python, "-m", "laswrr")), *argv)
        try:
            process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                env=env, cwd=cwd, start_new_session=True, preexec_fn=preexec(),
            )
        finally:
            log_file.close()
        return process, log_path

    async def _started(self, child: Child) -> None:
        if child.wait_listening:
            child.url = await self._read_url(child)
        child.pump = asyncio.create_task(self._pump(child))
        child.watcher = asyncio.create_task(self._watch(child))
        log.info("started %s (pid %d)%s", child.name, child.pid, f" at {child.url}" if child.url else "")

    async def _read_url(self, child: Child) -> str:
        assert child.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = await asyncio.wait_for(child.process.stdout.readline(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            if not line:
                await child.process.wait()
                raise StackError(f"{child.name} exited with {child.process.returncode} before listening: "
                                 f"{child.tail(3) or 'no output'} (log {child.log_path})")
            _append(child.log_path, line)
            match = LISTENING.search(line.decode(errors="replace"))
            if match:
                return match.group(1)
        raise StackError(f"{child.name} did not report a listening URL within {START_TIMEOUT_S:g} s (log {child.log_path})")

    async def _pump(self, child: Child) -> None:
        """Copy the child's stdout into its log (a full pipe would block the child). A line the
        log cannot take (its disk full) is dropped, never left in the pipe; once a write works
        again a line says how many were lost."""
        assert child.process.stdout is not None
        lost, why = 0, ""
        with open(child.log_path, "ab", buffering=0) as sink:
            while line := await child.process.stdout.readline():
                try:
                    if lost:
                        sink.write(f"[laswrr up: {lost} line(s) of output lost: {why}]\n".encode())
                        lost = 0
                    sink.write(line)
                except OSError as exc:
                    lost, why = lost + 1, exc.strerror or str(exc)

    async def _watch(self, child: Child) -> None:
        code = await child.process.wait()
        if child.expected_exit or self._stopping:
            return
        policy = self.restart
        if policy is None:
            log.error("%s (pid %d) exited unexpectedly with %s", child.name, child.pid, code)
            self._failures.put_nowait(child)
            return
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t <= policy.window_s] + [now]
        if len(child.deaths) > policy.max_restarts:
            log.error("%s (pid %d) exited with %s: %d deaths within %g s, not restarting it again", child.name,
                      child.pid, code, len(child.deaths), policy.window_s)
            self._failures.put_nowait(child)
            return
        backoff = policy.backoff_s(len(child.deaths))
        log.error("%s (pid %d) exited unexpectedly with %s; restarting it in %g s (death %d of %d allowed "
                  "within %g s)", child.name, child.pid, code, backoff, len(child.deaths), policy.max_restarts,
                  policy.window_s)
        task = asyncio.create_task(self._restart(child, backoff))
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _restart(self, child: Child, backoff_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_requested.wait(), backoff_s)
        if self._stopping:
            return
        if child.pump is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(child.pump, 2.0)
        argv = pinned_port(child.argv, child.url)
        try:
            child.process, child.log_path = await self._exec(child.name, argv, child.env, child.program, child.cwd)
            child.restarts += 1
            await self._started(child)
        except (OSError, StackError) as exc:  # could not come up: counts as one more death
            log.error("restarting %s failed: %s", child.name, exc)
            if child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
            child.watcher = asyncio.create_task(self._watch(child))

    async def wait_unexpected_exit(self) -> Child:
        """The first child that exits while the group runs (not during ``stop``)."""
        return await self._failures.get()

    async def stop(self, order: Sequence[str]) -> None:
        """Stop the children role by role in ``order`` (idempotent); pending restarts end first.
        Roles ``order`` does not name keep running (:meth:`roles` lists them all)."""
        self._stopping = True
        self._stop_requested.set()
        if self._restarting:
            await asyncio.gather(*self._restarting, return_exceptions=True)
        for role in order:
            group = [c for c in self.children if c.role == role]
            await asyncio.gather(*(self._stop_child(c) for c in group))

    def roles(self) -> tuple[str, ...]:
        """Every role spawned so far, in spawn order."""
        return tuple(dict.fromkeys(c.role for c in self.children))

    async def _stop_child(self, child: Child) -> None:
        child.expected_exit = True
        process = child.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            timeout = self.stop_timeout_s.get(child.role, DEFAULT_STOP_TIMEOUT_S)
            try:
                await asyncio.wait_for(process.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("%s did not stop within %g s: killed", child.name, timeout)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)  # its own session: its group is its own, by pid
                await process.wait()
        for task in (child.pump, child.watcher):
            if task is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, 2.0)
        if process.returncode not in (0, -signal.SIGTERM):
            log.warning("%s exited with %s (log %s)", child.name, process.returncode, child.log_path)


def pinned_port(argv: Sequence[str], url: str | None) -> tuple[str, ...]:
    """``argv`` with ``--port 0`` replaced by the port of ``url`` (the one the child had)."""
    args = list(argv)
    port = url.rsplit(":", 1)[-1].split("/", 1)[0] if url else ""
    for i, arg in enumerate(args[:-1]):
        if arg == "--port" and args[i + 1] == "0" and port.isdigit():
            args[i + 1] = port
    return tuple(args)


def _append(path: Path, line: bytes) -> None:
    with open(path, "ab") as sink:
        sink.write(line)
