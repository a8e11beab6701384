"""Run compose.yaml as local processes: one per service instance, no Docker engine.

    python deploy/compose_local.py --profile sim up        # the demo stack, until Ctrl-C
    python deploy/compose_local.py --profile sim plan      # print the processes it would start

``compose_plan.plan`` translates the file (ports, hostnames, volumes, programs: see its
header); this module runs the plan the way ``docker compose up --wait`` would:

* a service starts once its ``depends_on`` conditions hold (dependency started, healthy, or
  exited 0); the health checks are the file's own, run against the local ports every
  ``probe_s`` until they pass once;
* ``up`` returns when every long-running service is healthy (or started, without a check) and
  every one-shot has exited 0 (a failed one-shot is retried per its ``on-failure:N``); a
  long-running service that exits, a one-shot out of retries or the timeout raise ``StackError``
  with the tail of the offending log;
* ``down`` stops dependents before their dependencies (SIGTERM, then SIGKILL after the
  service's ``stop_grace_period``), so the recorder commits while NATS still runs.

Each process writes stdout and stderr to ``<workdir>/logs/<instance>.log``; volumes live under
``<workdir>/volumes``. The processes are ``laswrr up``'s kind of children
(services/children.py ``ChildProcesses``, run by an event loop in a thread of this process
while the stack is up): each in its own session, SIGTERM if this process dies, stopped by pid,
group by group (here: the dependency layers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.compose_plan import ComposeError, Health, ProcessPlan, Runtime, load_compose, plan  # noqa: E402
from laswrr.services.children import Child, ChildProcesses  # noqa: E402
from laswrr.services.nats_server import free_port, nats_server_binary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"


class StackError(RuntimeError):
    """The stack did not come up (or a service died); the message names the service and its log."""


def local_runtime(build_context: Path = ROOT) -> Runtime:
    venv_laswrr = Path(sys.executable).parent / "laswrr"
    laswrr = (str(venv_laswrr),) if venv_laswrr.exists() else (sys.executable, "-m", "laswrr")
    return Runtime(build_context=build_context, laswrr=laswrr, python=sys.executable,
                   nats_server=nats_server_binary())


def probe(health: Health, env: Mapping[str, str], timeout_s: float = 3.0) -> bool:
    """Run one health check; True when it passes."""
    if health.url is not None:
        try:
            with urllib.request.urlopen(health.url, timeout=timeout_s) as response:  # noqa: S310
                return 200 <= int(response.status) < 300
        except (urllib.error.URLError, OSError):
            return False
    try:
        argv = ["/bin/sh", "-c", health.argv[0]] if health.shell else list(health.argv)
        result = subprocess.run(argv, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


T = TypeVar("T")
MAX_STOP_S = 20.0  # longest wait for one instance after SIGTERM, whatever its stop_grace_period


@dataclass
class Instance:
    plan: ProcessPlan
    env: dict[str, str]
    log_path: Path
    child: Child | None = None  # its latest process (a retried one-shot: the last attempt)
    healthy: bool = False
    completed: bool = False
    attempts: int = 0
    next_probe: float = 0.0

    @property
    def returncode(self) -> int | None:
        return self.child.process.returncode if self.child is not None else None

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.process.returncode is None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class LocalStack:
    """The processes of one compose file; ``with LocalStack.from_file(...) as stack:`` runs them."""

    def __init__(self, plans: list[ProcessPlan], workdir: Path, env: Mapping[str, str] | None = None,
                 probe_s: float = 0.2) -> None:
        self.workdir = workdir
        self.probe_s = probe_s
        base = dict(os.environ if env is None else env)
        base["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), base.get("PATH", os.defpath)])
        base.pop("NATS_URL", None)  # the compose environment names the bus, nothing inherited
        self.instances = {p.name: Instance(p, {**base, **p.env}, workdir / "logs" / f"{p.name}.log") for p in plans}
        layers = self._stop_layers()
        self._roles = {i.plan.name: f"layer-{n}" for n, layer in enumerate(layers) for i in layer}
        self._stop_order = [f"layer-{n}" for n in range(len(layers))]
        self.processes = ChildProcesses(workdir / "logs", stop_timeout_s={
            f"layer-{n}": min(max(i.plan.stop_grace_s for i in layer), MAX_STOP_S) for n, layer in enumerate(layers)})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_file(cls, compose_file: Path = COMPOSE_FILE, workdir: Path | None = None, profiles: Iterable[str] = (),
                  env: Mapping[str, str] | None = None, probe_s: float = 0.2) -> "LocalStack":
        environ = dict(os.environ if env is None else env)
        workdir = Path(workdir or tempfile.mkdtemp(prefix="laswrr-compose-"))
        document = load_compose(compose_file, environ)
        plans = plan(document, compose_file.resolve().parent, workdir, local_runtime(compose_file.resolve().parent),
                     profiles, allocate_port=_distinct_free_ports())
        return cls(plans, workdir, environ, probe_s)

    # -- queries ---------------------------------------------------------------------------------

    def port(self, name: str, container_port: int) -> int:
        return self.instances[name].plan.ports[container_port]

    def url(self, name: str, container_port: int, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port(name, container_port)}"

    def env_of(self, name: str) -> dict[str, str]:
        return dict(self.instances[name].plan.env)

    def unexpected_exits(self) -> dict[str, int]:
        """Long-running instances that are no longer running, with their exit codes."""
        return {n: i.returncode for n, i in self.instances.items()  # type: ignore[misc]
                if not i.plan.one_shot and i.child is not None and i.returncode is not None}

    # -- the children's event loop -----------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the children's loop (started on first use, in a thread that lives
        until ``down``: the children's parent-death signal follows the thread that started them)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="compose-local", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # -- up --------------------------------------------------------------------------------------

    def up(self, timeout_s: float = 30.0) -> None:
        for instance in self.instances.values():
            for directory in instance.plan.dirs:
                directory.mkdir(parents=True, exist_ok=True)
            for path, text in instance.plan.files.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                waiting = [n for n, i in self.instances.items() if not self._satisfies(i, "service_healthy")]
                message = f"not up within {timeout_s:g} s; waiting for {', '.join(waiting)}" + self._tails(waiting)
                self.down()  # nothing started is left behind
                raise StackError(message)
            self._step()
            time.sleep(0.05)

    def _ready(self) -> bool:
        return all(self._satisfies(i, "service_completed_successfully" if i.plan.one_shot else "service_healthy")
                   for i in self.instances.values())

    def _satisfies(self, instance: Instance, condition: str) -> bool:
        if condition == "service_completed_successfully":
            return instance.completed
        if condition == "service_healthy" and instance.plan.health is not None:
            return instance.healthy and instance.running
        return instance.completed or instance.running

    def _step(self) -> None:
        now = time.monotonic()
        for instance in self.instances.values():
            if instance.child is None:
                if all(self._satisfies(self.instances[d], c) for d, c in instance.plan.depends.items()):
                    self._launch(instance)
                continue
            code = instance.returncode
            if code is not None:
                self._exited(instance, code)
            elif instance.plan.health is not None and not instance.healthy and now >= instance.next_probe:
                instance.healthy = probe(instance.plan.health, instance.env)
                instance.next_probe = time.monotonic() + self.probe_s

    def _exited(self, instance: Instance, code: int) -> None:
        if instance.completed:
            return
        name = instance.plan.name
        if not instance.plan.one_shot:
            raise StackError(f"{name} exited with {code}" + self._tails([name]))
        if code == 0:
            instance.completed = True
        elif instance.attempts <= instance.plan.retries:
            self._launch(instance)
        else:
            raise StackError(f"{name} failed {instance.attempts} time(s), last exit {code}" + self._tails([name]))

    def _launch(self, instance: Instance) -> None:
        instance.attempts += 1
        instance.log_path.parent.mkdir(parents=True, exist_ok=True)
        with instance.log_path.open("ab") as log:
            log.write(f"--- compose_local: attempt {instance.attempts}: {instance.plan.argv}\n".encode())
        plan = instance.plan
        instance.child = self._call(self.processes.spawn(plan.name, *plan.argv, role=self._roles[plan.name],
                                                         env=instance.env, program=(), cwd=self.workdir))
        instance.child.expected_exit = plan.one_shot  # its exit is read here, not reported as a failure

    def _tails(self, names: Iterable[str]) -> str:
        parts = []
        for name in names:
            instance = self.instances[name]
            parts.append(f"\n--- {instance.log_path} (last lines) ---\n{instance.log_tail()}")
        return "".join(parts)

    # -- down ------------------------------------------------------------------------------------

    def down(self) -> dict[str, int | None]:
        """Stop dependents first (SIGTERM, then SIGKILL after the service's ``stop_grace_period``,
        at most 20 s); returns each instance's exit code (None: never started). Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            try:
                self._call(self.processes.stop(self._stop_order))
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)
                loop.close()
                self._loop = self._thread = None
        return {n: i.returncode for n, i in self.instances.items()}

    def _stop_layers(self) -> list[list[Instance]]:
        depth: dict[str, int] = {}

        def depth_of(name: str) -> int:
            if name not in depth:
                deps = self.instances[name].plan.depends
                depth[name] = 1 + max((depth_of(d) for d in deps), default=-1)
            return depth[name]

        levels = sorted({depth_of(n) for n in self.instances}, reverse=True)
        return [[i for n, i in self.instances.items() if depth_of(n) == level] for level in levels]

    def __enter__(self) -> "LocalStack":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _distinct_free_ports() -> Callable[[], int]:
    """A port allocator that never hands out the same free port twice in one plan."""
    taken: set[int] = set()

    def allocate() -> int:
        while True:
            port = free_port()
            if port not in taken:
                taken.add(port)
                return port

    return allocate


# -- command line ------------------------------------------------------------------------------------


def describe(stack: LocalStack) -> str:
    lines = []
    for name, instance in stack.instances.items():
        ports = ", ".join(f"{c}->{local}" for c, local in sorted(instance.plan.ports.items())) or "-"
        lines.append(f"{name:<12} ports {ports:<24} {' '.join(instance.plan.argv)}")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compose_local.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--file", type=Path, default=COMPOSE_FILE, help="compose file (default compose.yaml)")
    parser.add_argument("--profile", action="append", default=[], help="enable a profile (e.g. sim)")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and volumes (default: a new temp dir)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for the stack (default 60)")
    parser.add_argument("action", choices=["plan", "up"])
    args = parser.parse_args(argv)
    workdir = args.workdir
    if workdir is None and args.action == "plan":  # nothing is written: no new temp dir
        workdir = Path(tempfile.gettempdir()) / "laswrr-compose-plan"
    try:
        stack = LocalStack.from_file(args.file, workdir, args.profile)
    except (ComposeError, FileNotFoundError) as exc:
        print(f"compose_local: {exc}", file=sys.stderr)
        return 2
    print(describe(stack))
    if args.action == "plan":
        return 0
    try:
        stack.up(args.timeout_s)
        print(f"up; logs and volumes in {stack.workdir}; Ctrl-C stops", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while not stack.unexpected_exits():
            time.sleep(0.5)
        print(f"compose_local: exited: {stack.unexpected_exits()}", file=sys.stderr)
        return 1
    except StackError as exc:
        print(f"compose_local: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.down()


if __name__ == "__main__":
    sys.exit(main())
