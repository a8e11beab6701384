"""Run a scenario against the real stack, once per policy, on the identical workload.

Theory of operation, per policy (a fresh stack each time: no state leaks between policies):

1. start the stack (``bench.stack_adapter`` over ``services.up.Stack``: embedded NATS, scheduler,
   recorder, simulated engines at the scenario's speed, collector, proxy with ``--policy``; with
   ``proxies`` > 1 that many proxy replicas, the load alternating among them; with ``workers``
   > 1 each replica that many worker processes) under
   ``<out>/runs/<policy>``;
2. subscribe to ``lb.out.snapshot.>`` (weights over time, straight from the bus) and wait until
   every node is routable at its full weight;
3. ``t0`` = now: the load generator sends the seeded workload and the timeline executes the
   scenario's actions at their offsets, both on the same monotonic clock;
4. after the last response, a short settle (the last request events reach the log), then stop
   the stack (the recorder flushes and closes the DuckDB file);
5. ``laswrr report --db --json`` and ``laswrr replay --db`` on the recorded file (separate
   processes: DuckDB has one writer, and the stack is down by then).

The engines' own prefix-cache counters (``vllm:prefix_cache_queries_total`` / ``_hits_total``,
read with the collector's parser) are scraped just before ``t0`` and after the last response;
the run's hit rate is the difference (the readiness probes before ``t0`` do not count). An engine
restarted during the run (a ``restart`` action, real engines) is also read just before it stops,
and what it counted then is added to what its new process counts from 0.

A chat workload on real engines (the ``cache`` scenarios) also asks every answer for its usage
chunk and listens to the engines' KV changes (``lb.kv.>``, as the proxy's role) during the run:
after it, ``bench.cache_view`` joins each request's recorded prediction of its cached prompt
tokens with the engine's count (``kv_changes.jsonl`` keeps what the causes were read from), and
``laswrr replay --db --latency --json`` gives the latency estimate's accuracy.

The workload is generated once from the seed, before any stack starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from laswrr.bench import stack_adapter
from laswrr.bench.cache_view import KvTimeline, accuracy, read_picks
from laswrr.bench.load import make_session, run_load
from laswrr.bench.metrics import RequestResult
from laswrr.bench.report import NodePoint, PolicyRun, SnapshotPoint
from laswrr.bench.scenarios import Action, Scenario
from laswrr.bench.workload import RequestSpec
from laswrr.collectors.nodes import Node
from laswrr.services.natsbus import connect
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.events import CapacitySet, DrainRequested, Event
from laswrr.schemas.kvcache import CACHE_DECODER
from laswrr.schemas.outputs import WeightSnapshot

log = logging.getLogger("laswrr.bench")

READY_TIMEOUT_S = 60.0
SETTLE_S = 0.5
OnResult = Callable[[RequestResult], None]
Restart = Callable[[str], Awaitable[None]]  # stop a real engine and start it again (bench/real_bench.py)


# --------------------------------------------------------------------------- snapshots


_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)


def snapshot_point(snapshot: WeightSnapshot, t_s: float) -> SnapshotPoint:
    nodes = {n.node: NodePoint(n.effective_weight, n.target_weight, n.inflight, n.phase, n.routable)
             for n in snapshot.nodes}
    return SnapshotPoint(round(t_s, 4), snapshot.as_of_seq, nodes)


class SnapshotWatch:
    """Collects every weight snapshot published while the run lasts (loop-time stamped)."""

    def __init__(self, kv: KvTimeline | None = None) -> None:
        self.raw: list[tuple[float, WeightSnapshot]] = []
        self.latest: WeightSnapshot | None = None
        self.kv = kv  # also every lb.kv.<node> change, with its arrival time (the cache view's accuracy)
        self._nc: Any = None
        self._kv_nc: Any = None

    async def start(self, nats_url: str, kv_url: str | None = None) -> None:
        """``kv_url``: the bus as a role that may read ``lb.kv.>`` (the proxy's), for ``kv``."""
        self._nc = await connect(nats_url, "laswrr-bench")
        loop = asyncio.get_running_loop()

        async def on_msg(msg: Any) -> None:
            data = _SNAPSHOT.decode(msg.data)
            self.latest = data
            self.raw.append((loop.time(), data))

        await self._nc.subscribe(f"{sj.OUT_SNAPSHOT}.>", cb=on_msg)
        timeline = self.kv
        if timeline is not None:
            async def on_kv(msg: Any) -> None:
                node = sj.kv_node(msg.subject)
                with contextlib.suppress(msgspec.DecodeError, ValueError):
                    if node is not None:
                        timeline.add(node, CACHE_DECODER.decode(msg.data))

            self._kv_nc = await connect(kv_url or nats_url, "laswrr-bench-kv")
            await self._kv_nc.subscribe(sj.KV_ALL, cb=on_kv)

    async def publish(self, subject: str, event: Event) -> None:
        await self._nc.publish(subject, encode(event))
        await self._nc.flush()

    async def stop(self) -> None:
        for nc in (self._nc, self._kv_nc):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.drain()

    def points(self, t0: float) -> list[SnapshotPoint]:
        return [snapshot_point(data, t - t0) for t, data in self.raw]

    def ready(self, capacities: dict[str, int]) -> bool:
        if self.latest is None:
            return False
        nodes = {n.node: n for n in self.latest.nodes}
        return all(node in nodes and nodes[node].routable
                   and nodes[node].effective_weight >= 0.9 * cap for node, cap in capacities.items())


async def wait_ready(watch: SnapshotWatch, capacities: dict[str, int], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not watch.ready(capacities):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes not routable at full weight after {timeout_s:.0f}s: {watch.latest}")
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------- timeline


RESET_TRIES = 20  # a prefix-cache reset the engine refuses (blocks held) is tried again, 0.5 s apart


async def apply_action(action: Action, engine_urls: dict[str, str], http: aiohttp.ClientSession,
                       watch: SnapshotWatch, engine_admin: bool = True, restart: Restart | None = None) -> None:
    """One action: the engine admin change (capacity, slowdown, fail, or the health its npu-smi
    shows) and, for an announced capacity, the admin event at once. ``engine_admin`` False (real
    engines, which have no admin API): the announcement alone. ``restart``: a real engine's
    restart (returns once it serves again)."""
    if action.kind == "restart":
        if restart is None:
            raise RuntimeError(f"{action.node}: a restart needs real engines (--engines vllm)")
        await restart(action.node)
        return
    if action.kind == "cache_reset":
        if engine_admin:
            raise RuntimeError(f"{action.node}: a prefix-cache reset needs real vLLM engines (--engines vllm)")
        await reset_prefix_cache(http, engine_urls[action.node], running=True)
        return
    if action.kind == "drain":  # the operator's drain alone: the engine is untouched
        await watch.publish(sj.admin_drain(action.node), DrainRequested())
        return
    changes = {action.kind: action.value}
    calls = [_engine_admin(http, engine_urls[action.node], changes)] if engine_admin else []
    if action.kind == "capacity" and action.announce:
        calls.append(watch.publish(sj.admin_capacity(action.node), CapacitySet(capacity=int(action.value))))
    await asyncio.gather(*calls)


async def _engine_admin(http: aiohttp.ClientSession, url: str, changes: dict[str, Any]) -> None:
    async with http.post(f"{url}/admin", json=changes) as resp:
        if resp.status != 200:
            raise RuntimeError(f"engine admin {url} {changes} -> {resp.status}: {await resp.text()}")


async def run_timeline(actions: Sequence[Action], t0: float, engine_urls: dict[str, str],
                       http: aiohttp.ClientSession, watch: SnapshotWatch,
                       engine_admin: bool = True, restart: Restart | None = None) -> list[tuple[float, str]]:
    """Execute the actions at t0 + at_s; returns (actual offset, label) per action, and for a
    restart also when the engine served again."""
    loop = asyncio.get_running_loop()
    done: list[tuple[float, str]] = []
    for action in sorted(actions, key=lambda a: a.at_s):
        delay = t0 + action.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        began = round(loop.time() - t0, 3)
        await apply_action(action, engine_urls, http, watch, engine_admin, restart)
        done.append((began, action.label or f"{action.node} {action.kind}={action.value}"))
        if action.kind == "restart":
            done.append((round(loop.time() - t0, 3), f"{action.node} serves again"))
    return done


# --------------------------------------------------------------------------- one policy


def write_scheduler_config(scenario: Scenario, directory: Path) -> Path | None:
    if not scenario.scheduler_config:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "scheduler.toml"
    lines = ["[scheduler]"] + [f"{k} = {json.dumps(v)}" for k, v in scenario.scheduler_config.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


async def prefix_counters(http: aiohttp.ClientSession, engine_urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(queried, hit) prompt tokens of each engine's prefix cache, from its own /metrics."""
    from laswrr.collectors.prometheus import ParseError, parse_engine_metrics

    async def one(url: str) -> tuple[float, float]:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        try:
            parsed = parse_engine_metrics(text)
        except ParseError as exc:
            log.warning("%s/metrics: %s", url, exc)
            return (0.0, 0.0)
        return (parsed.prefix_cache_queries or 0.0, parsed.prefix_cache_hits or 0.0)

    values = await asyncio.gather(*(one(url) for url in engine_urls.values()))
    return dict(zip(engine_urls, values))


async def preemption_counters(http: aiohttp.ClientSession, engine_urls: dict[str, str]) -> dict[str, float]:
    """Each engine's own ``vllm:num_preemptions_total`` (the simulator exposes it too; 0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    async def one(url: str) -> float:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name in ("vllm:num_preemptions_total", "num_preemptions_total"))  # vLLM, MindIE names

    values = await asyncio.gather(*(one(url) for url in engine_urls.values()))
    return dict(zip(engine_urls, values))


async def reset_prefix_caches(http: aiohttp.ClientSession, engine_urls: dict[str, str]) -> None:
    """Real vLLM engines keep their caches between policies: empty them (``reset_prefix_cache``)."""
    for url in engine_urls.values():
        await reset_prefix_cache(http, url)


async def reset_prefix_cache(http: aiohttp.ClientSession, url: str, running: bool = False,
                             tries: int = RESET_TRIES) -> None:
    """Empty the vLLM engine's prefix cache (POST /reset_prefix_cache, served with
    VLLM_SERVER_DEV_MODE=1, as bench/real_vllm.py starts them). The engine refuses (``success``
    false) while blocks are held: ``running`` has it compute its running requests again instead,
    and a refusal is tried again, ``tries`` times half a second apart."""
    for _ in range(tries):
        async with http.post(f"{url}/reset_prefix_cache",
                             params={"reset_running_requests": "true"} if running else None) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache -> {resp.status}: {await resp.text()}")
            answer = await resp.json(content_type=None)
        if not isinstance(answer, dict) or answer.get("success", True):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url}/reset_prefix_cache: the engine refused {tries} times (blocks still held)")


def counter_deltas(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                   carried: dict[str, tuple[float, float]] | None = None) -> dict[str, dict[str, float]]:
    """Each engine's (queried, hit) over the run; ``carried``: what an engine restarted during
    the run had counted when it stopped (its counters start again from 0)."""
    carried = carried or {}
    return {node: {"queried_tokens": q + carried.get(node, (0.0, 0.0))[0] - before.get(node, (0.0, 0.0))[0],
                   "hit_tokens": h + carried.get(node, (0.0, 0.0))[1] - before.get(node, (0.0, 0.0))[1]}
            for node, (q, h) in after.items()}


async def proxy_families(http: aiohttp.ClientSession, proxy_urls: Sequence[str]) -> list[Any]:
    """Every metric family of every replica's ``/metrics`` (a replica that does not answer is
    logged and left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: list[Any] = []
    for url in proxy_urls:
        try:
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("%s/metrics: %s", url, exc)
            continue
        families += text_string_to_metric_families(text)
    return families


def lag_histogram(families: Sequence[Any], name: str) -> dict[str, Any] | None:
    """The histogram ``name`` (seconds) merged over the replicas' metric ``families``: count, mean
    and the bucket bounds holding the median and the 99th percentile; None when it counted nothing."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    if not count:
        return None

    def quantile(q: float) -> float:
        return next(bound for bound, n in sorted(buckets.items()) if n >= q * count)

    return {"count": int(count), "mean_s": round(total / count, 4), "p50_le_s": quantile(0.5),
            "p99_le_s": quantile(0.99)}


def view_lags(families: Sequence[Any]) -> dict[str, Any] | None:
    """``laswrr_proxy_view_lag_seconds`` merged over the replicas (``lag_histogram``): each
    snapshot's age when installed, how old the other replicas' in-flight counts are at the first
    pick on it."""
    merged = lag_histogram(families, "laswrr_proxy_view_lag_seconds")
    if merged is None:
        return None
    return {"snapshots": merged.pop("count"), **merged}


CHANNEL_COUNTERS = ("laswrr_proxy_peer_messages", "laswrr_proxy_peer_bytes", "laswrr_proxy_events_published",
                    "laswrr_proxy_events_published_bytes")


def channel_traffic(families: Sequence[Any]) -> dict[str, Any] | None:
    """What the channel between proxies carried against the request events, summed over the
    replicas' metric ``families`` (``laswrr_proxy_peer_messages_total``, ``_peer_bytes_total``,
    ``_events_published_total``, ``_events_published_bytes_total``; bytes with the subjects) and
    the age of the messages they took (``laswrr_proxy_peer_lag_seconds``); None when no replica shares."""
    totals = dict.fromkeys(CHANNEL_COUNTERS, 0.0)
    whole = 0.0
    shares = False
    for family in families:
        if family.name not in totals:
            continue
        shares = shares or family.name == "laswrr_proxy_peer_messages"
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[family.name] += sample.value
                whole += sample.value if sample.labels.get("kind") == "whole" else 0.0
    if not shares:
        return None
    messages, sent = totals["laswrr_proxy_peer_messages"], totals["laswrr_proxy_peer_bytes"]
    events, event_bytes = totals["laswrr_proxy_events_published"], totals["laswrr_proxy_events_published_bytes"]
    return {"messages": int(messages), "whole": int(whole), "bytes": int(sent),
            "bytes_per_message": round(sent / messages, 1) if messages else None,
            "events": int(events), "event_bytes": int(event_bytes),
            "share_of_event_bytes": round(sent / event_bytes, 4) if event_bytes else None,
            # the messages taken from peers: their age then (the bus's delivery time)
            "lag": lag_histogram(families, "laswrr_proxy_peer_lag_seconds")}


# Something to do on the running stack beside the load (the demo's dashboard screenshot): it gets
# the stack and t0 (loop time); its failure is logged, never fails the run.
Alongside = Callable[[stack_adapter.RunningStack, float], Awaitable[None]]


async def run_policy(scenario: Scenario, policy: str, workload: Sequence[RequestSpec], run_dir: Path,
                     on_result: OnResult | None = None, proxy_args: Sequence[str] = (),
                     alongside: Alongside | None = None, proxies: int = 1,
                     engines: Sequence[Node] | None = None, model: str | None = None, workers: int = 1,
                     tokenizer: str | None = None, restart: Restart | None = None) -> PolicyRun:
    """``engines``: running engines to register (real vLLM, bench/real_vllm.py) instead of
    starting the scenario's simulated ones; they have no admin API, so actions are announcements
    only (and ``restart``, which stops one and starts it again), and their prefix caches are
    emptied before the run. ``tokenizer``: their model's directory (a ``+events`` row)."""
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = await stack_adapter.start(scenario, policy, run_dir, write_scheduler_config(scenario, run_dir),
                                      (*scenario.proxy_args, *proxy_args), proxies=proxies, engines=engines,
                                      workers=workers, tokenizer=tokenizer, **({"model": model} if model else {}))
    log.info("%s/%s: stack up in %.1fs", scenario.name, policy, time.monotonic() - started)
    # a chat workload on real engines: each answer's usage names the prompt tokens the engine found
    # cached, against the prediction its pick recorded (bench/cache_view.py)
    usage = engines is not None and scenario.chat is not None
    kv_changes = KvTimeline() if usage else None
    watch = SnapshotWatch(kv_changes)
    notes: list[str] = []
    try:
        await watch.start(stack.nats_url, stack.role_url("proxy"))
        await wait_ready(watch, {e.node: e.capacity for e in scenario.engines})
        log.info("%s/%s: ready at %.1fs", scenario.name, policy, time.monotonic() - started)
        loop = asyncio.get_running_loop()
        async with make_session() as http:
            if engines is not None:
                await reset_prefix_caches(http, stack.engine_urls)
            before = await prefix_counters(http, stack.engine_urls)
            preempted = await preemption_counters(http, stack.engine_urls)
            carried: dict[str, tuple[float, float]] = {}
            carried_preemptions: dict[str, float] = {}

            async def restart_engine(node: str) -> None:  # its counters as it stops, then the restart
                assert restart is not None
                url = {node: stack.engine_urls[node]}
                carried[node] = (await prefix_counters(http, url))[node]
                carried_preemptions[node] = (await preemption_counters(http, url))[node]
                await restart(node)

            t0 = loop.time() + 0.2
            timeline = asyncio.create_task(run_timeline(scenario.actions, t0, stack.engine_urls, http, watch,
                                                        engine_admin=engines is None,
                                                        restart=restart_engine if restart is not None else None))
            beside = asyncio.create_task(alongside(stack, t0)) if alongside is not None else None
            load = await run_load(stack.proxy_urls, workload, t0,
                                  model=stack_adapter.request_model(policy, stack.model),
                                  on_done=on_result, session=http, usage=usage)
            applied = await timeline
            if beside is not None:
                try:
                    await beside
                except Exception as exc:  # noqa: BLE001 - an extra, never the measurement
                    notes.append(f"{getattr(alongside, '__name__', 'alongside')} failed: {exc}")
                    log.warning("%s/%s: %s", scenario.name, policy, notes[-1])
            prefix_cache = counter_deltas(before, await prefix_counters(http, stack.engine_urls), carried)
            preemptions = {node: count + carried_preemptions.get(node, 0.0) - preempted.get(node, 0.0)
                           for node, count in (await preemption_counters(http, stack.engine_urls)).items()}
            view_lag = channel = None
            if not stack_adapter.is_peer(policy):  # one scrape of every replica (and worker) for both
                families = await proxy_families(http, stack.metrics_urls)
                view_lag, channel = view_lags(families), channel_traffic(families)
        notes += [f"action at {t:.2f}s: {label}" for t, label in applied]
        await asyncio.sleep(SETTLE_S)
        snapshots = watch.points(t0)
    finally:
        await watch.stop()
        await stack_adapter.stop(stack)
    log.info("%s/%s: stack down at %.1fs", scenario.name, policy, time.monotonic() - started)
    run = PolicyRun(policy, load.results, snapshots, notes=notes, prefix_cache=prefix_cache, view_lag=view_lag,
                    channel=channel,
                    preemptions=preemptions)
    # a peer router publishes no request events: the analyst report would count nothing
    run.report = None if stack_adapter.is_peer(policy) else analyst_report(stack.db_path)
    run.replay = exact_replay(stack.db_path)
    if usage and stack.db_path is not None and stack.db_path.exists() and not stack_adapter.is_peer(policy):
        assert kv_changes is not None
        kv_changes.save(run_dir / "kv_changes.jsonl")  # what the causes are read from, for a later look
        try:
            run.cache_view = accuracy(load.results, read_picks(stack.db_path), kv_changes,
                                      engine_tokens(tokenizer, workload))
        except Exception:  # noqa: BLE001 - a figure of the run, never the run: its inputs are saved
            log.exception("%s/%s: the cache view's accuracy failed", scenario.name, policy)
        run.latency = latency_accuracy(stack.db_path)
    run.wall_s = time.monotonic() - started
    log.info("%s/%s: report and replay done at %.1fs", scenario.name, policy, run.wall_s)
    save_run(run, run_dir)
    return run


# --------------------------------------------------------------------------- analyst tools


def _laswrr(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "laswrr", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())


def analyst_report(db_path: Path | None) -> dict[str, Any] | None:
    if db_path is None or not db_path.exists():
        return None
    try:
        proc = _laswrr("report", "--db", str(db_path), "--json")
        if proc.returncode != 0:
            log.warning("laswrr report failed (%s): %s", proc.returncode, proc.stderr.strip()[-300:])
            return None
        data = json.loads(proc.stdout)
        return data if isinstance(data, dict) else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        log.warning("laswrr report unavailable: %s", exc)
        return None


def exact_replay(db_path: Path | None) -> dict[str, Any] | None:
    if db_path is None or not db_path.exists():
        return None
    try:
        proc = _laswrr("replay", "--db", str(db_path))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "exit": None, "output": str(exc)}
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode == 2 and ("unrecognized arguments" in output or "invalid choice" in output):
        log.warning("laswrr replay --db is not available: %s", output.splitlines()[-1:])
        return None
    return {"ok": proc.returncode == 0, "exit": proc.returncode, "output": output[-600:]}


def latency_accuracy(db_path: Path) -> dict[str, Any] | None:
    """``laswrr replay --db --latency --json``: the latency estimate's audit and accuracy (None: not available)."""
    try:
        proc = _laswrr("replay", "--db", str(db_path), "--latency", "--json")
        data = json.loads(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        log.warning("laswrr replay --latency unavailable: %s", exc)
        return None
    return data if isinstance(data, dict) else None


def engine_tokens(tokenizer: str | None, workload: Sequence[RequestSpec]) -> Callable[[int], list[int] | None] | None:
    """A chat request's engine tokens by its workload index, rendered as a proxy with
    ``--tokenizer`` renders them (None: no tokenizer)."""
    if tokenizer is None:
        return None
    from laswrr.services.proxy.tokens import PromptTokenizer

    rendered = PromptTokenizer(tokenizer)
    by_index = {spec.index: spec for spec in workload}

    def tokens(index: int) -> list[int] | None:
        spec = by_index.get(index)
        if spec is None:
            return None
        return rendered.encode([{"role": role, "content": text} for role, text in spec.messages], None)

    return tokens


def save_run(run: PolicyRun, run_dir: Path) -> None:
    with (run_dir / "requests.jsonl").open("w") as handle:
        for result in run.results:
            handle.write(json.dumps(asdict(result)) + "\n")
    with (run_dir / "snapshots.jsonl").open("w") as handle:
        for point in run.snapshots:
            handle.write(json.dumps(asdict(point)) + "\n")
