"""`laswrr bench --virtual`: a trace scenario in virtual time, through the proxy's own routing table.

What runs: the scenario's simulated engines (``services.sim_engine.physics.EngineSim``, the same
physics the engine processes run, prefix cache included) and the proxy's ``Router`` (the same
pick, prefix index and work referee as ``laswrr proxy``), driven by the trace's arrivals on a
virtual clock: no processes, no network, no scheduler. Each node's weight is its capacity (what
the scheduler's targets start from), fixed for the run. A run is deterministic, so two policies
are compared on exactly the same arrivals and the same engine physics, free of the machine's
load, in seconds instead of minutes. It measures what routing alone can change; the real stack
(`laswrr bench` without ``--virtual``) adds the scheduler's weights, the bus and HTTP.

``--proxies N``: N replicas take the requests in turn, each with its own routing table, prefix
index and counts. ``kept`` is the share of the requests continuing an earlier prompt (sharing
at least two leading trace blocks with it) that went to the node that served it: with several
replicas, how well they agree on where a conversation lives.

Rows: each ``--policies`` entry (``la-swrr``, ``rr``, ``least-request``, ``p2c``) with the proxy's
``--affinity`` (``la-swrr`` is run both ways when ``--affinity`` is not given), and ``oracle``: a
reference that reads every engine's exact state and sends each request where it gets its first
token soonest (the step in progress, the requests waiting there and their cached prefixes, the
request's own cached prefix). It is a bound on what a router could gain, not a policy: no router
sees that state.

TTFT is the first token's time less the arrival; E2E the last token's. The proxy hears the first
token at once (a stream), which takes the request out of its node's prefill backlog.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from laswrr.bench.scenarios import Scenario
from laswrr.bench.trace import load_workload
from laswrr.bench.workload import RequestSpec, prompt_text
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.services.proxy.prompt import prompt_text as indexed_text
from laswrr.services.proxy.prompt import request_size
from laswrr.services.proxy.routing import DEFAULT_POOL, Admission, Router
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile

ORACLE = "oracle"
_STEP, _ARRIVE = 0, 1  # at one instant, steps end before arrivals are routed


@dataclass(slots=True)
class VirtualResult:
    policy: str
    affinity: str
    requests: int
    ttft_s: dict[str, float]
    e2e_s: dict[str, float]
    prefix_hit_rate: float
    proxies: int = 1
    kept_on_node: float | None = None  # of the requests continuing an earlier prompt, the share sent where it went
    per_node: dict[str, int] = field(default_factory=dict)


def quantiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    at = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
    return {k: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) for k, q in at.items()}


def _snapshot(scenario: Scenario) -> WeightSnapshot:
    idle = LoadView(queue=0.0, running=0.0, kv=0.0, npu=0.0, latency=0.0, load=0.0, sample_age_ms=None, stale=False)
    nodes = [NodeView(node=e.node, url=e.node, phase="active", routable=True, capacity=e.capacity,
                      target_weight=float(e.capacity), effective_weight=float(e.capacity), inflight=0, chip=e.chip,
                      health=1.0, load=idle) for e in scenario.engines]
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=0, ts_ns=0, panic=False, nodes=nodes)


def _engines(scenario: Scenario) -> dict[str, EngineSim]:
    return {e.node: EngineSim(get_profile(e.chip), e.capacity, speed=scenario.speed, kv_tokens=scenario.kv_tokens)
            for e in scenario.engines}


class Continuations:
    """Which node served each trace prefix last, to tell whether a request that continues an
    earlier prompt (shares at least ``MIN_SHARED_BLOCKS`` leading trace blocks with it) went to the
    same node: what replicas must agree on for a conversation not to alternate between nodes."""

    MIN_SHARED_BLOCKS = 2  # the Mooncake slice's prompts nearly all share their first block

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], str] = {}
        self.kept = self.continuing = 0

    def served(self, block_ids: Sequence[int], node: str) -> None:
        for depth in range(len(block_ids), self.MIN_SHARED_BLOCKS - 1, -1):
            earlier = self.last.get(tuple(block_ids[:depth]))
            if earlier is not None:
                self.continuing += 1
                self.kept += earlier == node
                break
        for depth in range(self.MIN_SHARED_BLOCKS, len(block_ids) + 1):
            self.last[tuple(block_ids[:depth])] = node

    @property
    def share(self) -> float | None:
        return round(self.kept / self.continuing, 4) if self.continuing else None


def run_virtual(scenario: Scenario, policy: str, affinity: str = "prefix", seed: int = 1,
                proxies: int = 1) -> VirtualResult:
    """One row; ``proxies`` replicas take the requests in turn, each with its own routing table
    (its own counts only: the replicas' shared view rides on the scheduler's snapshots, which
    this model has none of)."""
    if scenario.trace is None:
        raise ValueError(f"--virtual replays a trace; {scenario.name} is not a trace scenario")
    requests = load_workload(scenario.trace)
    engines = _engines(scenario)
    routers = [] if policy == ORACLE else [Router(policy, seed + k, affinity=affinity) for k in range(proxies)]
    for router in routers:
        router.offer(_snapshot(scenario), now=0.0)
    continuations = Continuations()
    queue: list[tuple[float, int, int, object]] = [(r.offset_s, _ARRIVE, i, r) for i, r in enumerate(requests)]
    heapq.heapify(queue)
    order = len(queue)
    live: dict[tuple[str, int], tuple[float, Router | None, Admission | None]] = {}
    ttft: list[float] = []
    e2e: list[float] = []
    per_node = dict.fromkeys(engines, 0)

    def wake(node: str, now: float) -> None:
        nonlocal order
        at = engines[node].next_event_time()
        if at is not None:
            heapq.heappush(queue, (max(at, now), _STEP, order, node))
            order += 1

    while queue:
        now, kind, _, item = heapq.heappop(queue)
        if kind == _ARRIVE:
            assert isinstance(item, RequestSpec)
            text = prompt_text(item)
            admission = router = None
            if not routers:
                node = min(engines, key=lambda n: (engines[n].first_token_eta(item.prompt_tokens, text, now), n))
            else:
                router = routers[item.index % len(routers)]
                seen = indexed_text([{"role": "user", "content": text}], None)
                admission = router.admit(DEFAULT_POOL, prompt=seen, size=request_size(seen, item.max_tokens, None))
                assert admission is not None
                node = admission.node
            per_node[node] += 1
            continuations.served(item.block_ids, node)
            engine = engines[node]
            submitted = engine.submit(item.prompt_tokens, item.max_tokens, now, prompt_text=text)
            live[(node, submitted.req_id)] = (now, router, admission)
            wake(node, now)
            continue
        assert isinstance(item, str)
        for event in engines[item].advance(now):
            arrived, router, admission = live[(item, event.req_id)]
            if event.index == 0:
                ttft.append(event.time - arrived)
                if admission is not None and router is not None:
                    router.prefilled(admission)
            if event.finished:
                e2e.append(event.time - arrived)
                del live[(item, event.req_id)]
                if admission is not None and router is not None:
                    router.release(admission)
        wake(item, now)
    queries = sum(e.prefix_cache.queries for e in engines.values())
    hits = sum(e.prefix_cache.hits for e in engines.values())
    return VirtualResult(policy=policy, affinity=routers[0].affinity_mode if routers else "-", requests=len(ttft),
                         ttft_s=quantiles(ttft), e2e_s=quantiles(e2e),
                         prefix_hit_rate=round(hits / queries, 4) if queries else 0.0,
                         proxies=len(routers) or 1, kept_on_node=continuations.share, per_node=per_node)


def rows_for(policies: Sequence[str], affinity: str | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for policy in policies:
        if policy == "la-swrr" and affinity is None:
            rows += [(policy, "prefix"), (policy, "none")]
        else:
            rows.append((policy, affinity or "prefix"))
    return rows + [(ORACLE, "-")]


def print_virtual(scenario: Scenario, results: Sequence[VirtualResult]) -> None:
    proxies = max((r.proxies for r in results), default=1)
    print(f"{scenario.name} in virtual time ({results[0].requests if results else 0} requests, weights = capacities, "
          f"{proxies} prox{'y' if proxies == 1 else 'ies'})")
    print(f"{'policy':<16}{'affinity':<10}{'TTFT P50':>9}{'P90':>8}{'P99':>8}{'E2E P50':>9}{'P99':>8}{'hit':>7}"
          f"{'kept':>7}  per node")
    for r in results:
        kept = "-" if r.kept_on_node is None else f"{r.kept_on_node:.3f}"
        print(f"{r.policy:<16}{r.affinity:<10}{r.ttft_s['p50']:>9.3f}{r.ttft_s['p90']:>8.3f}{r.ttft_s['p99']:>8.3f}"
              f"{r.e2e_s['p50']:>9.3f}{r.e2e_s['p99']:>8.3f}{r.prefix_hit_rate:>7.3f}{kept:>7}  "
              + " ".join(f"{n}={c}" for n, c in r.per_node.items()))


def bench_virtual(scenarios: Sequence[Scenario], policies: Sequence[str], affinity: str | None, seed: int,
                  out: Path, proxies: int = 1) -> int:
    for scenario in scenarios:
        results = [run_virtual(scenario, policy, mode, seed, proxies) for policy, mode in rows_for(policies, affinity)]
        print_virtual(scenario, results)
        target = out / scenario.name
        target.mkdir(parents=True, exist_ok=True)
        (target / "virtual.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0
