"""`laswrr bench --virtual`: a trace scenario in virtual time, through the proxy's own routing table.

(A scenario with a timeline instead of a trace runs with the scheduler's core in the loop:
``bench.virtual_timeline``.)

What runs: the scenario's simulated engines (``services.sim_engine.physics.EngineSim``, the same
physics the engine processes run, prefix cache included) and the proxy's ``Router`` (the same
pick, prefix index and work referee as ``laswrr proxy``), driven by the trace's arrivals on a
virtual clock: no processes, no network, no scheduler. Each node's weight is its capacity (what
the scheduler's targets start from), fixed for the run. A run is deterministic, so two policies
are compared on exactly the same arrivals and the same engine physics, free of the machine's
load, in seconds instead of minutes. It measures what routing alone can change; the real stack
(`laswrr bench` without ``--virtual``) adds the scheduler's weights, the bus and HTTP.

``--proxies N``: N replicas take the requests in turn, each with its own routing table, prefix
index and counts. With ``--peer-interval-ms I`` (20, as ``laswrr proxy``; 0: off) they share them
over the channel between proxies as the proxies do (docs/proxy.md, "The channel between
proxies"): a replica's message goes to the others ``--peer-pick-ms`` (1) after a pick, with every
pick of that window, and every I ms of
virtual time from each replica whose counts changed otherwise or whose last message is half
``peer_stale_ms`` old (``Router.peer_due``); the others take it ``--peer-delay-ms`` later (2,
the bus's delivery time; 0: at once) and drop a peer silent for ``peer_stale_ms``. A replica
picks after its turn (``Router.stagger_s`` with the proxy's default turn, bounded by the
first-byte times it saw), as a proxy does. ``--fleet K`` runs K copies of the pool and of the
trace (``fleet``, ``fleet_requests``): K times the request rate on K times the engines. The run
writes ``peers.json`` beside ``virtual.json``: messages, bytes per message as encoded on the
bus, and bytes per request with the subjects against the request events' (``PeerTraffic``). ``kept`` is the share of the requests continuing an earlier prompt (sharing
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from laswrr.bench.scenarios import Scenario
from laswrr.bench.trace import load_workload
from laswrr.bench.virtual_timeline import bench_timeline, check_timeline
from laswrr.bench.workload import RequestSpec, prompt_text
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas import events as ev
from laswrr.schemas.codec import batch_item, encode
from laswrr.schemas.peers import PEER_ENCODER, PeerMessage, PeerState
from laswrr.bench.virtual_kv import KvFeed
from laswrr.bench.virtual_peers import PEER_DELAY_MS, VirtualChannel
from laswrr.schemas.words import Phase, RequestOutcome
from laswrr.scheduler.routing.prompt import prompt_text as indexed_text
from laswrr.scheduler.routing.prompt import RequestSize, request_size
from laswrr.scheduler.routing.router import DEFAULT_POOL, PEER_PICK_S, PEER_STAGGER_S, AdmitRequest, Admission, Router, scorer_for
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.prefix_cache import token_ids
from laswrr.services.sim_engine.profiles import get_profile

ORACLE = "oracle"
EXACT = "exact"  # a row's affinity with --kv-events: prefix affinity, and each router's exact view fed by the engines
_STEP, _DELIVER, _PEER, _ARRIVE, _PICK = 0, 1, 2, 3, 4
_T0_NS = 1_700_000_000_000_000_000  # an event time of today's size (its bytes): the peer messages' and PeerTraffic's events


@dataclass(slots=True)
class PeerTraffic:
    """What the channel between the virtual replicas carried, against the request events' bytes.

    ``bytes``: the messages' payloads as encoded on the bus; ``wire_bytes`` adds each message's
    subject. ``event_bytes``: the ``lb.req.started`` and ``lb.req.finished`` of every request as
    a proxy puts them in its batches (each a batch item, with a 32-hex request id and boot id),
    the base of the budget for the channel (docs/proxy.md, "The channel between proxies")."""

    messages: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    records: int = 0
    keys: int = 0
    requests: int = 0
    event_bytes: int = 0
    # what each message told, as [messages, wire bytes]: ``kind_of``
    kinds: dict[str, list[int]] = field(default_factory=dict)

    def add(self, message: PeerMessage, wire_bytes: int) -> None:
        """One message sent; ``wire_bytes``: its payload and its subject."""
        self.messages += 1
        self.bytes += len(PEER_ENCODER.encode(message))
        self.wire_bytes += wire_bytes
        self.records += len(message.prefixes)
        self.keys += sum(r.count for r in message.prefixes)
        counted = self.kinds.setdefault(kind_of(message), [0, 0])
        counted[0] += 1
        counted[1] += wire_bytes

    def request(self, node: str, spec: RequestSpec, ttft_s: float, e2e_s: float) -> None:
        """Count one finished request's events, encoded as the proxy's publisher encodes them."""
        rid, boot = f"{spec.index:032x}", "0" * 16
        started = ev.RequestStarted(request_id=rid, proxy="proxy-0", pool=DEFAULT_POOL, snapshot_seq=1,
                                    ts_ns=_T0_NS, boot_id=boot, prompt_tokens=spec.prompt_tokens,
                                    max_tokens=spec.max_tokens)
        finished = ev.RequestFinished(request_id=rid, proxy="proxy-0", outcome=RequestOutcome.COMPLETED,
                                      pool=DEFAULT_POOL, ttft_ms=round(ttft_s * 1000, 3),
                                      duration_ms=round(e2e_s * 1000, 3), prompt_tokens=spec.prompt_tokens,
                                      completion_tokens=spec.max_tokens, status=200, ts_ns=_T0_NS, boot_id=boot)
        self.requests += 1
        self.event_bytes += (len(batch_item(started.KIND, node, encode(started)))
                             + len(batch_item(finished.KIND, node, encode(finished))))

    def as_dict(self) -> dict[str, Any]:
        mean = self.bytes / self.messages if self.messages else 0.0
        per_request = self.wire_bytes / self.requests if self.requests else 0.0
        events = self.event_bytes / self.requests if self.requests else 0.0
        return {"messages": self.messages, "bytes": self.bytes, "bytes_per_message": round(mean, 1),
                "wire_bytes": self.wire_bytes, "wire_bytes_per_request": round(per_request, 1),
                "event_bytes_per_request": round(events, 1),
                "share_of_event_bytes": round(per_request / events, 4) if events else 0.0,
                "prefix_records": self.records, "prefix_keys": self.keys,
                "key_bytes_per_request": round(4 * self.keys / self.requests, 1) if self.requests else 0.0,
                "by_kind": {kind: {"messages": n, "per_request": round(n / self.requests, 3) if self.requests else 0.0,
                                   "wire_bytes_per_request": round(b / self.requests, 1) if self.requests else 0.0}
                            for kind, (n, b) in sorted(self.kinds.items())}}


def kind_of(message: PeerMessage) -> str:
    """What a peer message told, for ``PeerTraffic``: ``whole`` (a ``PeerState``), else the first
    of ``pick`` (some in-flight count rose), ``release`` (one fell), ``first_byte`` (a backlog
    fell, nothing else), ``other``."""
    if isinstance(message, PeerState):
        return "whole"
    if any(change > 0 for change in message.inflight.values()):
        return "pick"
    if message.inflight:
        return "release"
    return "first_byte" if any(change < 0 for change in message.backlog.values()) else "other"


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
    kv_events: dict[str, float] | None = None  # an exact row's KV event traffic (messages and bytes a request)

    def as_dict(self) -> dict[str, Any]:
        """The row as virtual.json holds it (``kv_events`` only on an exact row)."""
        row = asdict(self)
        if self.kv_events is None:
            del row["kv_events"]
        return row


def quantiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    at = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
    return {k: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) for k, q in at.items()}


FLEET_BLOCK_SPAN = 1 << 40  # copy j of a trace's block ids is offset by j times this: no copy shares a prefix with another


def fleet(scenario: Scenario, copies: int) -> Scenario:
    """``--fleet K``: the scenario's pool K times over (copy j > 0 of node ``n`` is ``n-j``), for
    ``fleet_requests``'s K copies of its trace: K times the request rate on K times the engines,
    each engine as loaded as in one copy."""
    if copies < 1:
        raise ValueError(f"--fleet must be >= 1, got {copies}")
    if copies == 1:
        return scenario
    engines = tuple(replace(e, node=e.node if j == 0 else f"{e.node}-{j}") for j in range(copies) for e in scenario.engines)
    return replace(scenario, engines=engines)


def fleet_requests(requests: Sequence[RequestSpec], copies: int) -> list[RequestSpec]:
    """K copies of a trace's requests, each with its own prefix blocks (copy j's ids offset by
    ``j * FLEET_BLOCK_SPAN``) and its arrivals ``j / K`` of the trace's mean gap between two
    distinct arrival stamps later: the copies' bursts fall between each other's, as independent
    users' would, not on the same instants (copies in lockstep make the pick order within a
    burst, and so the prefix hits, an artefact of the copying). Copy j's indices follow copy
    j - 1's, so the replicas taking the requests in turn by index share every copy's
    conversations as they share the original's."""
    if copies == 1:
        return list(requests)
    stamps = sorted({r.offset_s for r in requests})
    gap = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    count = len(requests)
    copied = [replace(r, index=j * count + r.index, offset_s=r.offset_s + gap * j / copies,
                      block_ids=tuple(b + j * FLEET_BLOCK_SPAN for b in r.block_ids))
              for j in range(copies) for r in requests]
    return sorted(copied, key=lambda r: (r.offset_s, r.index))


def _snapshot(scenario: Scenario) -> WeightSnapshot:
    idle = LoadView(queue=0.0, running=0.0, kv=0.0, npu=0.0, latency=0.0, load=0.0, sample_age_ms=None, stale=False)
    nodes = [NodeView(node=e.node, url=e.node, phase=Phase.ACTIVE, routable=True, capacity=e.capacity,
                      target_weight=float(e.capacity), effective_weight=float(e.capacity), inflight=0, chip=e.chip,
                      health=1.0, load=idle) for e in scenario.engines]
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=0, ts_ns=0, panic=False, nodes=nodes)


def _engines(scenario: Scenario, kv_events: bool = False) -> dict[str, EngineSim]:
    return {e.node: EngineSim(get_profile(e.chip), e.capacity, speed=scenario.speed, kv_tokens=scenario.kv_tokens,
                              kv_events=kv_events)
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
                proxies: int = 1, peer_interval_ms: int = 0, traffic: PeerTraffic | None = None,
                peer_delay_ms: float = PEER_DELAY_MS, peer_stagger_ms: float = PEER_STAGGER_S * 1000,
                copies: int = 1, peer_pick_ms: float = PEER_PICK_S * 1000) -> VirtualResult:
    """One row; ``proxies`` replicas take the requests in turn, each with its own routing table
    (no snapshot carries the others' counts here: without the channel, ``peer_interval_ms`` 0,
    each replica sees its own counts only; with it, what the peers' messages say). ``copies``:
    ``--fleet`` (``fleet``). ``affinity`` ``exact`` (``--kv-events``): prefix affinity, the engines'
    KV events feeding every router's exact view ``peer_delay_ms`` after each engine step
    (``bench.virtual_kv``), and each request's engine token ids in its admission, as a proxy with
    ``--tokenizer`` sends them."""
    if scenario.trace is None:
        raise ValueError(f"--virtual replays a trace; {scenario.name} is not a trace scenario")
    requests = fleet_requests(load_workload(scenario.trace), copies)
    scenario = fleet(scenario, copies)
    exact = affinity == EXACT
    engines = _engines(scenario, kv_events=exact)
    share = proxies > 1 and peer_interval_ms > 0
    scoring = "prefix" if exact else affinity
    if policy == ORACLE:
        routers = []
    elif share:
        routers = [Router(policy, seed + k, scorer=scorer_for(scoring), proxy_id=f"proxy-{k}", share=True,
                          peer_stagger_s=peer_stagger_ms / 1000, peer_pick_s=peer_pick_ms / 1000)
                   for k in range(proxies)]
    else:
        routers = [Router(policy, seed + k, scorer=scorer_for(scoring)) for k in range(proxies)]
    for router in routers:
        router.table.offer(_snapshot(scenario), now=0.0)
    traffic = traffic if traffic is not None else PeerTraffic()
    interval = peer_interval_ms / 1000
    queue: list[tuple[float, int, int, object]] = [(r.offset_s, _ARRIVE, i, r) for i, r in enumerate(requests)]
    order = len(queue)

    def schedule(at: float, deliver: Callable[[float], None]) -> None:
        nonlocal order
        heapq.heappush(queue, (at, _DELIVER, order, deliver))
        order += 1

    channel = VirtualChannel(routers, traffic.add, ts_ns=lambda now: _T0_NS + round(now * 1e9),
                             delay_s=peer_delay_ms / 1000, schedule=schedule)
    if share:
        channel.start(0.0)
    feed = KvFeed(engines, routers, schedule, peer_delay_ms / 1000) if exact else None
    if feed is not None:
        feed.start(0.0)
    continuations = Continuations()
    if share and routers:
        for k in range(len(routers)):
            queue.append((interval, _PEER, order, k))
            order += 1
    heapq.heapify(queue)
    pending = len(requests)  # arrivals not routed yet, and requests not finished: peers speak while any
    live: dict[tuple[str, int], tuple[float, Router | None, Admission | None, RequestSpec]] = {}
    first_at: dict[tuple[str, int], float] = {}
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
        if kind == _DELIVER:
            item(now)  # type: ignore[operator]
            continue
        if kind == _PEER:
            assert isinstance(item, int)
            if not pending:
                continue
            if channel.due(item, now):
                channel.speak(item, now)
            heapq.heappush(queue, (now + interval, _PEER, order, item))
            order += 1
            continue
        if kind in (_ARRIVE, _PICK):
            arrived = now
            if kind == _PICK:  # after the replica's wait (Router.stagger_s)
                item, arrived = item  # type: ignore[misc]
            assert isinstance(item, RequestSpec)
            text = prompt_text(item)
            admission = router = None
            if not routers:
                node = min(engines, key=lambda n: (engines[n].first_token_eta(item.prompt_tokens, text, now), n))
            else:
                router = routers[item.index % len(routers)]
                if router.channel is not None:
                    router.channel.expire(now)
                    wait = router.stagger_s(DEFAULT_POOL) if kind == _ARRIVE else 0.0
                    if wait:
                        heapq.heappush(queue, (now + wait, _PICK, order, (item, now)))
                        order += 1
                        continue
                seen = indexed_text([{"role": "user", "content": text}], None)
                size, tokens = request_size(seen, item.max_tokens, None), None
                if feed is not None:  # its engine's tokens: the text's, and one for the message (workload.prompt_text)
                    tokens = (*token_ids(text), 0)
                    size = RequestSize(len(tokens), size.max_tokens)
                admission = router.admitter.admit(AdmitRequest(DEFAULT_POOL, (), seen, size, tokens=tokens))
                assert isinstance(admission, Admission)
                node = admission.node
                if share:  # a pick is told within peer_pick_s, as the proxy's bus does (Router.on_pick)
                    channel.picked(item.index % len(routers), now)
            per_node[node] += 1
            continuations.served(item.block_ids, node)
            engine = engines[node]
            submitted = engine.submit(item.prompt_tokens, item.max_tokens, now, prompt_text=text)
            live[(node, submitted.req_id)] = (arrived, router, admission, item)
            wake(node, now)
            continue
        assert isinstance(item, str)
        for event in engines[item].advance(now):
            arrived, router, admission, spec = live[(item, event.req_id)]
            if event.index == 0:
                ttft.append(event.time - arrived)
                first_at[(item, event.req_id)] = event.time
                if admission is not None and router is not None:
                    router.admitter.prefilled(admission)
                    router.first_byte(event.time - arrived)
            if event.finished:
                e2e.append(event.time - arrived)
                if share:
                    traffic.request(item, spec, first_at.pop((item, event.req_id)) - arrived, event.time - arrived)
                del live[(item, event.req_id)]
                pending -= 1
                if admission is not None and router is not None:
                    router.admitter.release(admission)
        if feed is not None:
            feed.step(item, now)
        wake(item, now)
    queries = sum(e.prefix_cache.queries for e in engines.values())
    hits = sum(e.prefix_cache.hits for e in engines.values())
    mode = EXACT if exact and routers else routers[0].affinity_mode if routers else "-"
    kv = None if feed is None or not ttft else {
        "messages": feed.messages, "messages_per_request": round(feed.messages / len(ttft), 2),
        "bytes_per_request": round(feed.bytes / len(ttft), 1)}
    return VirtualResult(policy=policy, affinity=mode, requests=len(ttft),
                         ttft_s=quantiles(ttft), e2e_s=quantiles(e2e),
                         prefix_hit_rate=round(hits / queries, 4) if queries else 0.0,
                         proxies=len(routers) or 1, kept_on_node=continuations.share, per_node=per_node, kv_events=kv)


def rows_for(policies: Sequence[str], affinity: str | None, kv_events: bool = False) -> list[tuple[str, str]]:
    """The (policy, affinity) rows; ``kv_events``: la-swrr's prefix row gets an ``exact`` twin after it."""
    rows: list[tuple[str, str]] = []
    for policy in policies:
        modes = ["prefix", "none"] if policy == "la-swrr" and affinity is None else [affinity or "prefix"]
        if kv_events and policy == "la-swrr" and "prefix" in modes:
            modes.insert(modes.index("prefix") + 1, EXACT)
        rows += [(policy, mode) for mode in modes]
    return rows + [(ORACLE, "-")]


def print_virtual(scenario: Scenario, results: Sequence[VirtualResult]) -> None:
    proxies = max((r.proxies for r in results), default=1)
    print(f"{scenario.name} in virtual time ({results[0].requests if results else 0} requests, "
          f"{len(scenario.engines)} engines, weights = capacities, "
          f"{proxies} prox{'y' if proxies == 1 else 'ies'})")
    print(f"{'policy':<16}{'affinity':<10}{'TTFT P50':>9}{'P90':>8}{'P99':>8}{'E2E P50':>9}{'P99':>8}{'hit':>7}"
          f"{'kept':>7}  per node")
    for r in results:
        kept = "-" if r.kept_on_node is None else f"{r.kept_on_node:.3f}"
        print(f"{r.policy:<16}{r.affinity:<10}{r.ttft_s['p50']:>9.3f}{r.ttft_s['p90']:>8.3f}{r.ttft_s['p99']:>8.3f}"
              f"{r.e2e_s['p50']:>9.3f}{r.e2e_s['p99']:>8.3f}{r.prefix_hit_rate:>7.3f}{kept:>7}  "
              + " ".join(f"{n}={c}" for n, c in r.per_node.items()))


def bench_virtual(scenarios: Sequence[Scenario], policies: Sequence[str], affinity: str | None, seed: int,
                  out: Path, proxies: int = 1, peer_interval_ms: int = 0, peer_delay_ms: float = PEER_DELAY_MS,
                  copies: int = 1, peer_pick_ms: float = PEER_PICK_S * 1000, kv_events: bool = False) -> int:
    share = proxies > 1 and peer_interval_ms > 0
    for scenario in scenarios:
        if scenario.trace is None:  # a timeline scenario: the scheduler's core in the loop
            if copies != 1:
                raise ValueError(f"--fleet copies a trace scenario; {scenario.name} is a timeline")
            if kv_events:
                why = f"--kv-events runs on trace scenarios, not on {scenario.name} (a timeline)"
                if len(scenarios) == 1:
                    raise ValueError(why)
                print(f"{scenario.name}: skipped ({why})")
                continue
            try:
                check_timeline(scenario)
            except ValueError as exc:
                if len(scenarios) == 1:
                    raise
                print(f"{scenario.name}: skipped ({exc})")  # --scenario all: the others still run
                continue
            bench_timeline(scenario, policies, affinity, seed, out, proxies, peer_interval_ms, peer_delay_ms, peer_pick_ms)
            continue
        pool = fleet(scenario, copies)  # what runs (and a bad --fleet refused before any row)
        plain = [policy for policy in policies if "+" not in policy]
        if len(plain) < len(policies):
            why = f"policy variants run in virtual time on timeline scenarios, not on {scenario.name} (its weights are fixed)"
            if len(scenarios) == 1:
                raise ValueError(why)
            print(f"{scenario.name}: {why}: left out")
        results, traffic = [], {}
        for policy, mode in rows_for(plain, affinity, kv_events):
            carried = PeerTraffic()
            results.append(run_virtual(scenario, policy, mode, seed, proxies, peer_interval_ms, carried, peer_delay_ms,
                                       copies=copies, peer_pick_ms=peer_pick_ms))
            if share and policy != ORACLE:
                traffic[f"{policy}/{mode}"] = carried.as_dict()
        print_virtual(pool, results)
        target = out / scenario.name
        target.mkdir(parents=True, exist_ok=True)
        (target / "virtual.json").write_text(json.dumps([r.as_dict() for r in results], indent=1) + "\n")
        for r in results:
            if r.kv_events is not None:
                print(f"KV events ({r.policy}/{r.affinity}, each delivered {peer_delay_ms:g} ms after its engine step): "
                      f"{r.kv_events['messages']} messages, {r.kv_events['messages_per_request']:.2f} and "
                      f"{r.kv_events['bytes_per_request']:.0f} B with subjects a request")
        if share:
            print(f"channel between proxies (picks within {peer_pick_ms:g} ms, the rest within {peer_interval_ms} ms, each message "
                  f"delivered {peer_delay_ms:g} ms after it was sent): " + "; ".join(
                      f"{row} {t['messages']} messages, {t['bytes_per_message']:.0f} B each, "
                      f"{t['wire_bytes_per_request']:.0f} B a request with subjects = "
                      f"{100 * t['share_of_event_bytes']:.0f} % of the request events' "
                      f"{t['event_bytes_per_request']:.0f} B (a request: "
                      + ", ".join(f"{k['per_request']:.2f} {kind} messages" for kind, k in t['by_kind'].items())
                      + f", {t['key_bytes_per_request']:.0f} B of prefix keys)" for row, t in traffic.items()))
            (target / "peers.json").write_text(json.dumps(traffic, indent=1) + "\n")
    return 0
