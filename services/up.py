"""`laswrr up`: the whole stack in one process tree, and ``Stack``, the same thing as a library.

Theory of operation. ``Stack`` owns every part as a child process (``python -m laswrr
<command>``), each in its own session so a terminal's Ctrl-C reaches only ``up``, which then
stops the children in order; each child also gets SIGTERM if ``up`` itself dies (Linux
``PR_SET_PDEATHSIG``; the process handling is ``ChildProcesses`` in services/children.py, the
nodes.toml parser is collectors/nodes.py).

Start order: the data dir's lock (``<data_dir>/up.lock``, services/datadir_lock.py: a second
stack on a data dir in use is refused at once, "data dir ... in use by pid N", before anything
there is touched; a dead holder's lock is taken over) -> NATS (embedded ``nats-server`` under ``<data_dir>/jetstream`` unless a URL is
given; secure by default: one user per role with a random password and the permissions of
services/accounts.py, written to ``<data_dir>/secrets/<role>.env`` as ``NATS_URL=...``, mode
0600; ``secure=False`` keeps an open server) -> streams -> scheduler, recorder -> simulated engines (when no nodes file is given:
one 910C, two 910B, one 910 and one MindIE-flavoured 910B whose free slots and blocks the collector reads from its
``/v1/status`` and whose chips it reads through its simulated npu-exporter (docs/ascend.md), all in pool ``default``
serving one model id, ``SIM_MODEL``; with the proxy's ``tokenizer`` setting the vLLM-flavoured ones count prompts in
its tokens and publish their KV events, ``kv_events`` in their nodes; their nodes file is written to
``<data_dir>/nodes.toml``) ->
registration of every node by publishing ``lb.admin.node.<id>`` (plain JSON, as ``nats pub``
would), waiting until LB_WEIGHTS shows them -> collector (and ``laswrr kv-events`` when some node declares
``kv_events``) -> proxy (``proxy_workers`` N > 1:
``laswrr proxy --workers N``, N processes on the proxy port, proxy ids ``proxy-0`` ..
``proxy-<N-1>``, supervised by that one child: services/proxy/workers.py).
Stop order: proxies (they finish in-flight requests), collector, engines, scheduler, recorder
last (so everything published is recorded: on SIGTERM it records up to the streams' last seqs
as of the stop, for at most its ``--stop-catch-up-s``, e.g. while it recreates consumers after
a NATS leader election), then NATS.

Supervision (``laswrr up``; a library ``Stack`` given ``restart=RestartPolicy()``): a child that
dies on its own (scheduler, recorder, collector, proxy, a simulated engine) is restarted with
the same arguments after a backoff of 0.5 s doubling to at most 10 s, each death logged with its
exit status; meanwhile the proxies keep routing on the last snapshot in LB_WEIGHTS, the
restarted scheduler resumes from its checkpoint and the recorder from its database. The rule
for giving up: a child that dies more than ``--max-restarts`` times (default 5) within 60 s
keeps dying; ``laswrr up`` then stops the rest in order and exits 1. Otherwise it exits only on
SIGINT or SIGTERM (exit 0). ``--max-restarts 0``: the first death stops the stack. A single
embedded nats-server that dies is not restarted (every service reconnects to it on its own);
one whose JetStream store failed a write is (below), in a cluster too.

A full data dir (services/store_watch.py): the recorder's DuckDB file and the embedded
nats-server's JetStream store share it, and a JetStream stream that failed a write (no space
left) stores nothing until nats-server restarts. ``up`` reads the disk's free space and the
server's ``/healthz`` every second, says on its stderr when the disk is short of room and when
JetStream stopped storing, and restarts the server (same port, same store) once the disk has
room again; the services reconnect and the proxies send the events they held.

A NATS cluster (``--nats-cluster N``, N >= 2): N embedded nats-servers (``nats_server.NatsCluster``)
on loopback, joined by routes with their own random password, each with JetStream and its own
store (``<data_dir>/nats-<i>/jetstream``, logs ``<data_dir>/logs/nats-<i>.log``), all with the
same users and permissions. ``up`` waits until the cluster has a JetStream meta leader, then
creates the streams and buckets with ``--stream-replicas`` copies (default: N, at most 5), and
hands every child the URLs of all N servers (``NATS_URL=nats://role:pw@host:p1,...,nats://...@host:pN``),
so each fails over to another server when its own dies. A node that dies is started again (same
ports and store: it rejoins and catches up) after the same backoff as any child, never given up
on: the cluster works on while a majority of it runs. ``--stream-replicas N`` with
``--nats-url`` does the same on an external cluster (the operator's servers, listed comma-separated).

Library API: the one way the stack starts (``laswrr up``, the benchmarks' stacks: bench/stack_adapter.py,
bench/proxy_bench.py, and the demo)::

    stack = Stack(data_dir, nats_url=None, proxy_port=8000, config=None, tick_ms=100, secure=True,
                  allow_upstream=(), proxy_args=(), nats_auth=None, nats_cluster=1, stream_replicas=None)
    await stack.start(nodes=None)   # everything above; nodes: None (sim engines),
                                    # a nodes.toml path, or a list of Node
    stack.nats_url                  # the operator's URL (with its password when secure; a cluster:
                                    # every server's, comma-separated)
    stack.cluster                   # the NatsCluster (--nats-cluster >= 2), else None
    stack.role_url("proxy")         # any role's; children get theirs in $NATS_URL, never in argv
    stack.proxy_url, stack.nodes, stack.nodes_file, stack.children
    # or piece by piece:
    await stack.start_nats(); await stack.start_core()
    nodes = await stack.start_sim_engines(DEFAULT_SIMS, speed=1.0)   # -> list[Node]
    await stack.register(nodes)                                      # waits for LB_WEIGHTS
    stack.write_nodes_file(nodes); await stack.start_collector()
    url = await stack.start_proxy(port=0, extra_args=("--policy", "rr"))  # call again for replicas;
                                  # returns once its /healthz reports "ok" (routing on a snapshot);
                                  # admin_port=P: its --admin-port, probed there
    child = await stack.spawn("name", "sub-command", *args, role="other")  # any laswrr command;
                                  # program=(binary,): any other program (bench engines, peer routers)
    failed = await stack.wait_unexpected_exit()   # the first child that died on its own
    await stack.stop()                            # ordered shutdown; idempotent

Logs of every child go to ``<data_dir>/logs/<name>.log``. The scheduler gets ``--allow-upstream``
for ``allow_upstream`` plus, in ``start``, the hosts of the nodes (``127.0.0.1`` for simulated engines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit
from pathlib import Path
from typing import IO, Any

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from laswrr.collectors import nodes as nodes_toml
from laswrr.collectors.nodes import Node, NodesConfigError
from laswrr.replay.store import DB_FILE
from laswrr.schemas import subjects as sj
from laswrr.services import accounts, settings
from laswrr.services.dashboard.app import DEFAULT_PORT as DASHBOARD_PORT
from laswrr.services.children import Child, ChildProcesses, RestartPolicy, StackError
from laswrr.services.datadir_lock import DataDirInUse, DataDirLock
from laswrr.services.natsbus import (AUTH_ENV, MAX_REPLICAS, NatsAuth, StreamLimits, connect, ensure_streams,
                                     redact_url, wait_jetstream)
from laswrr.services.nats_server import EmbeddedNats, NatsCluster, free_port
from laswrr.services.store_watch import StoreWatch
from laswrr.services.proxy import cli as proxy_cli
from laswrr.services.proxy.config import DEFAULT_HOST, ProxyConfig
from laswrr.services.proxy.workers import STOP_MARGIN_S
from laswrr.schemas.codec import decode_snapshot, encode
from laswrr.schemas.words import NodeRole

log = logging.getLogger("laswrr.up")

DEFAULT_PROXY_HOST = DEFAULT_HOST  # `laswrr up` is a local stack: its proxy is not exposed unless asked
UP_OWN_SETTINGS = ("host", "port", "workers", "proxy_id")  # the proxy settings `Stack` passes itself
STOP_ORDER = ("viewer", "proxy", "collector", "sim-engine", "other", "scheduler", "recorder")
# others: children.DEFAULT_STOP_TIMEOUT_S; the proxy's is its --grace-s default plus what a worker
# parent allows its workers beyond it, plus 5 s; the recorder's is its --stop-catch-up-s default
# (10 s) plus room for the last commits and the drain
STOP_TIMEOUT_S = {"proxy": ProxyConfig().grace_s + STOP_MARGIN_S + 5.0, "recorder": 30.0}


# Simulated engines of the default stack: (node id, chip, capacity[, flavour]). Engines of one pool serve
# one model id (compose's SIM_MODEL default too): chips differ in speed, not in what they answer. A
# ``mindie`` engine is read through its /v1/status and its simulated npu-exporter (sim_ascend_keys).
SIM_MODEL = "sim-llm"
SimSpec = tuple[str, str, int] | tuple[str, str, int, str]
DEFAULT_SIMS: tuple[SimSpec, ...] = (
    ("sim-910c-1", "910C", 16), ("sim-910b-1", "910B", 8), ("sim-910b-2", "910B", 8), ("sim-910-1", "910", 4),
    ("sim-mindie-1", "910B", 8, "mindie"),
)


# -- nodes.toml -----------------------------------------------------------------------------------------


def parse_nodes(document: dict[str, Any]) -> list[Node]:
    """``[[node]]`` tables -> Nodes that can be registered (collectors/nodes.py); StackError names the bad node."""
    try:
        return nodes_toml.parse_nodes(document, registration=True)[0]
    except NodesConfigError as exc:
        raise StackError(str(exc)) from None


def load_nodes(path: str | os.PathLike[str]) -> list[Node]:
    try:
        return nodes_toml.load_nodes(path, registration=True)[0]
    except NodesConfigError as exc:
        raise StackError(str(exc)) from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string (ASCII, \" \\ \uXXXX escapes) is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def render_nodes(nodes: Sequence[Node]) -> str:
    lines = ["# Generated by `laswrr up`: the nodes it started and registered.", ""]
    for node in nodes:
        lines.append("[[node]]")
        up_keys = {"id": node.id, "url": node.url, "pool": node.pool, "chip": node.chip, "capacity": node.capacity,
                   "role": None if node.role == NodeRole.BOTH else node.role, "pd_protocol": node.pd_protocol,
                   "bootstrap_port": node.bootstrap_port}
        fields = {**{key: value for key, value in up_keys.items() if value is not None}, **node.extra}
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in fields.items())
        lines.append("")
    return "\n".join(lines)


def sim_ascend_keys(url: str) -> dict[str, str]:
    """The node keys that read a MindIE-flavoured simulated engine the Ascend way: its status on
    ``/v1/status`` and its chips through its simulated npu-exporter (docs/ascend.md)."""
    base = url.rstrip("/")
    return {"status_url": f"{base}/v1/status", "npu_exporter": f"{base}/sim/npu-exporter"}


def sim_npu_smi_command(url: str, python: str = sys.executable) -> str:
    """The ``npu_smi`` command line (nodes.toml) that samples the simulated engine at ``url``:
    ``curl`` of its GET /sim/npu-smi when curl is installed, else ``sim-npu-smi`` (a Python
    start-up per sample, far dearer: docs/evidence/code-choices.md)."""
    base = url.rstrip("/")
    if shutil.which("curl"):
        return f"curl -sf --max-time 2 {shlex.quote(base + '/sim/npu-smi')}"
    # the sim-engine module alone starts faster than the whole dispatcher
    return f"{shlex.quote(python)} -m laswrr.services.sim_engine.cli sim-npu-smi --url {shlex.quote(base)}"


class Stack:
    """NATS, the services and (optionally) simulated engines as one process tree. See the module doc."""

    def __init__(self, data_dir: str | os.PathLike[str] = settings.DEFAULT_DATA_DIR, *, nats_url: str | None = None,
                 proxy_port: int = settings.DEFAULT_PROXY_PORT, proxy_host: str = DEFAULT_PROXY_HOST,
                 config: str | None = None, tick_ms: int = settings.DEFAULT_TICK_MS,
                 scheduler_args: Sequence[str] = (), python: str = sys.executable,
                 restart: RestartPolicy | None = None, secure: bool = True, allow_upstream: Sequence[str] = (),
                 proxy_args: Sequence[str] = (), nats_auth: NatsAuth | None = None, nats_cluster: int = 1,
                 stream_replicas: int | None = None, proxy_workers: int = 1) -> None:
        if not 1 <= nats_cluster <= MAX_REPLICAS:
            raise StackError(f"--nats-cluster must be in 1..{MAX_REPLICAS}, got {nats_cluster}")
        if nats_cluster > 1 and nats_url is not None:
            raise StackError("--nats-cluster starts embedded servers: it cannot be combined with --nats-url")
        replicas = stream_replicas if stream_replicas is not None else nats_cluster
        servers = MAX_REPLICAS if nats_url is not None else nats_cluster  # an external cluster's size is its own
        if not 1 <= replicas <= servers:
            raise StackError(f"--stream-replicas {replicas} needs at least as many NATS servers "
                             f"(--nats-cluster {nats_cluster})")
        self.nats_cluster = nats_cluster
        self.stream_replicas = replicas
        self.data_dir = Path(data_dir).resolve()
        self.log_dir = self.data_dir / "logs"
        self.secrets_dir = self.data_dir / "secrets"
        self.lock = DataDirLock(self.data_dir)  # one stack per data dir (services/datadir_lock.py)
        self.secure = secure and nats_url is None  # users are generated for the embedded server only
        self.allow_upstream = list(allow_upstream)
        self.proxy_args = tuple(proxy_args)
        self.proxy_workers = proxy_workers
        self.nats_auth = nats_auth or NatsAuth()  # files for an external server (handed on by environment)
        self._role_urls: dict[str, str] = {}
        self.proxy_port = proxy_port
        self.proxy_host = proxy_host
        self.config = config
        self.tick_ms = tick_ms
        self.scheduler_args = tuple(scheduler_args)
        self.python = python
        self.processes = ChildProcesses(self.log_dir, python, STOP_TIMEOUT_S, restart=restart)
        self.nodes: list[Node] = []
        self.nodes_file: Path | None = None
        self.proxy_url: str | None = None
        self.dashboard_url: str | None = None
        self.dashboard_error: str | None = None  # why the dashboard did not start (its port taken, ...)
        self.embedded: EmbeddedNats | None = None
        self.cluster: NatsCluster | None = None
        self._cluster_watch: asyncio.Task[None] | None = None
        self.store_watch = StoreWatch([])  # services/store_watch.py: the data dir's disk and the embedded servers
        self._store_watch: asyncio.Task[None] | None = None
        self._restart = restart
        self._nats_url = nats_url
        self._nc: Client | None = None

    @property
    def nats_url(self) -> str:
        """The operator's URL: what ``nats -s`` and ``laswrr capacity`` need."""
        return self.role_url("operator")

    def role_url(self, role: str) -> str:
        if self._nats_url is None:
            raise StackError("NATS is not started yet")
        return self._role_urls.get(role, self._nats_url)

    # -- starting ---------------------------------------------------------------------------------

    async def start(self, nodes: Sequence[Node] | str | os.PathLike[str] | None = None,
                    sim_speed: float = 1.0, dashboard_port: int | None = None) -> None:
        """Everything, in order; on failure what was started is stopped and StackError raised."""
        try:
            specs = load_nodes(nodes) if isinstance(nodes, (str, os.PathLike)) else nodes
            self.allow_hosts(specs if specs is not None else [], sims=specs is None)
            await self.start_nats()
            await self.start_core()
            if specs is None:  # with the proxy's tokenizer the engines publish their KV events (the exact view)
                specs = await self.start_sim_engines(DEFAULT_SIMS, speed=sim_speed,
                                                     tokenizer=proxy_config(self.proxy_args).tokenizer)
                self.write_nodes_file(specs)
            else:
                self.nodes_file = Path(nodes).resolve() if isinstance(nodes, (str, os.PathLike)) else None
                if self.nodes_file is None:
                    self.write_nodes_file(specs)
            await self.register(specs)
            await self.start_collector()
            await self.start_kv_events(specs)
            await self.start_proxy()
            if dashboard_port is not None:
                with contextlib.suppress(StackError):  # the page is optional: its failure is logged
                    await self.start_dashboard(dashboard_port)
        except BaseException:
            await self.stop()
            raise

    def allow_hosts(self, nodes: Sequence[Node], sims: bool = False) -> None:
        """Add the hosts of ``nodes``' URLs (and, for simulated engines, 127.0.0.1, where they
        listen) to the scheduler's ``--allow-upstream``; call before ``start_core``."""
        urls = [url for node in nodes for url in (node.url, node.metrics_url, node.health_url, node.status_url,
                                                   node.npu_exporter) if url]
        hosts = [urlsplit(url).hostname for url in urls] + (["127.0.0.1"] if sims else [])
        for host in hosts:
            if host and host not in self.allow_upstream:
                self.allow_upstream.append(host)

    async def start_nats(self) -> str:
        try:  # before anything in the data dir is touched: a second stack there is refused at once
            self.lock.acquire()
        except DataDirInUse as exc:
            raise StackError(str(exc)) from None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._nats_url is None:
            passwords = accounts.new_passwords() if self.secure else {}
            config = None
            if passwords:
                config = accounts.write_private(self.secrets_dir / "nats-server.conf", accounts.server_config(
                    passwords, header="# Generated by `laswrr up`: one user per role (services/accounts.py)."))
            if self.nats_cluster > 1:
                self.cluster = NatsCluster(self.data_dir, self.nats_cluster, log_dir=self.log_dir, config_file=config,
                                           monitor=True)  # each node's /healthz, for the store watch
                self.cluster.spawn()  # from the loop's thread: PDEATHSIG follows the spawning thread
                await asyncio.to_thread(self.cluster.wait_ready)
                servers = self.cluster.nodes
                self._nats_url = self.cluster.url
                self._cluster_watch = asyncio.create_task(self._supervise_cluster(), name="nats-cluster")
            else:
                self.embedded = EmbeddedNats(self.data_dir, log_file=str(self.log_dir / "nats.log"), config_file=config,
                                             monitor=True)  # its /healthz, for the store watch
                self.embedded.spawn()
                await asyncio.to_thread(self.embedded.wait_ready)
                servers = [self.embedded]
                self._nats_url = self.embedded.url
            self._role_urls = {role: ",".join(accounts.role_url(role, password, s.host, s.port) for s in servers)
                               for role, password in passwords.items()}
            accounts.write_secrets(self.secrets_dir, self._role_urls)
        what = f"{self.data_dir / DB_FILE} (the recorder's log)" + (", JetStream's store" if self.embedded or
                                                                   self.cluster else "")
        self.store_watch = StoreWatch([(what, self.data_dir)], self.cluster.nodes if self.cluster else
                                      [self.embedded] if self.embedded else [])
        self._store_watch = asyncio.create_task(self.store_watch.run(), name="store-watch")
        try:
            async with contextlib.AsyncExitStack() as scope:  # streams and buckets are the scheduler's to set up
                setup = await connect(self.role_url("scheduler"), "laswrr-up-setup", self.nats_auth)
                scope.push_async_callback(setup.close)
                await self._setup_streams(setup)
            self._nc = await connect(self.nats_url, "laswrr-up", self.nats_auth)
        except Exception as exc:
            raise StackError(f"cannot connect to NATS at {redact_url(self.nats_url)}: {exc}") from None
        return self.nats_url

    async def _setup_streams(self, nc: Client, timeout_s: float = 30.0) -> None:
        """Streams and buckets with ``stream_replicas`` copies, once JetStream answers (a cluster:
        its meta leader elected; a replicated stream also needs enough peers known to it)."""
        waited = await wait_jetstream(nc, timeout_s)
        if self.cluster is not None:
            log.info("NATS cluster of %d: JetStream meta leader elected after %.2f s", self.nats_cluster, waited)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await ensure_streams(nc.jetstream(), StreamLimits(replicas=self.stream_replicas))
                return
            except Exception as exc:  # noqa: BLE001 - e.g. "insufficient resources" while peers join
                if time.monotonic() > deadline:
                    raise
                log.debug("creating the streams: %r; retrying", exc)
                await asyncio.sleep(0.2)

    async def _supervise_cluster(self) -> None:
        """Start a cluster node again when it dies (module doc); logged like any child."""
        assert self.cluster is not None
        policy = self._restart or RestartPolicy()
        deaths: dict[int, list[float]] = {}
        while True:
            await asyncio.sleep(0.2)
            for index, node in enumerate(self.cluster.nodes):
                process = node.process
                if process is None or process.poll() is None or node is self.store_watch.restarting:
                    continue
                now = time.monotonic()
                recent = deaths[index] = [t for t in deaths.get(index, []) if now - t <= policy.window_s] + [now]
                backoff = policy.backoff_s(len(recent))
                log.error("nats-%d (pid %d) exited unexpectedly with %s; restarting it in %g s", index + 1,
                          process.pid, process.returncode, backoff)
                await asyncio.sleep(backoff)
                node.spawn()  # this task runs in the loop's thread: PDEATHSIG follows it
                try:
                    await asyncio.to_thread(node.wait_ready)
                except (RuntimeError, TimeoutError) as exc:
                    log.error("restarting nats-%d failed: %s", index + 1, exc)
                    continue
                assert node.process is not None
                log.info("started nats-%d (pid %d) at %s", index + 1, node.process.pid, node.url)

    async def start_core(self) -> None:
        args = ["--tick-ms", str(self.tick_ms), *(f"--allow-upstream={p}" for p in self.allow_upstream),
                *self.scheduler_args, *self._replicas_args()]
        if self.config:
            args += ["--config", self.config]
        await self.spawn("scheduler", "scheduler", *args, role="scheduler")
        await self.spawn("recorder", "recorder", "--data-dir", str(self.data_dir), *self._replicas_args(),
                         role="recorder")

    def _replicas_args(self) -> tuple[str, ...]:
        """``--stream-replicas`` for a child that creates missing streams (none when 1, the default)."""
        return ("--stream-replicas", str(self.stream_replicas)) if self.stream_replicas != 1 else ()

    async def start_sim_engines(self, sims: Sequence[SimSpec] = DEFAULT_SIMS, speed: float = 1.0,
                                pool: str = "default", npu_smi: bool = True,
                                model: str = SIM_MODEL, kv_tokens: int | None = None,
                                engine_args: Mapping[str, Sequence[str]] | None = None,
                                tokenizer: str | None = None) -> list[Node]:
        """One ``laswrr sim-engine`` per ``(node id, chip, capacity)``, each serving ``model``; their
        Nodes (not yet registered). ``npu_smi``: the collector samples each one's simulated
        npu-smi (``sim_npu_smi_command``). ``kv_tokens``: every engine's KV room (default: the chip's).
        ``engine_args``: more sim-engine flags per node id (e.g. ``--pd-role``). ``tokenizer``: the
        model's tokenizer directory: each vLLM-flavoured engine counts its prompts in its tokens and
        publishes its KV events (``--kv-events`` and ``--kv-events-replay`` on free ports, named by
        its Node's ``kv_events`` keys)."""
        more = engine_args or {}
        kv_args = () if kv_tokens is None else ("--kv-tokens", str(kv_tokens))
        flavours = [spec[3] if len(spec) > 3 else "vllm" for spec in sims]  # type: ignore[misc]
        events: list[dict[str, str]] = [
            {"kv_events": f"tcp://127.0.0.1:{free_port()}", "kv_events_replay": f"tcp://127.0.0.1:{free_port()}"}
            if tokenizer is not None and flavour == "vllm" else {} for flavour in flavours]
        children = await asyncio.gather(*(
            self.spawn(spec[0], "sim-engine", "--port", "0", "--chip", spec[1], "--capacity", str(spec[2]),
                       "--node-id", spec[0], "--speed", str(speed), "--model", model, *kv_args, *more.get(spec[0], ()),
                       *(("--flavour", flavour) if flavour != "vllm" else ()),
                       *(("--kv-events", kv["kv_events"], "--kv-events-replay", kv["kv_events_replay"],
                          "--tokenizer", str(Path(tokenizer).resolve())) if kv and tokenizer is not None else ()),
                       role="sim-engine", wait_listening=True)
            for spec, flavour, kv in zip(sims, flavours, events)))
        specs = []
        for child, spec, flavour, kv in zip(children, sims, flavours, events):
            node_id, chip, capacity = spec[0], spec[1], spec[2]
            assert child.url is not None
            if flavour == "mindie":
                keys = sim_ascend_keys(child.url)
                extra: dict[str, str] = {"engine": "mindie", **keys} if npu_smi else {"status_url": keys["status_url"]}
                specs.append(Node(id=node_id, url=child.url, pool=pool, chip=chip, capacity=capacity, engine="mindie",
                                  status_url=keys["status_url"], npu_exporter=keys["npu_exporter"] if npu_smi else None,
                                  extra=extra))
                continue
            extra = {"npu_smi": sim_npu_smi_command(child.url, self.python)}
            specs.append(Node(id=node_id, url=child.url, pool=pool, chip=chip, capacity=capacity,
                              npu_smi=extra["npu_smi"] if npu_smi else None,
                              extra={**(extra if npu_smi else {}), **kv}))
        return specs

    def write_nodes_file(self, nodes: Sequence[Node], path: str | os.PathLike[str] | None = None) -> Path:
        target = Path(path) if path else self.data_dir / "nodes.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render_nodes(nodes))
        self.nodes_file = target
        return target

    async def register(self, nodes: Sequence[Node], wait_s: float | None = 15.0) -> None:
        """Publish ``lb.admin.node.<id>`` per node; then wait until LB_WEIGHTS shows each one."""
        assert self._nc is not None, "start_nats() first"
        js = self._nc.jetstream()
        registered: dict[str, int] = {}
        for node in nodes:
            ack = await js.publish(sj.admin_node(node.id), encode(node.registration()))
            registered[node.id] = ack.seq
        self.nodes = [n for n in self.nodes if n.id not in registered] + list(nodes)
        if wait_s:
            await self._wait_registered(nodes, max(registered.values(), default=0), wait_s)

    async def _wait_registered(self, nodes: Sequence[Node], seq: int, wait_s: float) -> None:
        assert self._nc is not None
        kv = await self._nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
        deadline = time.monotonic() + wait_s
        missing = {n.id for n in nodes}
        while missing:
            for pool in sorted({n.pool for n in nodes}):
                with contextlib.suppress(KeyNotFoundError):
                    snapshot = decode_snapshot((await kv.get(pool)).value or b"")
                    if snapshot.as_of_seq >= seq:
                        missing -= {v.node for v in snapshot.nodes}
            if missing and time.monotonic() > deadline:
                raise StackError(f"nodes {', '.join(sorted(missing))} not in {sj.WEIGHTS_BUCKET} after {wait_s:g} s: "
                                 f"is the scheduler running? (see {self.log_dir / 'scheduler.log'})")
            if missing:
                await asyncio.sleep(0.1)

    async def start_collector(self, nodes_file: str | os.PathLike[str] | None = None) -> Child | None:
        path = nodes_file or self.nodes_file
        if path is None:
            return None
        return await self.spawn("collector", "collector", "--nodes", str(path), *self._replicas_args(),
                                role="collector")

    async def start_kv_events(self, nodes: Sequence[Node]) -> Child | None:
        """``laswrr kv-events`` when some node declares ``kv_events`` (its engine publishes its KV
        cache events); it runs with the collector's credentials, whose role publishes ``lb.kv.>``."""
        if not any(node.extra.get("kv_events") for node in nodes):
            return None
        return await self.spawn("kv-events", "kv-events", role="collector")

    async def start_dashboard(self, port: int = 0) -> str:
        """``laswrr dashboard`` on the live stack (services/dashboard/); returns its URL, or
        StackError (logged) when it cannot start (its port taken, say)."""
        try:
            child = await self.spawn("dashboard", "dashboard", "--host", self.proxy_host, "--port", str(port),
                                     role="viewer", wait_listening=True)  # read-only credentials
        except StackError as exc:
            log.warning("dashboard not started: %s", exc)
            self.dashboard_error = str(exc)
            for dead in [c for c in self.children if c.name == "dashboard"]:  # not listed as running
                if dead.process.returncode is None:
                    dead.process.kill()
                    await dead.process.wait()
                self.children.remove(dead)
            raise
        assert child.url is not None
        self.dashboard_url = child.url
        return child.url

    async def start_proxy(self, port: int | None = None, extra_args: Sequence[str] = (),
                          name: str | None = None, admin_port: int | None = None) -> str:
        """One proxy replica; returns its URL (port 0 picks a free one). Call again for more.
        ``admin_port``: its ``--admin-port`` (/metrics and the probes there; with workers, worker
        k's on ``admin_port + k``); the stack's ``proxy_args`` may give it too (``laswrr up
        --proxy-arg admin-port=P``): the probes are then asked there."""
        replicas = sum(1 for c in self.children if c.role == "proxy")
        name = name or ("proxy" if replicas == 0 else f"proxy-{replicas + 1}")
        port = self.proxy_port if port is None else port
        workers = ("--workers", str(self.proxy_workers)) if self.proxy_workers > 1 else ()
        admin = ("--admin-port", str(admin_port)) if admin_port is not None else ()
        child = await self.spawn(name, "proxy", "--host", self.proxy_host, "--port", str(port), "--proxy-id", name,
                                 *self._replicas_args(), *workers, *admin, *self.proxy_args, *extra_args, role="proxy",
                                 wait_listening=True)
        assert child.url is not None
        probe_port = proxy_config(self.proxy_args).admin_port if admin_port is None else admin_port
        if probe_port != 0:  # 0: each picked a free port of its own, unknown here; nothing to ask
            probes = child.url if probe_port is None else \
                f"http://{urlsplit(child.url).netloc.rsplit(':', 1)[0]}:{probe_port}"
            await self._wait_routing(child, probes)
        self.proxy_url = self.proxy_url or child.url
        return child.url

    async def _wait_routing(self, child: Child, probes: str, timeout_s: float = 10.0) -> None:
        """Until the proxy's /healthz (at ``probes``) says it routes on a snapshot ("ok"); a warning if not."""
        import aiohttp

        deadline = time.monotonic() + timeout_s
        status = "unreachable"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while time.monotonic() < deadline and child.process.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with session.get(f"{probes}/healthz") as response:
                        status = str((await response.json(content_type=None)).get("status"))
                if status == "ok" or (status == "no_snapshot" and not self.nodes):
                    return
                await asyncio.sleep(0.1)
        log.warning("%s not routing yet after %g s (healthz status %s)", child.name, timeout_s, status)

    # -- children and stopping -----------------------------------------------------------------

    @property
    def children(self) -> list[Child]:
        return self.processes.children

    async def spawn(self, name: str, command: str, *args: str, role: str = "other",
                    wait_listening: bool = False, program: Sequence[str] | None = None) -> Child:
        """Start ``python -m laswrr COMMAND ARGS`` (``program``: ``PROGRAM COMMAND ARGS``) as a
        child; with ``wait_listening``, wait for its ``... listening on URL`` stdout line and
        record the URL (services/children.py). Its NATS credentials come in its environment
        (``child_env``), never in its arguments."""
        return await self.processes.spawn(name, command, *args, role=role, wait_listening=wait_listening,
                                          env=self.child_env(role), program=program)

    def child_env(self, role: str) -> dict[str, str]:
        """The environment of a child: ``NATS_URL`` of its role (``other``: the operator's; an
        engine: none) and the credential files of an external server, nothing inherited of either."""
        env = {k: v for k, v in os.environ.items()
               if k != "NATS_URL" and k not in AUTH_ENV.values() and not k.startswith("LASWRR_NATS_")}
        if role != "sim-engine" and self._nats_url is not None:
            env["NATS_URL"] = self.role_url(role if role in accounts.ROLES else "operator")
            env.update(self.nats_auth.env())
        return env

    async def wait_unexpected_exit(self) -> Child:
        """The first child that exits while the stack runs (not during ``stop``)."""
        return await self.processes.wait_unexpected_exit()

    async def stop(self) -> None:
        """Ordered shutdown: proxies, collector, engines, scheduler, recorder, then NATS (idempotent)."""
        if self._store_watch is not None:  # no restart of nats-server while the stack stops
            self._store_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._store_watch
            self._store_watch = None
        unnamed = tuple(r for r in self.processes.roles() if r not in STOP_ORDER)
        await self.processes.stop(STOP_ORDER + unnamed)  # a role the order forgets stops too
        if self._cluster_watch is not None:
            self._cluster_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cluster_watch
            self._cluster_watch = None
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        self.lock.release()


# -- laswrr up ------------------------------------------------------------------------------------------


def laswrr_command() -> str:
    """How to run this laswrr from a shell: ``laswrr`` when that is on PATH and is this one,
    else the script beside this Python (``.venv/bin/laswrr``: a venv that is not activated)."""
    beside = Path(sys.executable).parent / "laswrr"
    on_path = shutil.which("laswrr")
    if on_path and (not beside.exists() or Path(on_path).resolve() == beside.resolve()):
        return "laswrr"
    if beside.exists():
        with contextlib.suppress(ValueError):
            return str(beside.relative_to(Path.cwd()))
        return str(beside)
    return f"{sys.executable} -m laswrr"


def banner(stack: Stack, out: IO[str]) -> None:
    where = f"embedded, JetStream store in {stack.data_dir / 'jetstream'}" if stack.embedded else "external"
    if stack.cluster is not None:
        where = (f"embedded cluster of {len(stack.cluster.nodes)}, streams with {stack.stream_replicas} replicas, "
                 f"stores in {stack.data_dir}/nats-<i>/jetstream")
    elif stack.stream_replicas > 1:
        where += f", streams with {stack.stream_replicas} replicas"
    print(f"laswrr up: running (data dir {stack.data_dir}, logs in {stack.log_dir})", file=out)
    operator_env = stack.secrets_dir / "operator.env"
    if stack.secure:
        print(f"  NATS:      {redact_url(stack.nats_url)}  ({where}; one user per role, credentials in "
              f"{stack.secrets_dir}/<role>.env)", file=out)
        print(f"  operator:  {redact_url(stack.nats_url)}  (password in {operator_env}: "
              f"export $(cat {operator_env}))", file=out)
    else:
        print(f"  NATS URL:  {redact_url(stack.nats_url)}  ({where}{', open: no authentication' if stack.embedded else ''})",
              file=out)
    api = ("  (OpenAI API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, ...; "
           "\"model\": a pool name, e.g. \"default\", or its engines' model id)")
    workers = f" ({stack.proxy_workers} workers)" if stack.proxy_workers > 1 and stack.proxy_url else ""
    print(f"  proxy URL: {stack.proxy_url or 'none (laswrr proxy not available)'}{workers}"
          + (api if stack.proxy_url else ""), file=out)
    if stack.proxy_url:
        for line in proxy_lines(stack.proxy_args):
            print(f"  {line}", file=out)
    if stack.dashboard_url:
        print(f"  dashboard: {stack.dashboard_url}", file=out)
    elif stack.dashboard_error:
        print(f"  dashboard: NOT STARTED: {stack.dashboard_error}", file=out)
    for index, server in enumerate(stack.cluster.nodes if stack.cluster else []):
        pid = server.process.pid if server.process else None
        print(f"  {'nats':<10} {f'nats-{index + 1}':<12} pid {pid}  {server.url}", file=out)
    for child in stack.children:
        print(f"  {child.role:<10} {child.name:<12} pid {child.pid}{'  ' + child.url if child.url else ''}", file=out)
    for node in stack.nodes:
        chip = node.chip or "unknown"  # what the scheduler calls a node registered without one
        print(f"  node       {node.id:<12} {chip:<5} capacity {node.capacity:<3} pool {node.pool:<8} {node.url}",
              file=out)
    if stack.nodes_file:
        print(f"  nodes file: {stack.nodes_file}", file=out)
    node = stack.nodes[0].id if stack.nodes else "<node>"
    pool = stack.nodes[0].pool if stack.nodes else "default"
    print("operator commands:", file=out)
    if stack.secure:
        print(f"  export $(cat {operator_env})", file=out)
    else:
        print(f"  export NATS_URL={redact_url(stack.nats_url)}", file=out)
    print(f"  nats -s \"$NATS_URL\" pub lb.admin.capacity.{node} '{{\"capacity\": 1}}'", file=out)
    print(f"  nats -s \"$NATS_URL\" sub '{sj.OUT_ALL}'", file=out)
    print(f"  nats -s \"$NATS_URL\" kv get LB_WEIGHTS {pool}", file=out)
    cli = laswrr_command()
    print(f"  {cli} nodes", file=out)
    print(f"  {cli} capacity {node} 1   (also: drain, undrain, remove, register, config)", file=out)
    print("Ctrl-C (SIGINT) or SIGTERM stops everything.", file=out, flush=True)


def proxy_config(proxy_args: Sequence[str]) -> ProxyConfig:
    """The configuration ``laswrr proxy PROXY_ARGS`` runs with."""
    return proxy_cli.config_from_args(proxy_cli.parser().parse_args([*proxy_args, "--proxy-id", "proxy"]))


def proxy_lines(proxy_args: Sequence[str]) -> list[str]:
    """What the banner says of the proxy's flow control and API keys (``proxy_args``: its flags)."""
    config = proxy_config(proxy_args)
    if config.flow_control:
        flow = ("flow control: on: requests no node can take yet are held (by priority band, fair between API "
                "keys); a full queue or an expired wait is answered 429 with Retry-After; held requests: the "
                "gauge laswrr_proxy_queue_depth on the proxy's /metrics (--no-flow-control: off)")
    else:
        flow = "flow control: off: requests beyond the engines' slots queue in the engines (--flow-control: on)"
    if config.api_keys_file is None:
        keys = "API keys: none: the proxy is open to anyone who reaches it (--api-keys FILE: keys required)"
    else:
        limit = f"; at most {config.key_max_inflight} in flight per key" if config.key_max_inflight else ""
        keys = (f"API keys: required: clients must send Authorization: Bearer <key> (keys in {config.api_keys_file}; "
                f"without a known key: 401){limit}")
    return [flow, keys]


async def run_up(args: argparse.Namespace) -> int:
    stop = settings.stop_event()
    restart = RestartPolicy(max_restarts=args.max_restarts) if args.max_restarts > 0 else None
    proxy: ProxyConfig = args.proxy
    if proxy.api_keys_file is not None:
        proxy = dataclasses.replace(proxy, api_keys_file=str(Path(proxy.api_keys_file).resolve()))
    proxy_args = proxy_cli.proxy_argv(proxy, skip=UP_OWN_SETTINGS)
    try:
        stack = Stack(args.data_dir, nats_url=args.nats_url, proxy_port=proxy.port, proxy_host=proxy.host,
                      config=args.config, tick_ms=args.tick_ms, restart=restart, secure=not args.insecure,
                      allow_upstream=args.allow_upstream or (), proxy_args=proxy_args,
                      nats_auth=settings.nats_auth(args), nats_cluster=args.nats_cluster,
                      stream_replicas=args.stream_replicas, proxy_workers=proxy.workers)
    except StackError as exc:
        _say(f"laswrr up: {exc}", sys.stderr)
        return 2
    try:
        return await _run_stack(stack, args, stop)
    finally:  # whatever happened (even a closed stdout), nothing is left running
        await stack.stop()


async def _run_stack(stack: Stack, args: argparse.Namespace, stop: asyncio.Event) -> int:
    starting = asyncio.create_task(stack.start(args.nodes, sim_speed=args.sim_speed,
                                               dashboard_port=args.dashboard_port))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal during start-up
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        return 0
    stopped.cancel()
    try:
        starting.result()
    except StackError as exc:
        _say(f"laswrr up: {exc}", sys.stderr)
        return 1
    except Exception as exc:  # NATS refusing the streams, a port taken, ...: one line, not a traceback
        _say(f"laswrr up: cannot start: {type(exc).__name__}: {exc}", sys.stderr)
        return 1
    with contextlib.suppress(OSError):
        banner(stack, sys.stdout)
    failed = asyncio.create_task(stack.wait_unexpected_exit())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if failed.done():
        child = failed.result()
        again = f" after {child.restarts} restart(s)" if child.restarts else ""
        _say(f"laswrr up: {child.name} (pid {child.pid}) exited unexpectedly with {child.process.returncode}{again}; "
             f"stopping the rest. Last lines of {child.log_path}:\n{child.tail()}", sys.stderr)
        await stack.stop()
        return 1
    failed.cancel()
    _say("laswrr up: stopping (proxies, collector, engines, scheduler, recorder, NATS)", sys.stdout)
    await stack.stop()
    _say("laswrr up: stopped", sys.stdout)
    return 0


def _say(text: str, stream: IO[str]) -> None:
    with contextlib.suppress(OSError):
        print(text, file=stream, flush=True)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("up", help="run NATS, scheduler, recorder, collector and proxy together",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", metavar="nodes.toml", default=None,
                        help=f"[[node]] tables (id, url, pool, chip, capacity); default: {len(DEFAULT_SIMS)} simulated "
                             "engines")
    settings.add_nats_options(parser, embedded=True)
    parser.add_argument("--nats-cluster", type=settings.replicas, default=1, metavar="N",
                        help=f"start N embedded nats-servers as one cluster on loopback (1..{MAX_REPLICAS}; default "
                             "%(default)s: a single server); the streams get N replicas unless --stream-replicas says")
    settings.add_stream_replicas(parser, default=None, help=(
        f"copies of LB_EVENTS, LB_OUT and the buckets where they are created (1..{MAX_REPLICAS}; default: the "
        "--nats-cluster size; with --nats-url, on the operator's cluster); an existing stream keeps its own"))
    parser.add_argument("--data-dir", default=settings.DEFAULT_DATA_DIR, metavar="DIR",
                        help=f"JetStream store, recorded events, logs (default ./{settings.DEFAULT_DATA_DIR})")
    proxy_cli.add_up_arguments(parser)  # --proxy-host, --proxy-port, --proxy-workers, --flow-control, ...
    parser.add_argument("--proxy-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any other proxy setting, by its name or flag (queue_bound=256, key-max-inflight=4; "
                             "repeatable; docs/configuration.md lists them); wins over "
                             "the --config file's [proxy] table (default: none)")
    parser.add_argument("--dashboard-port", type=settings.port_number, default=DASHBOARD_PORT,
                        help="the dashboard page's port (default %(default)s; 0 picks a free one)")
    parser.add_argument("--config", metavar="FILE.toml", default=None,
                        help="configuration file, keys as docs/configuration.md lists them: a [scheduler] table "
                             "(scheduler keys) and a [proxy] table (the proxy's settings, e.g. queue_bound = 256)")
    parser.add_argument("--tick-ms", type=settings.duration("ms"), default=settings.DEFAULT_TICK_MS, help="scheduler tick period")
    parser.add_argument("--sim-speed", type=float, default=1.0, help="speed factor of the simulated engines")
    parser.add_argument("--max-restarts", type=int, default=RestartPolicy().max_restarts, metavar="N",
                        help=f"restart a child that dies, unless it died more than N times within "
                             f"{RestartPolicy().window_s:g} s: then stop everything and exit 1 (default "
                             f"{RestartPolicy().max_restarts}; 0: the first death stops the stack)")
    parser.add_argument("--insecure", action="store_true",
                        help="embedded NATS without users or permissions, as before (experiments only)")
    parser.add_argument("--allow-upstream", action="append", default=None, metavar="PATTERN",
                        help="upstream hosts the scheduler accepts besides the nodes' own (repeatable)")
    settings.add_logging(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "up")
    if args.proxy_workers is not None and args.proxy_workers < 1:
        print("laswrr up: --proxy-workers must be >= 1", file=sys.stderr)
        return 2
    if args.nodes is not None:
        try:
            load_nodes(args.nodes)
        except StackError as exc:
            print(f"laswrr up: {exc}", file=sys.stderr)
            return 2
    table: dict[str, Any] = {}
    if args.config is not None:
        from laswrr.scheduler import config as config_mod

        try:
            config_mod.load_file(args.config)
            table = proxy_table(args.config)
        except (OSError, ValueError) as exc:
            print(f"laswrr up: bad --config {args.config}: {exc}", file=sys.stderr)
            return 2
        args.config = str(Path(args.config).resolve())
    try:
        args.proxy = proxy_cli.up_settings(args, table, args.proxy_arg)
    except ValueError as exc:
        print(f"laswrr up: {exc}", file=sys.stderr)
        return 2
    if args.proxy.api_keys_file is not None:
        from laswrr.services.proxy.keys import keys_file_problem

        if problem := keys_file_problem(args.proxy.api_keys_file):
            print(f"laswrr up: {problem}", file=sys.stderr)
            return 2
    return asyncio.run(run_up(args))


def proxy_table(path: str) -> dict[str, Any]:
    """The ``[proxy]`` table of ``laswrr up --config FILE`` (the proxy's settings by name)."""
    import tomllib

    with open(path, "rb") as handle:
        table = tomllib.load(handle).get("proxy", {})
    if not isinstance(table, dict):
        raise ValueError("[proxy] must be a table of the proxy's settings")
    return table
