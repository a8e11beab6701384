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
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from laswrr.collectors.nodes import REGISTERED_COLLECTOR_KEYS, Node, NodesConfigError, load_nodes
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_output, encode
from laswrr.schemas.events import (
    ENGINE_NAMES, CapacitySet, ConfigChanged, DrainRequested, Event, NodeRegistered, NodeRemoveRequested,
    UndrainRequested,
)
from laswrr.schemas.outputs import ConfigApplied, NodeView, PhaseChanged, Rejected, WeightSnapshot
from laswrr.schemas.words import NodeRole, PdProtocol, Phase
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
    phases: list[PhaseChanged] = field(default_factory=list)
    view: NodeView | None = None
    pool: str | None = None
    config: dict[str, Any] | None = None  # lb.out.config: the keys an lb.admin.config set, as applied

    def observe(self, subject: str, data: bytes) -> None:
        """Fold one ``lb.out.*`` message (decoded with its schema struct; others are ignored)."""
        try:
            output = decode_output(subject, data)
        except SchemaError:
            return
        if output.as_of_seq < self.seq:
            return
        if isinstance(output, Rejected):
            if output.as_of_seq == self.seq:
                self.rejected = output.reason
                return
        self.applied = True
        if isinstance(output, ConfigApplied) and output.as_of_seq == self.seq:
            self.config = dict(output.set)
        elif isinstance(output, PhaseChanged) and output.as_of_seq == self.seq and output.node == self.node:
            self.phases.append(output)
        elif isinstance(output, WeightSnapshot) and self.view is None:
            for view in output.nodes:
                if view.node == self.node:
                    self.view, self.pool = view, output.pool

    @property
    def described(self) -> bool:
        removed = any(p.to == Phase.REMOVED for p in self.phases)
        return self.rejected is not None or (self.applied and (self.view is not None or removed
                                                              or self.config is not None))

    def summary(self, subject: str) -> str:
        if self.rejected is not None:
            return f"rejected: {self.rejected}"
        parts = [f"applied: {subject} (seq {self.seq})"]
        if self.config is not None:
            parts.append("now in force: " + ", ".join(f"{key}={value}" for key, value in self.config.items()))
        for phase in self.phases:
            parts.append(f"{phase.node} {phase.from_} -> {phase.to} ({phase.reason})")
        if self.view is not None:
            view = self.view
            parts.append(f"{view.node} in pool {self.pool}: phase {view.phase}, capacity {view.capacity}, "
                         f"target {view.target_weight:g}, effective {view.effective_weight:g}, "
                         f"in-flight {view.inflight}")
        return "; ".join(parts)


# -- publishing ---------------------------------------------------------------------------------------


async def open_connection(url: str, reconnect: bool = False, auth: NatsAuth | None = None,
                          error_cb: Any = None) -> Client:
    """One connection for one command; ``reconnect``: it outlives a NATS restart (``--watch``)."""
    options: dict[str, Any] = {} if reconnect else dict(allow_reconnect=False, max_reconnect_attempts=1,
                                                         reconnect_time_wait=0.2)
    try:
        return await connect(url, "laswrr-operator", auth, connect_timeout=3, error_cb=error_cb or _quiet, **options)
    except Exception as exc:
        raise OperatorError(f"cannot connect to NATS at {redact_url(url)}: {exc or type(exc).__name__}"
                            f"{settings.nats_hint(url)}") from None


async def _quiet(exc: Exception) -> None:
    """nats-py logs a traceback per failed attempt by default; the caller reports one line."""


class PermissionWatch:
    """The connection's error callback: the first permissions violation of a publish the server
    reports (nats-py hands it only to this callback; the publish itself would just time out),
    and apart the first refused subscription (``subscribe_denied``), so that what is reported is
    the admin publish that was refused, not the subscription to its verdicts made before it."""

    def __init__(self) -> None:
        self.violation: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.subscribe_denied: str | None = None

    async def error_cb(self, exc: Exception) -> None:  # nats-py wants a coroutine function
        text = str(exc).removeprefix("nats: ")
        if "permissions violation" not in text.lower():
            return
        if "for subscription" in text.lower():
            self.subscribe_denied = self.subscribe_denied or text
        elif not self.violation.done():
            self.violation.set_result(text)


def permission_error(url: str, subject: str, detail: str) -> OperatorError:
    user = urllib.parse.urlsplit(url.split(",")[0]).username if "://" in url else None
    who = f"user {user!r}" if user else "these credentials"
    return OperatorError(f"the NATS server refused {subject}: {detail} ({who} may not send admin commands; "
                         "use the operator's credentials: export $(cat <data-dir>/secrets/operator.env), "
                         "docs/security.md)")


async def publish_and_wait(url: str, subject: str, payload: bytes, node: str | None, wait_s: float,
                           auth: NatsAuth | None = None) -> Outcome | None:
    """Publish one admin event like `nats pub` and fold the outputs until decided or ``wait_s``.
    A permissions violation (credentials of another role) is an OperatorError at once."""
    watch = PermissionWatch()
    nc = await open_connection(url, auth=auth, error_cb=watch.error_cb)
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    try:
        await nc.subscribe(sj.OUT_ALL, cb=queue.put)
        await nc.flush()  # the server answers a forbidden subscription before this round trip ends
        if watch.violation.done():
            raise permission_error(url, subject, watch.violation.result())
        publish = asyncio.ensure_future(nc.jetstream().publish(subject, payload, timeout=max(wait_s, 1.0)))
        await asyncio.wait({publish, watch.violation}, return_when=asyncio.FIRST_COMPLETED)
        if watch.violation.done():
            publish.cancel()
            raise permission_error(url, subject, watch.violation.result())
        try:
            ack = publish.result()
        except Exception as exc:
            raise OperatorError(f"publish to {subject} failed (is stream LB_EVENTS set up?): {exc}") from None
        if watch.subscribe_denied is not None:  # published, but the verdict cannot be read with these credentials
            raise OperatorError(f"{subject} was published (seq {ack.seq}) but its verdict cannot be read: the NATS "
                                f"server refused {watch.subscribe_denied}; see it with laswrr nodes, or use the "
                                "operator's credentials: export $(cat <data-dir>/secrets/operator.env)")
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
        outcome.observe(msg.subject, msg.data)
        if outcome.applied and applied_at is None:
            applied_at = time.monotonic()


def run_write(args: argparse.Namespace, subject: str, body: Event, node: str | None) -> int:
    payload = encode(body)
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
            body = body_of(args)
        except OperatorError as exc:
            print(f"laswrr: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return run_write(args, subject, body, args.node)
    return handler


def _register_body(args: argparse.Namespace) -> NodeRegistered:
    given = {key: getattr(args, key) for key in REGISTERED_COLLECTOR_KEYS if getattr(args, key) is not None}
    if args.role != NodeRole.BOTH and args.pd_protocol is None:
        raise OperatorError(f"register --role {args.role} needs --pd-protocol (vllm or sglang)")
    sglang_prefill = args.role == NodeRole.PREFILL and args.pd_protocol == PdProtocol.SGLANG
    if sglang_prefill and args.bootstrap_port is None:
        raise OperatorError("register --role prefill --pd-protocol sglang needs --bootstrap-port (the engine's "
                            "--disaggregation-bootstrap-port)")
    if not sglang_prefill and args.bootstrap_port is not None:
        raise OperatorError("register --bootstrap-port is only for an sglang prefill node")
    node = Node(id=args.node, url=args.url, pool=args.pool, chip=args.chip or None, capacity=args.capacity,
                extra=given, role=NodeRole(args.role),
                pd_protocol=None if args.pd_protocol is None else PdProtocol(args.pd_protocol),
                bootstrap_port=args.bootstrap_port)
    return node.registration()


def nodes_file_bodies(path: str) -> list[tuple[str, NodeRegistered]]:
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


def config_body(pairs: list[str]) -> ConfigChanged:
    """``["max_capacity=8192", "allow_upstream=10.0.0.0/8"]`` -> ``{"set": {...}}``: a value
    that reads as JSON (a number, true/false) is that, anything else a string."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise OperatorError(f"{pair!r}: give KEY=VALUE (keys: docs/configuration.md, \"Scheduler keys at runtime\")")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        changes[key] = value if isinstance(value, (int, float, bool, str)) else text
    return ConfigChanged(set=changes)


def run_config(args: argparse.Namespace) -> int:
    try:
        body = config_body(args.pairs)
    except OperatorError as exc:
        print(f"laswrr: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run_write(args, sj.ADMIN_CONFIG, body, None)


# -- laswrr nodes -------------------------------------------------------------------------------------


async def read_snapshots(url: str, auth: NatsAuth | None = None) -> dict[str, WeightSnapshot]:
    nc = await open_connection(url, auth=auth)
    try:
        return await _snapshots(nc, url)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _snapshots(nc: Client, url: str) -> dict[str, WeightSnapshot]:
    """Every pool's latest snapshot in KV LB_WEIGHTS (OperatorError when there is no bucket)."""
    # The keys come from the bucket's stream (one subject per key) rather than nats-py's
    # KeyValue.keys(): that one watches the bucket and, when the consumer has delivered every
    # key before the client has handled the first, ends at once with no keys.
    js = nc.jetstream()
    try:
        kv = await js.key_value(sj.WEIGHTS_BUCKET)
        info = await js.stream_info(f"KV_{sj.WEIGHTS_BUCKET}", subjects_filter=f"$KV.{sj.WEIGHTS_BUCKET}.>")
    except (BucketNotFoundError, NotFoundError):
        raise OperatorError(f"no KV bucket {sj.WEIGHTS_BUCKET} on {redact_url(url)}: has a scheduler ever run there?") from None
    prefix = f"$KV.{sj.WEIGHTS_BUCKET}."
    keys = [subject[len(prefix):] for subject in (info.state.subjects or {})]
    snapshots: dict[str, WeightSnapshot] = {}
    for key in sorted(keys):
        with contextlib.suppress(KeyNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            snapshots[key] = _SNAPSHOT.decode((await kv.get(key)).value or b"null")
    return snapshots


_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)


def _age(ms: Any) -> str:
    return "—" if ms is None else f"{ms / 1000:.1f} s"


COLUMNS = ("node", "phase", "routable", "cap", "target", "effective", "in-flight",
           "queue", "run", "kv", "npu", "lat", "load", "free slots", "free blocks", "sample age", "model")
# Which columns give way first on a narrow terminal (the last of this list first); the node id
# never does, so no id is ever cut.
KEEP_ORDER = ("node", "phase", "cap", "effective", "in-flight", "routable", "load", "model", "target", "sample age",
              "free slots", "free blocks", "queue", "run", "kv", "npu", "lat")


def _row(node: NodeView) -> dict[str, str]:
    load = node.load
    age = _age(load.sample_age_ms) + (" (stale)" if load.stale else "")
    cells = [node.node, str(node.phase), "yes" if node.routable else "no", str(node.capacity),
             f"{node.target_weight:g}", f"{node.effective_weight:g}", str(node.inflight),
             *(f"{value:.2f}" for value in (load.queue, load.running, load.kv, load.npu, load.latency, load.load)),
             *("—" if value is None else str(value) for value in (load.free_slots, load.free_blocks)), age,
             ", ".join(node.models) if node.models else "—"]  # the engine's model ids (lb.metrics.models)
    return dict(zip(COLUMNS, cells))


def fitting_columns(rows: list[dict[str, str]], width: int | None) -> list[str]:
    """The columns to show within ``width`` characters (None: all): each column needs its
    widest cell or header plus 3 (padding and border); columns are dropped in reverse
    ``KEEP_ORDER`` until the rest fit. The node column is always kept, whole."""
    need = {c: max([len(c), *(len(row[c]) for row in rows)]) + 3 for c in COLUMNS}
    kept = list(KEEP_ORDER)
    while width is not None and len(kept) > 1 and sum(need[c] for c in kept) + 1 > width:
        kept.pop()
    return [c for c in COLUMNS if c in kept]


def render_tables(snapshots: dict[str, WeightSnapshot], now_ns: int, width: int | None = None) -> list[Any]:
    """One rich Table per pool; ``width`` (the terminal's): the columns that fit it, node ids
    always whole (a title note says which columns were left out)."""
    from rich.table import Table

    tables = []
    for pool, snap in snapshots.items():
        updated = (now_ns - snap.ts_ns) / 1e9
        panic = " [bold red]PANIC[/]" if snap.panic else ""
        rows = [_row(node) for node in snap.nodes]
        shown = fitting_columns(rows, width)
        hidden = [c for c in COLUMNS if c not in shown]
        note = f" (hidden at {width} columns: {', '.join(hidden)}; --json has all)" if hidden else ""
        table = Table(title=f"pool {pool}: as_of_seq {snap.as_of_seq}, tick {snap.tick}, "
                            f"updated {updated:.1f} s ago{panic}{note}", title_justify="left",
                      caption=_mixed_caption(snap.nodes), caption_justify="left")
        for column in shown:
            table.add_column(column, justify="left" if column in ("node", "phase", "model") else "right",
                             no_wrap=column != "node", overflow="fold")  # an id wider than the screen folds
        for row in rows:
            table.add_row(*(row[c] for c in shown))
        tables.append(table)
    return tables


def _mixed_caption(nodes: list[NodeView]) -> str | None:
    """A warning under a pool whose nodes list different model ids (scheduler.routing.models)."""
    lists = {node.node: tuple(node.models) for node in nodes if node.models}
    if len({tuple(sorted(ids)) for ids in lists.values()}) <= 1:
        return None
    by_ids: dict[tuple[str, ...], list[str]] = {}
    for name, ids in lists.items():
        by_ids.setdefault(ids, []).append(name)
    groups = "; ".join(f"{', '.join(ids)} ({', '.join(names)})" for ids, names in by_ids.items())
    return (f"[bold yellow]warning: this pool mixes model ids[/]: {groups}. The pool's name goes to every node as "
            "that node's own id; a model id only to the nodes listing it; any other name is answered 404.")


def _only_pool(snapshots: dict[str, WeightSnapshot], pool: str | None) -> dict[str, WeightSnapshot]:
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
                    print(json.dumps({"ts_ms": now_ns // 1_000_000, "pools": msgspec.to_builtins(snapshots)}), flush=True)
                else:
                    print(f"laswrr nodes --watch: {problem}", file=sys.stderr, flush=True)
            else:
                assert live is not None
                header = Text(f"laswrr nodes --watch: every {args.interval_s:g} s, {time.strftime('%H:%M:%S')}"
                              + (f" — {problem}" if problem else ""), style="bold red" if problem else "bold")
                live.update(Group(header, *render_tables(snapshots, now_ns, console.width)), refresh=True)
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
    if args.json:  # the shape of one --watch line: {"ts_ms", "pools"}
        print(json.dumps({"ts_ms": time.time_ns() // 1_000_000, "pools": msgspec.to_builtins(snapshots)}, indent=2))
        return 0
    if not snapshots:
        print("no snapshots yet: register a node (laswrr register NODE --url URL --capacity N)", file=sys.stderr)
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    for table in render_tables(snapshots, time.time_ns(), console.width):
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
    capacity.set_defaults(func=_write(sj.admin_capacity, lambda a: CapacitySet(capacity=a.capacity)))

    for name, builder, event, text in (
            ("drain", sj.admin_drain, DrainRequested(), "admit no new requests to NODE; in-flight ones finish"),
            ("undrain", sj.admin_undrain, UndrainRequested(), "return a drained NODE with slow start"),
            ("remove", sj.admin_remove, NodeRemoveRequested(), "drain NODE, then forget it")):
        parser = subparsers.add_parser(name, help=text, description=f"Publish {builder('NODE')} {{}}: {text}.")
        parser.add_argument("node", metavar="NODE")
        _common(parser)
        parser.set_defaults(func=_write(builder, lambda a, event=event: event))

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
    reg.add_argument("--role", default=NodeRole.BOTH.value, choices=[str(r) for r in NodeRole],
                     help="prefill, decode or both (default: both, a node that serves whole requests)")
    reg.add_argument("--pd-protocol", default=None, choices=[str(p) for p in PdProtocol],
                     help="the pool's prefill/decode protocol: vllm or sglang (required with --role prefill/decode)")
    reg.add_argument("--bootstrap-port", type=int, default=None,
                     help="an sglang prefill node's bootstrap server port (required for one; its engine's "
                          "--disaggregation-bootstrap-port)")
    reg.add_argument("--metrics-url", default=None, help="for the collector: the engine's /metrics (default URL/metrics)")
    reg.add_argument("--health-url", default=None, help="for the collector: its health probe (default URL/health)")
    reg.add_argument("--status-url", default=None,
                     help="for the collector: MindIE's management-port /v1/status (default: none)")
    reg.add_argument("--npu-exporter", default=None,
                     help="for the collector: the host's npu-exporter /metrics (default: none)")
    reg.add_argument("--engine", default=None, choices=ENGINE_NAMES,
                     help="for the collector: metric names to read (default: detect)")
    reg.add_argument("--kv-events", default=None, metavar="ZMQ_URL",
                     help="for laswrr kv-events: the engine's KV event publisher, e.g. tcp://10.0.0.5:5557 "
                          "(vLLM's --kv-events-config endpoint; default: none, the estimated prefix view)")
    reg.add_argument("--kv-events-replay", default=None, metavar="ZMQ_URL",
                     help="for laswrr kv-events: the publisher's replay endpoint (default: none)")
    _common(reg)
    reg.set_defaults(func=run_register)

    config = subparsers.add_parser("config", help="change scheduler configuration keys",
                                   description="Publish lb.admin.config {\"set\": {KEY: VALUE, ...}} and report the outcome.")
    config.add_argument("pairs", nargs="+", metavar="KEY=VALUE",
                        help="a scheduler key and its new value, e.g. max_capacity=8192")
    _common(config)
    config.set_defaults(func=run_config)

    nodes = subparsers.add_parser("nodes", help="show each pool's latest snapshot (KV LB_WEIGHTS)",
                                  description="One table per pool: phase, capacity, weights, in-flight, load, sample age.")
    nodes.add_argument("--pool", default=None, help="only this pool")
    nodes.add_argument("--json", action="store_true", help="print {\"ts_ms\": when read, \"pools\": {pool: its snapshot}} as JSON (with --watch: the "
                            "same object on one line per refresh)")
    nodes.add_argument("--watch", action="store_true",
                       help="refresh in place until Ctrl-C (JSON lines when stdout is not a terminal)")
    nodes.add_argument("--interval-s", type=settings.duration("s"), default=1.0,
                       help="--watch refresh period (default %(default)s)")
    _common(nodes, write=False)
    nodes.set_defaults(func=run_nodes)
