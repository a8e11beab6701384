"""`laswrr bench --virtual`: a trace scenario in virtual time, through the proxy's own routing table.

What runs: the scenario's simulated engines (``services.sim_engine.physics.EngineSim``, the same
physics the engine processes run, prefix cache included) and the proxy's ``Router`` (the same
pick, prefix index and work referee as ``laswrr proxy``), driven by the trace's arrivals on a
virtual clock: no processes, no network, no scheduler. Each node's weight is its capacity (what
the scheduler's targets start from), fixed for the run. A run is deterministic, so two policies
are compared on exactly the same arrivals and the same engine physics, free of the machine's
load, in seconds instead of minutes. It measures what routing alone can change; the real stack
(`laswrr bench` without ``--virtual``) adds the scheduler's weights, the bus and HTTP.

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


def run_virtual(scenario: Scenario, policy: str, affinity: str = "prefix", seed: int = 1) -> VirtualResult:
    if scenario.trace is None:
        raise ValueError(f"--virtual replays a trace; {scenario.name} is not a trace scenario")
    requests = load_workload(scenario.trace)
    engines = _engines(scenario)
    router = None if policy == ORACLE else Router(policy, seed, affinity=affinity)
    if router is not None:
        router.offer(_snapshot(scenario), now=0.0)
    queue: list[tuple[float, int, int, object]] = [(r.offset_s, _ARRIVE, i, r) for i, r in enumerate(requests)]
    heapq.heapify(queue)
    order = len(queue)
    live: dict[tuple[str, int], tuple[float, Admission | None]] = {}
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
            admission = None
            if router is None:
                node = min(engines, key=lambda n: (engines[n].first_token_eta(item.prompt_tokens, text, now), n))
            else:
                seen = indexed_text([{"role": "user", "content": text}], None)
                admission = router.admit(DEFAULT_POOL, prompt=seen, size=request_size(seen, item.max_tokens, None))
                assert admission is not None
                node = admission.node
            per_node[node] += 1
            engine = engines[node]
            submitted = engine.submit(item.prompt_tokens, item.max_tokens, now, prompt_text=text)
            live[(node, submitted.req_id)] = (now, admission)
            wake(node, now)
            continue
        assert isinstance(item, str)
        for event in engines[item].advance(now):
            arrived, admission = live[(item, event.req_id)]
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
    return VirtualResult(policy=policy, affinity="-" if router is None else router.affinity_mode, requests=len(ttft),
                         ttft_s=quantiles(ttft), e2e_s=quantiles(e2e),
                         prefix_hit_rate=round(hits / queries, 4) if queries else 0.0, per_node=per_node)


def rows_for(policies: Sequence[str], affinity: str | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for policy in policies:
        if policy == "la-swrr" and affinity is None:
            rows += [(policy, "prefix"), (policy, "none")]
        else:
            rows.append((policy, affinity or "prefix"))
    return rows + [(ORACLE, "-")]


def print_virtual(scenario: Scenario, results: Sequence[VirtualResult]) -> None:
    print(f"{scenario.name} in virtual time ({results[0].requests if results else 0} requests, weights = capacities)")
    print(f"{'policy':<16}{'affinity':<10}{'TTFT P50':>9}{'P90':>8}{'P99':>8}{'E2E P50':>9}{'P99':>8}{'hit':>7}  per node")
    for r in results:
        print(f"{r.policy:<16}{r.affinity:<10}{r.ttft_s['p50']:>9.3f}{r.ttft_s['p90']:>8.3f}{r.ttft_s['p99']:>8.3f}"
              f"{r.e2e_s['p50']:>9.3f}{r.e2e_s['p99']:>8.3f}{r.prefix_hit_rate:>7.3f}  "
              + " ".join(f"{n}={c}" for n, c in r.per_node.items()))


def bench_virtual(scenarios: Sequence[Scenario], policies: Sequence[str], affinity: str | None, seed: int,
                  out: Path) -> int:
    for scenario in scenarios:
        results = [run_virtual(scenario, policy, mode, seed) for policy, mode in rows_for(policies, affinity)]
        print_virtual(scenario, results)
        target = out / scenario.name
        target.mkdir(parents=True, exist_ok=True)
        (target / "virtual.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0
