"""Operator commands with feedback: `laswrr capacity|drain|undrain|remove|register|nodes`.

Each write command publishes exactly what the stock `nats` CLI would (``nats pub
lb.admin.capacity.n1 '{"capacity": 1}'``: plain JSON, no headers), but through JetStream so the
publish ack names the event's stream sequence S. It subscribed to ``lb.out.>`` beforehand and
waits (``--wait``, default 3 s) for the outcome:

* ``lb.out.rejected`` with ``as_of_seq == S``: prints ``rejected: <reason>``, exit 1;
* any other output with ``as_of_seq >= S``: the scheduler applies inputs in order and publishes a
  rejection before any later output, so S was applied. It then waits a little longer for a
  snapshot showing the node, prints ``applied: ...``, exit 0;
* nothing in time: exit 3 (the event stays in the log and is applied when a scheduler runs).

``laswrr nodes`` reads the latest snapshot of each pool from KV LB_WEIGHTS and prints one table
per pool (``--json`` prints the snapshots as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError, NotFoundError

from laswrr.collectors.nodes import REGISTERED_COLLECTOR_KEYS, Node, NodesConfigError, load_nodes
from laswrr.schemas import subjects as sj
from laswrr.schemas.events import ENGINE_NAMES
from laswrr.services import settings
from laswrr.services.natsbus import NatsAuth, connect, redact_url

EXIT_APPLIED, EXIT_REJECTED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
DESCRIBE_GRACE_S = 0.5  # after the proof of application, time allowed for a snapshot with the node


class OperatorError(Exception):
    """A one-line error for stderr (bad argument, NATS unreachable)."""


# -- the outcome of one published admin event (pure) ------------------------------------------------


@dataclass
class Outcome:
    """Folds the ``lb.out.*`` messages seen after publishing event ``seq`` for ``node``."""

    seq: int
    node: str | None
    rejected: str | None = None
    applied: bool = False
    phases: list[dict[str, Any]] = field(default_factory=list)
    view: dict[str, Any] | None = None
    pool: str | None = None

    def observe(self, subject: str, payload: dict[str, Any]) -> None:
        as_of = payload.get("as_of_seq")
        if as_of is None and subject == sj.OUT_REJECTED:
            as_of = payload.get("seq")  # a scheduler from before rejections carried as_of_seq
        if not isinstance(as_of, int) or as_of < self.seq:
            return
        if subject == sj.OUT_REJECTED and as_of == self.seq:
            self.rejected = str(payload.get("reason", "no reason given"))
            return
        self.applied = True
        if subject.startswith(sj.OUT_PHASE + ".") and as_of == self.seq and payload.get("node") == self.node:
            self.phases.append(payload)
        elif subject.startswith(sj.OUT_SNAPSHOT + ".") and self.view is None:
            for node in payload.get("nodes", []):
                if node.get("node") == self.node:
                    self.view, self.pool = node, payload.get("pool")

    @property
    def described(self) -> bool:
        removed = any(p.get("to") == "removed" for p in self.phases)
        return self.rejected is not None or (self.applied and (self.view is not None or removed))

    def summary(self, subject: str) -> str:
        if self.rejected is not None:
            return f"rejected: {self.rejected}"
        parts = [f"applied: {subject} (seq {self.seq})"]
        for phase in self.phases:
            parts.append(f"{phase.get('node')} {phase.get('from')} -> {phase.get('to')} ({phase.get('reason')})")
        if self.view is not None:
            view = self.view
            parts.append(f"{view['node']} in pool {self.pool}: phase {view['phase']}, capacity {view['capacity']}, "
                         f"target {view['target_weight']:g}, effective {view['effective_weight']:g}, "
                         f"in-flight {view['inflight']}")
        return "; ".join(parts)


# -- publishing ---------------------------------------------------------------------------------------


async def open_connection(url: str, reconnect: bool = False, auth: NatsAuth | None = None) -> Client:
    """One connection for one command; ``reconnect``: it outlives a NATS restart (``--watch``)."""
    options: dict[str, Any] = {} if reconnect else dict(allow_reconnect=False, max_reconnect_attempts=1,
                                                         reconnect_time_wait=0.2)
    try:
        return await connect(url, "laswrr-operator", auth, connect_timeout=3, error_cb=_quiet, **options)
    except Exception as exc:
        raise OperatorError(f"cannot connect to NATS at {redact_url(url)}: {exc or type(exc).__name__}") from None


async def _quiet(exc: Exception) -> None:
    """nats-py logs a traceback per failed attempt by default; the caller reports one line."""


async def publish_and_wait(url: str, subject: str, payload: bytes, node: str | None, wait_s: float,
                           auth: NatsAuth | None = None) -> Outcome | None:
    """Publish one admin event like `nats pub` and fold the outputs until decided or ``wait_s``."""
    nc = await open_connection(url, auth=auth)
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    try:
        await nc.subscribe("lb.out.>", cb=queue.put)
        await nc.flush()
        try:
            ack = await nc.jetstream().publish(subject, payload, timeout=max(wait_s, 1.0))
        except Exception as exc:
            raise OperatorError(f"publish to {subject} failed (is stream LB_EVENTS set up?): {exc}") from None
        outcome = Outcome(seq=ack.seq, node=node)
        await _fold_until(queue, outcome, time.monotonic() + wait_s)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return outcome if (outcome.applied or outcome.rejected is not None) else None


async def _fold_until(queue: asyncio.Queue[Msg], outcome: Outcome, deadline: float) -> None:
    applied_at: float | None = None
    while not outcome.described:
        now = time.monotonic()
        limit = deadline if applied_at is None else min(deadline, applied_at + DESCRIBE_GRACE_S)
        if now >= limit:
            return
        try:
            msg = await asyncio.wait_for(queue.get(), limit - now)
        except asyncio.TimeoutError:
            return
        with contextlib.suppress(ValueError):
            payload = json.loads(msg.data)
            if isinstance(payload, dict):
                outcome.observe(msg.subject, payload)
        if outcome.applied and applied_at is None:
            applied_at = time.monotonic()


def run_write(args: argparse.Namespace, subject: str, body: dict[str, Any], node: str | None) -> int:
    payload = json.dumps(body).encode()
    try:
        outcome = asyncio.run(publish_and_wait(args.nats_url, subject, payload, node, args.wait,
                                               settings.nats_auth(args)))
    except OperatorError as exc:
        print(f"laswrr: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if outcome is None:
        print(f"timeout: no outcome for {subject} within {args.wait:g} s; is a scheduler running? "
              "(the event is in the log and will be applied when one is)", file=sys.stderr)
        return EXIT_TIMEOUT
    print(outcome.summary(subject))
    return EXIT_REJECTED if outcome.rejected is not None else EXIT_APPLIED


def _subject(builder: Any, node: str) -> str:
    try:
        return str(builder(node))
    except sj.SubjectError as exc:
        raise OperatorError(str(exc)) from None


def _write(builder: Any, body_of: Any) -> Any:
    def handler(args: argparse.Namespace) -> int:
        try:
            subject = _subject(builder, args.node)
        except OperatorError as exc:
            print(f"laswrr: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return run_write(args, subject, body_of(args), args.node)
    return handler


def _register_body(args: argparse.Namespace) -> dict[str, Any]:
    given = {key: getattr(args, key) for key in REGISTERED_COLLECTOR_KEYS if getattr(args, key) is not None}
    node = Node(id=args.node, url=args.url, pool=args.pool, chip=args.chip or None, capacity=args.capacity,
                extra=given)
    return node.registration()


def nodes_file_bodies(path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(subject, lb.admin.node body)`` per ``[[node]]`` of a nodes.toml (``Node.registration``),
    validated by collectors/nodes.py before anything is published."""
    try:
        nodes, _ = load_nodes(path, registration=True)
    except NodesConfigError as exc:
        raise OperatorError(str(exc)) from None
    return [(sj.admin_node(node.id), node.registration()) for node in nodes]


def run_register(args: argparse.Namespace) -> int:
    """One NODE from the flags, or every node of ``--nodes FILE`` (exit code: the worst outcome)."""
    single = (args.node, args.url, args.capacity)
    if args.nodes is None and None in single:
        print("laswrr: register needs NODE, --url and --capacity (or --nodes FILE)", file=sys.stderr)
        return EXIT_USAGE
    if args.nodes is None:
        return int(_write(sj.admin_node, _register_body)(args))
    if single != (None, None, None):
        print("laswrr: register --nodes FILE takes no NODE, --url or --capacity", file=sys.stderr)
        return EXIT_USAGE
    try:
        bodies = nodes_file_bodies(args.nodes)
    except OperatorError as exc:
        print(f"laswrr: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return max(run_write(args, subject, body, subject.rsplit(".", 1)[1]) for subject, body in bodies)


# -- laswrr nodes -------------------------------------------------------------------------------------


async def read_snapshots(url: str, auth: NatsAuth | None = None) -> dict[str, dict[str, Any]]:
    nc = await open_connection(url, auth=auth)
    try:
        return await _snapshots(nc, url)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _snapshots(nc: Client, url: str) -> dict[str, dict[str, Any]]:
    """Every pool's latest snapshot in KV LB_WEIGHTS (OperatorError when there is no bucket)."""
    try:
        kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NotFoundError):
        raise OperatorError(f"no KV bucket {sj.WEIGHTS_BUCKET} on {redact_url(url)}: has a scheduler ever run there?") from None
    except NoKeysError:
        return {}
    snapshots: dict[str, dict[str, Any]] = {}
    for key in sorted(keys):
        with contextlib.suppress(KeyNotFoundError, ValueError):
            snapshots[key] = json.loads((await kv.get(key)).value or b"null")
    return snapshots


def _age(ms: Any) -> str:
    return "—" if ms is None else f"{ms / 1000:.1f} s"


def render_tables(snapshots: dict[str, dict[str, Any]], now_ns: int) -> list[Any]:
    from rich.table import Table

    tables = []
    for pool, snap in snapshots.items():
        updated = (now_ns - int(snap.get("ts_ns", 0))) / 1e9
        panic = " [bold red]PANIC[/]" if snap.get("panic") else ""
        table = Table(title=f"pool {pool}: as_of_seq {snap.get('as_of_seq')}, tick {snap.get('tick')}, "
                            f"updated {updated:.1f} s ago{panic}", title_justify="left")
        for column in ("node", "phase", "routable", "cap", "target", "effective", "in-flight",
                       "queue", "run", "kv", "npu", "lat", "load", "sample age"):
            table.add_column(column, justify="left" if column in ("node", "phase") else "right")
        for node in snap.get("nodes", []):
            load = node.get("load") or {}
            age = _age(load.get("sample_age_ms")) + (" (stale)" if load.get("stale") else "")
            table.add_row(
                node["node"], node["phase"], "yes" if node.get("routable") else "no", str(node.get("capacity")),
                f"{node.get('target_weight', 0):g}", f"{node.get('effective_weight', 0):g}", str(node.get("inflight")),
                *(f"{load.get(k, 0):.2f}" for k in ("queue", "running", "kv", "npu", "latency", "load")), age,
            )
        tables.append(table)
    return tables


def _only_pool(snapshots: dict[str, dict[str, Any]], pool: str | None) -> dict[str, dict[str, Any]]:
    if pool is None:
        return snapshots
    if pool not in snapshots:
        known = ", ".join(snapshots) or "none"
        raise OperatorError(f"no pool {pool!r} in {sj.WEIGHTS_BUCKET} (pools: {known})")
    return {pool: snapshots[pool]}


async def watch_nodes(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """``laswrr nodes --watch``: the tables refreshed in place every ``--interval-s`` on a
    terminal (rich Live); one JSON line per refresh (``{"ts_ms", "pools"}``) with ``--json`` or
    when stdout is not a terminal. A read that fails is shown (or logged to stderr) and retried."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    lines = args.json or not sys.stdout.isatty()
    nc = await open_connection(args.nats_url, reconnect=True, auth=settings.nats_auth(args))
    console = Console()
    live = None if lines else Live(Text("reading LB_WEIGHTS ..."), console=console, auto_refresh=False)
    try:
        if live is not None:
            live.start()
        while not stop.is_set():
            try:
                snapshots = _only_pool(await _snapshots(nc, args.nats_url), args.pool)
                problem = None
            except (OperatorError, nats.errors.Error, asyncio.TimeoutError) as exc:
                snapshots, problem = {}, str(exc) or type(exc).__name__
            now_ns = time.time_ns()
            if lines:
                if problem is None:
                    print(json.dumps({"ts_ms": now_ns // 1_000_000, "pools": snapshots}), flush=True)
                else:
                    print(f"laswrr nodes --watch: {problem}", file=sys.stderr, flush=True)
            else:
                assert live is not None
                header = Text(f"laswrr nodes --watch: every {args.interval_s:g} s, {time.strftime('%H:%M:%S')}"
                              + (f" — {problem}" if problem else ""), style="bold red" if problem else "bold")
                live.update(Group(header, *render_tables(snapshots, now_ns)), refresh=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval_s)
    finally:
        if live is not None:
            live.stop()
        with contextlib.suppress(Exception):
            await nc.close()
    return 0


async def _watch(args: argparse.Namespace) -> int:
    return await watch_nodes(args, settings.stop_event())


def run_nodes(args: argparse.Namespace) -> int:
    if args.watch:
        if args.interval_s <= 0:
            print("laswrr: --interval-s must be > 0", file=sys.stderr)
            return EXIT_USAGE
        try:
            return asyncio.run(_watch(args))
        except OperatorError as exc:
            print(f"laswrr: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        snapshots = asyncio.run(read_snapshots(args.nats_url, settings.nats_auth(args)))
    except OperatorError as exc:
        print(f"laswrr: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.pool is not None:
        if args.pool not in snapshots:
            known = ", ".join(snapshots) or "none"
            print(f"laswrr: no pool {args.pool!r} in {sj.WEIGHTS_BUCKET} (pools: {known})", file=sys.stderr)
            return 1
        snapshots = {args.pool: snapshots[args.pool]}
    if args.json:
        print(json.dumps(snapshots, indent=2))
        return 0
    if not snapshots:
        print("no snapshots yet: register a node (laswrr register NODE --url URL --capacity N)", file=sys.stderr)
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    for table in render_tables(snapshots, time.time_ns()):
        console.print(table)
    return 0


# -- command line -------------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, write: bool = True) -> None:
    settings.add_nats_options(parser)
    if write:
        parser.add_argument("--wait", type=settings.duration("s"), default=3.0, metavar="SECONDS",
                            help="how long to wait for the scheduler's verdict (default 3)")


def register(subparsers: Any) -> None:
    capacity = subparsers.add_parser("capacity", help="set a node's capacity (0 drains it)",
                                     description="Publish lb.admin.capacity.NODE {\"capacity\": N} and report the outcome.")
    capacity.add_argument("node", metavar="NODE")
    capacity.add_argument("capacity", type=int, metavar="N")
    _common(capacity)
    capacity.set_defaults(func=_write(sj.admin_capacity, lambda a: {"capacity": a.capacity}))

    for name, builder, text in (("drain", sj.admin_drain, "admit no new requests to NODE; in-flight ones finish"),
                                ("undrain", sj.admin_undrain, "return a drained NODE with slow start"),
                                ("remove", sj.admin_remove, "drain NODE, then forget it")):
        parser = subparsers.add_parser(name, help=text, description=f"Publish {builder('NODE')} {{}}: {text}.")
        parser.add_argument("node", metavar="NODE")
        _common(parser)
        parser.set_defaults(func=_write(builder, lambda a: {}))

    reg = subparsers.add_parser("register", help="register or update a node",
                                description="Publish lb.admin.node.NODE {url, pool, chip, capacity, metrics_url, "
                                            "health_url, engine}.")
    reg.add_argument("node", metavar="NODE", nargs="?", help="node id (omit with --nodes)")
    reg.add_argument("--nodes", metavar="FILE", default=None,
                     help="register every [[node]] of this nodes.toml (id, url, pool, chip, capacity, "
                          "metrics_url, health_url, engine) instead")
    reg.add_argument("--url", default=None, help="the engine's base URL, e.g. http://10.0.0.5:8000")
    reg.add_argument("--pool", default="default", help="resource pool (default: default)")
    reg.add_argument("--chip", default=None, help="chip type: 910, 910B, 910C, ...")
    reg.add_argument("--capacity", type=int, default=None, help="concurrent requests the node serves")
    reg.add_argument("--metrics-url", default=None, help="for the collector: the engine's /metrics (default URL/metrics)")
    reg.add_argument("--health-url", default=None, help="for the collector: its health probe (default URL/health)")
    reg.add_argument("--engine", default=None, choices=ENGINE_NAMES,
                     help="for the collector: metric names to read (default: detect)")
    _common(reg)
    reg.set_defaults(func=run_register)

    nodes = subparsers.add_parser("nodes", help="show each pool's latest snapshot (KV LB_WEIGHTS)",
                                  description="One table per pool: phase, capacity, weights, in-flight, load, sample age.")
    nodes.add_argument("--pool", default=None, help="only this pool")
    nodes.add_argument("--json", action="store_true", help="print the snapshots as JSON (with --watch: one line each)")
    nodes.add_argument("--watch", action="store_true",
                       help="refresh in place until Ctrl-C (JSON lines when stdout is not a terminal)")
    nodes.add_argument("--interval-s", type=settings.duration("s"), default=1.0,
                       help="--watch refresh period (default %(default)s)")
    _common(nodes, write=False)
    nodes.set_defaults(func=run_nodes)
