"""`laswrr bench --virtual` for timeline scenarios: the scheduler's core in the loop, in virtual time.

A trace scenario in virtual time routes on fixed weights (``bench.virtual``). A timeline scenario
(``silent-slowdown-mindie``, ``announced-drop``, ...) is about how the weights *move*, so here the
real core (``scheduler.core.Scheduler``, through ``scheduler.fold.Fold`` as the scheduler service
applies its inputs) takes the inputs the running stack would give it, stamped with virtual time:

* the nodes' registrations at 0 (and ``scenario.scheduler_config`` as an ``lb.admin.config``);
* ``lb.clock.tick`` every ``TICK_S`` (the scheduler's ``--tick-ms`` 100); every snapshot the core
  emits goes to the proxy's ``Router`` at once (the bus's delay is not modelled);
* per node, an ``lb.metrics.engine`` sample every ``SAMPLE_S`` (the collector's ``--interval-ms``
  500): running, waiting and KV use from the engine, TTFT and E2E as the means over the requests
  that got them since the node's last sample (what the collector takes from the histograms'
  deltas). On a MindIE-flavoured engine read through its status (``la-swrr``) the sample also
  carries ``free_slots`` (the engine's current slots less running, as ``/v1/status``'s
  ``availSlotsNum``) and its KV blocks; ``la-swrr+no-status`` leaves them out (the collector not
  told the ``status_url``, as the real stack's variant);
* ``lb.req.started`` at each admission (with the proxy's prompt estimate and ``max_tokens``) and
  ``lb.req.finished`` at each end (TTFT and duration), as one proxy publishes them;
* per node, ``lb.metrics.npu`` samples as the collector makes them from the simulated engine's
  chips: a MindIE-flavoured engine's through its npu-exporter (the cache refreshed every
  ``EXPORTER_UPDATE_S``, scraped every ``EXPORTER_S``: the text ``services.sim_engine.mindie``
  serves, parsed and mapped to health by the collector's own parser and fault-code table), any
  other's through npu-smi every ``NPU_SMI_S`` (the simulated table, parsed by the collector's
  parser); each carries the collector's ``max_age_ms`` for its source;
* the scenario's actions: ``capacity`` and ``slowdown`` on the engine, ``lb.admin.capacity`` with
  an announced capacity, ``health`` and ``fault_code`` on the chips (seen at the source's next
  refresh, as on the real stack).

The engines are the simulator's physics (``services.sim_engine.physics.EngineSim``), the requests
the generated workload every policy of ``laswrr bench`` gets (the same seed, the same arrivals and
lengths), cancellations included. Everything is deterministic: two policies see exactly the same
arrivals and physics, free of the machine's load. What it leaves out: HTTP, the bus's and the
collector's delays (a sample here is the engine's state at that instant), and the peer routers
(processes; ``p2c`` is the in-process power of two choices on in-flight counts, what vllm-router's
``power_of_two`` does with its own counts).

Per policy: the figures per phase as ``laswrr bench`` reports them (``bench.metrics.by_phase``),
the silently slowed node's requests in the focus phase and, for la-swrr, the seconds from the loss
to its target weight halved (``bench.report.slowed_node``'s rules). ``bound``: the focus phase's
E2E P99 if every request ran alone on a healthy engine of its kind (each request's own time, at a
batch of one, no queue): no router can make a request faster than that, so no router's focus P99
is below it (docs/ascend.md §9).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from laswrr.bench.metrics import ClientOutcome, Phase, RequestResult, by_phase, percentile
from laswrr.bench.report import silent_loss
from laswrr.bench.scenarios import Scenario
from laswrr.bench.virtual_peers import PEER_DELAY_MS, VirtualChannel
from laswrr.bench.workload import RequestSpec, generate, prompt_text
from laswrr.scheduler.fold import Fold, rejections
from laswrr.scheduler.routing.prompt import prompt_text as indexed_text
from laswrr.scheduler.routing.prompt import request_size
from laswrr.scheduler.routing.router import (DEFAULT_POOL, PEER_PICK_S, PEER_STAGGER_S, AdmitRequest, Admission, Router,
                                             scorer_for)
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, decode_snapshot
from laswrr.schemas.words import NpuHealth, RequestOutcome
from laswrr.collectors.exporter import load_fault_table
from laswrr.collectors.npu_exporter import parse_exporter, select_exporter_chips, to_npu_chip
from laswrr.collectors.npu_smi import parse_info
from laswrr.collectors.poller import max_age_ms
from laswrr.services.sim_engine import npu_smi
from laswrr.services.sim_engine.mindie import blocks, exporter_text
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile

TICK_S = 0.1  # the scheduler service's --tick-ms
SAMPLE_S = 0.5  # the collector's --interval-ms
NPU_SMI_S = 2.0  # the collector's --npu-interval-ms
EXPORTER_S = 5.0  # the collector's --exporter-interval-ms
EXPORTER_UPDATE_S = 5.0  # the simulated npu-exporter's cache refresh (sim-engine --exporter-update-s)
T0_S = 1_700_000_000.0  # virtual 0 on the wall clock the exporter stamps its cache with
PROXY = "virtual"
T0_NS = 1_700_000_000_000_000_000  # virtual time 0 as event time (any fixed origin: the core reads differences)
FAULT_TABLE = load_fault_table()
ORACLE = "oracle"
NO_STATUS = "+no-status"
VARIANTS = {NO_STATUS: {}, "+cap": {"inflight_cap_per_capacity": 1.0}}  # the real stack's variants that apply here
# at one instant: engine steps end, then actions, samples, ticks, cancellations, peers speak, and
# arrivals are routed last
_STEP, _ACTION, _SAMPLE, _NPU, _TICK, _CANCEL, _DELIVER, _PEER, _ARRIVE, _PICK = range(10)
_SUPPORTED_ACTIONS = frozenset({"capacity", "slowdown", "health", "fault_code"})


@dataclass(slots=True)
class TimelineResult:
    policy: str
    requests: int
    phases: dict[str, dict[str, Any]]
    per_node: dict[str, int]
    slowed_node: dict[str, Any] | None = None
    fault: dict[str, Any] | None = None  # bench.report.fault_reaction's figures
    weights: list[tuple[float, dict[str, tuple[float, float]]]] = field(default_factory=list)  # (t, node -> (target, effective)) each tick
    # the focus phase's completed requests, each against its own time alone on a healthy engine
    # (``alone_e2e``): the P99 of those times (a floor under this row's E2E P99: each request is at
    # least that slow), and the P99 of the stretch E2E / alone
    focus_alone_p99: float | None = None
    focus_stretch_p99: float | None = None
    detail: list[RequestResult] = field(default_factory=list, repr=False)  # every request (not in virtual.json)


def split_policy(policy: str) -> tuple[str, str]:
    """(base policy, variant) of ``la-swrr+no-status`` and the like; ValueError on a variant not modelled."""
    base, plus, variant = policy.partition("+")
    if plus and plus + variant not in VARIANTS:
        raise ValueError(f"--virtual models the variants {', '.join(VARIANTS)}, not +{variant}")
    return base, (plus + variant if plus else "")


def check_timeline(scenario: Scenario) -> None:
    if scenario.pd_protocol is not None:
        raise ValueError(f"--virtual does not model prefill/decode pools ({scenario.name})")
    unsupported = sorted({a.kind for a in scenario.actions} - _SUPPORTED_ACTIONS)
    if unsupported:
        raise ValueError(f"--virtual models the actions {', '.join(sorted(_SUPPORTED_ACTIONS))}; "
                         f"{scenario.name} has {', '.join(unsupported)}")
    if scenario.tenants:
        raise ValueError(f"--virtual does not model API keys and flow control ({scenario.name})")


def timeline_requests(scenario: Scenario, seed: int) -> list[RequestSpec]:
    """The generated workload ``laswrr bench`` sends every policy (bench.cli.bench_workload)."""
    return generate(scenario.workload_spec(), seed, [(p.start_s, p.end_s) for p in scenario.phases])


class _Chips:
    """One engine's chips as its NPU source shows them (module docstring): the state document the
    simulated engine builds (``services.sim_engine.app.sim_state``'s ``npu`` part), its health and
    fault code set by the scenario's actions, and the exporter's cache."""

    def __init__(self, node: str, chip: str, flavour: str) -> None:
        self.node, self.profile, self.exporter = node, get_profile(chip), flavour == "mindie"
        self.health, self.fault_code = str(NpuHealth.OK), ""
        self.cache, self.cached_at = "", float("-inf")

    def state(self, engine: EngineSim, now: float) -> dict[str, Any]:
        snap = engine.snapshot(now)
        npu = npu_smi.readings(self.profile, snap.running, snap.capacity, True)
        return {"node_id": self.node, "health": self.health, "fault_code": self.fault_code,
                "npu": {"name": self.profile.npu_name, "chips": self.profile.chips_per_npu, "aicore_pct": npu.aicore_pct,
                        "hbm_used_mb": npu.hbm_used_mb, "hbm_total_mb": npu.hbm_total_mb, "power_w": npu.power_w,
                        "temp_c": npu.temp_c}}

    def sample(self, engine: EngineSim, now: float) -> dict[str, Any] | None:
        """The ``lb.metrics.npu`` payload the collector would publish now; None: no fresh chip."""
        if not self.exporter:
            chips = parse_info(npu_smi.render(self.state(engine, now)))
            return {"chips": [msgspec.to_builtins(c) for c in chips], "max_age_ms": max_age_ms(NPU_SMI_S)}
        if now - self.cached_at >= EXPORTER_UPDATE_S:  # the exporter's cache, refreshed when due (as the sim's)
            self.cached_at = now
            self.cache = exporter_text(self.state(engine, now), 0, now_s=T0_S + self.cached_at)
        scrape = parse_exporter(self.cache, now_s=T0_S + now, max_age_s=3 * EXPORTER_S)
        mine = select_exporter_chips(scrape.all_chips, (0,), (), {}, self.profile.chips_per_npu)
        if not mine or any(c.missing is not None for c in mine):
            return None
        chips = [to_npu_chip(c, FAULT_TABLE, self.profile.chips_per_npu) for c in mine]
        return {"chips": [msgspec.to_builtins(c) for c in chips], "max_age_ms": max_age_ms(EXPORTER_S)}


class _Core:
    """The scheduler core fed envelopes stamped with virtual time; the snapshots it emits."""

    def __init__(self) -> None:
        self.fold = Fold()
        self.seq = 0
        self.snapshots: list[tuple[float, Any]] = []

    def put(self, now: float, subject: str, payload: dict[str, Any]) -> list[Any]:
        self.seq += 1
        envelope = Envelope(self.seq, T0_NS + round(now * 1e9), subject, msgspec.json.encode(payload))
        outputs = self.fold.apply(envelope)
        if self.fold.fault is not None:
            raise RuntimeError(f"the core broke an invariant on {subject}: {self.fold.fault}")
        rejected = rejections(outputs)
        if rejected:
            raise RuntimeError(f"the core rejected {subject} {payload}: {rejected[0].data.decode()}")
        snaps = [decode_snapshot(o.data) for o in outputs if o.subject == sj.out_snapshot(DEFAULT_POOL)]
        self.snapshots += [(now, s) for s in snaps]
        return snaps


def isolated_e2e(scenario: Scenario, spec: RequestSpec, chip: str, capacity: int) -> float:
    """The request's E2E alone on a fresh, healthy engine of ``chip`` (batch of one, no queue)."""
    engine = EngineSim(get_profile(chip), capacity, speed=scenario.speed, kv_tokens=scenario.kv_tokens)
    engine.submit(spec.prompt_tokens, spec.max_tokens, 0.0)
    last = 0.0
    while (at := engine.next_event_time()) is not None:
        for event in engine.advance(at):
            last = event.time
    return last


class Alone:
    """Each request's E2E alone on a fresh, healthy engine of the pool's fastest kind (batch of
    one, no queue, no cached prefix), computed once per request."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        probe = RequestSpec(0, 0.0, 400, 96, None)
        self.engine = min(scenario.engines, key=lambda e: isolated_e2e(scenario, probe, e.chip, e.capacity))
        self.times: dict[int, float] = {}

    def __call__(self, spec: RequestSpec) -> float:
        if spec.index not in self.times:
            self.times[spec.index] = isolated_e2e(self.scenario, spec, self.engine.chip, self.engine.capacity)
        return self.times[spec.index]


def focus_alone(scenario: Scenario, results: Sequence[RequestResult], specs: dict[int, RequestSpec],
                alone: Alone) -> tuple[float | None, float | None]:
    """(P99 of the focus phase's completed requests' alone times, P99 of their stretch E2E / alone)."""
    focus = next((p for p in scenario.phases if p.name == scenario.focus_phase), None)
    done = [r for r in results if focus is not None and focus.contains(r.start_s) and r.e2e_s is not None]
    times = [alone(specs[r.index]) for r in done]
    stretch = [r.e2e_s / t for r, t in zip(done, times) if r.e2e_s is not None and t > 0]
    bound, worst = percentile(times, 99), percentile(stretch, 99)
    return (None if bound is None else round(bound, 4)), (None if worst is None else round(worst, 3))


def run_timeline(scenario: Scenario, policy: str, seed: int, requests: Sequence[RequestSpec],
                 affinity: str = "prefix", alone: Alone | None = None, proxies: int = 1,
                 peer_interval_ms: int = 0, peer_delay_ms: float = PEER_DELAY_MS,
                 peer_stagger_ms: float = PEER_STAGGER_S * 1000, peer_pick_ms: float = PEER_PICK_S * 1000) -> TimelineResult:
    """One policy on ``scenario``'s timeline (module docstring). ``proxies`` > 1: that many
    replicas take the requests in turn, each its own ``Router`` (proxy id ``virtual-<k>``) and its
    own request events, so the snapshots split the in-flight counts by proxy as the scheduler
    does; with ``peer_interval_ms`` > 0 they share over the channel between proxies as
    ``bench.virtual`` runs it (a pick told ``peer_pick_ms`` later with the window's others, the rest when ``Router.peer_due``; each
    message taken by the others ``peer_delay_ms`` after it was sent)."""
    base, variant = split_policy(policy)
    status = variant != NO_STATUS
    engines = {e.node: EngineSim(get_profile(e.chip), e.capacity, speed=scenario.speed, kv_tokens=scenario.kv_tokens)
               for e in scenario.engines}
    flavour = {e.node: e.flavour for e in scenario.engines}
    chips = {e.node: _Chips(e.node, e.chip, e.flavour) for e in scenario.engines}
    core = _Core()
    share = proxies > 1 and peer_interval_ms > 0
    names = [PROXY] if proxies == 1 else [f"{PROXY}-{k}" for k in range(proxies)]
    routers = [] if base == ORACLE else [
        Router(base, seed + k, scorer=scorer_for(affinity), proxy_id=name, share=share, peer_stagger_s=peer_stagger_ms / 1000,
               peer_pick_s=peer_pick_ms / 1000,
               **VARIANTS.get(variant, {}))  # type: ignore[arg-type]
        for k, name in enumerate(names)]
    router = routers[0] if routers else None
    queue: list[tuple[float, int, int, object]] = [(r.offset_s, _ARRIVE, i, r) for i, r in enumerate(requests)]
    order = len(queue)

    def push(at: float, kind: int, item: object) -> None:
        nonlocal order
        heapq.heappush(queue, (at, kind, order, item))
        order += 1

    channel = VirtualChannel(routers, ts_ns=lambda now: T0_NS + round(now * 1e9), delay_s=peer_delay_ms / 1000,
                             schedule=lambda at, deliver: push(at, _DELIVER, deliver))

    def owner(spec: RequestSpec) -> int:
        return spec.index % len(names)  # the replica that takes the request

    def offer(now: float, snaps: list[Any]) -> None:
        for snap in snaps:
            for each in routers:
                each.table.offer(snap, now)

    if scenario.scheduler_config:
        offer(0.0, core.put(0.0, sj.ADMIN_CONFIG, {"set": dict(scenario.scheduler_config)}))
    for e in scenario.engines:
        offer(0.0, core.put(0.0, sj.admin_node(e.node), {"url": f"http://{e.node}:8000", "capacity": e.capacity,
                                                         "pool": DEFAULT_POOL, "chip": e.chip}))
    if share:
        channel.start(0.0)
    end_s = scenario.duration_s
    for action in scenario.actions:
        queue.append((action.at_s, _ACTION, order, action))
        order += 1
    queue += [(0.0, _TICK, order, None), (SAMPLE_S, _SAMPLE, order + 1, None)]
    order += 2
    for k, e in enumerate(scenario.engines):  # the collector staggers its NPU loops over their period
        period = EXPORTER_S if chips[e.node].exporter else NPU_SMI_S
        queue.append((period * k / len(scenario.engines), _NPU, order, e.node))
        order += 1
    if share:
        for k in range(len(routers)):
            queue.append((peer_interval_ms / 1000, _PEER, order, k))
            order += 1
    heapq.heapify(queue)
    live: dict[tuple[str, int], tuple[RequestSpec, float, float | None, Admission | None]] = {}
    by_engine: dict[tuple[str, int], str] = {}  # (node, engine req id) -> request id
    results: dict[int, RequestResult] = {}
    fresh: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in engines}  # TTFTs, E2Es since the sample
    per_node = dict.fromkeys(engines, 0)
    tick = 0
    weights: list[tuple[float, dict[str, tuple[float, float]]]] = []

    def wake(node: str, now: float) -> None:
        at = engines[node].next_event_time()
        if at is not None:
            push(max(at, now), _STEP, node)

    def finish(node: str, req_id: int, now: float, outcome: RequestOutcome) -> None:
        spec, arrived, first, admission = live.pop((node, req_id))
        request_id = by_engine.pop((node, req_id))
        e2e = now - arrived if outcome == RequestOutcome.COMPLETED else None
        results[spec.index] = RequestResult(
            index=spec.index, start_s=arrived, end_s=now, ttft_s=None if first is None else first - arrived,
            e2e_s=e2e, node=node, outcome=ClientOutcome(outcome.value), tokens=0, max_tokens=spec.max_tokens)
        if e2e is not None:
            fresh[node][1].append(e2e)
        if routers and admission is not None:
            routers[owner(spec)].admitter.release(admission)
        offer(now, core.put(now, sj.req_finished(node), {
            "request_id": request_id, "proxy": names[owner(spec)], "outcome": outcome.value, "pool": DEFAULT_POOL,
            "ttft_ms": None if first is None else round((first - arrived) * 1000, 3),
            "duration_ms": round((now - arrived) * 1000, 3)}))

    while queue:
        now, kind, _, item = heapq.heappop(queue)
        if kind == _DELIVER:
            item(now)  # type: ignore[operator]
            continue
        if kind == _PEER:
            assert isinstance(item, int)
            if now > end_s and not live:
                continue
            expiring = routers[item].channel
            if expiring is not None:
                expiring.expire(now)
            if channel.due(item, now):
                channel.speak(item, now)
            push(now + peer_interval_ms / 1000, _PEER, item)
            continue
        if kind == _TICK:
            if now > end_s and not live:
                continue
            tick += 1
            snaps = core.put(now, sj.CLOCK_TICK, {"tick": tick})
            offer(now, snaps)
            for snap in snaps:
                weights.append((round(now, 3), {v.node: (v.target_weight, v.effective_weight) for v in snap.nodes}))
            push(now + TICK_S, _TICK, None)
            continue
        if kind == _SAMPLE:
            if now > end_s and not live:
                continue
            for node, engine in engines.items():
                snap = engine.snapshot(now)
                ttfts, e2es = fresh[node]
                payload: dict[str, Any] = {
                    "running": snap.running, "waiting": snap.waiting, "kv_cache_usage": round(snap.kv_usage, 6),
                    "ttft_ms": round(1000 * sum(ttfts) / len(ttfts), 3) if ttfts else None,
                    "e2e_ms": round(1000 * sum(e2es) / len(e2es), 3) if e2es else None}
                if status and flavour[node] == "mindie":
                    free, total = blocks(snap.kv_tokens_used, snap.kv_tokens_total)
                    payload |= {"free_slots": max(0, snap.capacity - snap.running), "free_blocks": free,
                                "total_blocks": total}
                fresh[node] = ([], [])
                offer(now, core.put(now, sj.metrics_engine(node), payload))
            push(now + SAMPLE_S, _SAMPLE, None)
            continue
        if kind == _NPU:
            assert isinstance(item, str)
            if now > end_s and not live:
                continue
            source = chips[item]
            npu = source.sample(engines[item], now)
            if npu is not None:
                offer(now, core.put(now, sj.metrics_npu(item), npu))
            push(now + (EXPORTER_S if source.exporter else NPU_SMI_S), _NPU, item)
            continue
        if kind == _ACTION:
            action: Any = item
            engine = engines[action.node]
            if action.kind == "capacity":
                engine.set_capacity(int(action.value))
                if action.announce:
                    offer(now, core.put(now, sj.admin_capacity(action.node), {"capacity": int(action.value)}))
            elif action.kind == "slowdown":
                engine.set_slowdown(float(action.value))
            elif action.kind == "health":
                chips[action.node].health = str(action.value)
            else:
                chips[action.node].fault_code = str(action.value)
            wake(action.node, now)
            continue
        if kind == _CANCEL:
            node, req_id = item  # type: ignore[misc]
            if (node, req_id) in live and engines[node].cancel(req_id) is not None:
                finish(node, req_id, now, RequestOutcome.CLIENT_CANCELLED)
                wake(node, now)
            continue
        if kind in (_ARRIVE, _PICK):
            arrived = now
            if kind == _PICK:  # after the replica's wait (Router.stagger_s)
                item, arrived = item  # type: ignore[misc]
            assert isinstance(item, RequestSpec)
            if share and kind == _ARRIVE and routers:  # the oracle row has no replicas to stagger
                wait = routers[owner(item)].stagger_s(DEFAULT_POOL)
                if wait:
                    push(now + wait, _PICK, (item, now))
                    continue
            text = prompt_text(item)
            admission = None
            if router is None:
                node = min(engines, key=lambda n: (engines[n].first_token_eta(item.prompt_tokens, text, now), n))
                size = None
            else:
                seen = indexed_text([{"role": "user", "content": text}], None)
                size = request_size(seen, item.max_tokens, None)
                admission = routers[owner(item)].admitter.admit(AdmitRequest(DEFAULT_POOL, (), seen, size))
                assert isinstance(admission, Admission), "a pool with a routable node refused a request"
                node = admission.node
                if share:  # a pick is told within peer_pick_s, as the proxy's bus does (Router.on_pick)
                    channel.picked(owner(item), now)
            per_node[node] += 1
            submitted = engines[node].submit(item.prompt_tokens, item.max_tokens, now, prompt_text=text)
            request_id = f"r{item.index}"
            live[(node, submitted.req_id)] = (item, arrived, None, admission)
            by_engine[(node, submitted.req_id)] = request_id
            started: dict[str, Any] = {"request_id": request_id, "proxy": names[owner(item)], "pool": DEFAULT_POOL}
            if size is not None:
                started |= {"prompt_tokens": size.prompt_tokens, "max_tokens": size.max_tokens}
            offer(now, core.put(now, sj.req_started(node), started))
            if item.cancel_after_s is not None:
                push(arrived + item.cancel_after_s, _CANCEL, (node, submitted.req_id))
            wake(node, now)
            continue
        assert isinstance(item, str)
        node = item
        for event in engines[node].advance(now):
            key = (node, event.req_id)
            if key not in live:
                continue
            spec, arrived, first, admission = live[key]
            if event.index == 0:
                live[key] = (spec, arrived, event.time, admission)
                fresh[node][0].append(event.time - arrived)
                if routers and admission is not None:
                    routers[owner(spec)].admitter.prefilled(admission)
                    routers[owner(spec)].first_byte(event.time - arrived)
            if event.finished:
                finish(node, event.req_id, event.time, RequestOutcome.COMPLETED)
        wake(node, now)
    ordered = [results[i] for i in sorted(results)]
    phases = [Phase(p.name, p.start_s, p.end_s) for p in scenario.phases]
    bound, stretch = focus_alone(scenario, ordered, {r.index: r for r in requests}, alone or Alone(scenario))
    return TimelineResult(policy=policy, requests=len(ordered), phases=by_phase(ordered, phases), per_node=per_node,
                          slowed_node=_slowed(scenario, ordered, core.snapshots, base == "la-swrr"),
                          fault=_fault(scenario, ordered, core.snapshots),
                          weights=weights, focus_alone_p99=bound, focus_stretch_p99=stretch, detail=ordered)


def _slowed(scenario: Scenario, results: Sequence[RequestResult], snapshots: Sequence[tuple[float, Any]],
            weighted: bool) -> dict[str, Any] | None:
    """bench.report.slowed_node's figures from the virtual run."""
    loss = silent_loss(scenario)
    if loss is None:
        return None
    node, at_s, _ = loss
    focus = next(p for p in scenario.phases if p.name == scenario.focus_phase)
    in_focus = [r for r in results if focus.start_s <= r.start_s < focus.end_s]
    sent = sum(1 for r in in_focus if r.node == node)
    reaction = None
    if weighted:
        before = [v.target_weight for t, s in snapshots if t < at_s for v in s.nodes if v.node == node]
        if before:
            threshold = before[-1] / 2
            reaction = next((round(t - at_s, 3) for t, s in snapshots if t >= at_s
                             for v in s.nodes if v.node == node and v.target_weight <= threshold), None)
    return {"node": node, "requests_in_focus": sent,
            "share_in_focus": round(sent / len(in_focus), 4) if in_focus else None, "weight_reaction_s": reaction}


def _fault(scenario: Scenario, results: Sequence[RequestResult],
           snapshots: Sequence[tuple[float, Any]]) -> dict[str, Any] | None:
    """bench.report.fault_reaction's figures: the seconds from the focus phase's NPU fault to the
    first snapshot with its node out of routing, and the requests sent to it in the focus phase."""
    focus = next((p for p in scenario.phases if p.name == scenario.focus_phase), None)
    action = next((a for a in scenario.actions if focus is not None and a.at_s == focus.start_s and (
        (a.kind == "fault_code" and a.value) or (a.kind == "health" and a.value in (NpuHealth.ALARM, NpuHealth.CRITICAL)))),
        None)
    if focus is None or action is None:
        return None
    out_at = next((t for t, s in snapshots if t >= action.at_s
                   for v in s.nodes if v.node == action.node and not v.routable), None)
    return {"node": action.node, "out_after_s": None if out_at is None else round(out_at - action.at_s, 3),
            "requests_in_focus": sum(1 for r in results if r.node == action.node and focus.contains(r.start_s))}


def rows_for(policies: Sequence[str]) -> list[str]:
    rows = list(dict.fromkeys(policies))
    for policy in rows:
        split_policy(policy)
    return rows + ([] if ORACLE in rows else [ORACLE])


def status_goals(scenario: Scenario, results: Sequence[TimelineResult],
                 undisturbed: TimelineResult | None) -> dict[str, Any]:
    """The goals on a silent slot loss (bench.report.status_goals) in virtual time, with the
    in-process peers (rr, least-request, p2c) as the peers, and the figures that show what the E2E
    goal asks: the focus phase's E2E P99 of la-swrr with nothing slowed (the same arrivals), the
    floor of requests run alone; and the goal's intent on TTFT and stretch."""
    rows = {r.policy: r for r in results}
    la, without = rows.get("la-swrr"), rows.get("la-swrr" + NO_STATUS)
    if la is None or la.slowed_node is None:
        return {}
    focus = scenario.focus_phase

    def of(row: TimelineResult, key: str) -> float | None:
        value = row.phases.get(focus, {}).get(key)
        return None if value is None else float(value)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    out: dict[str, Any] = {"loss_believed_s": la.slowed_node["weight_reaction_s"]}
    if without is not None:
        out["e2e_p99_vs_no_status"] = ratio(of(la, "e2e_p99"), of(without, "e2e_p99"))
        out["ttft_p99_vs_no_status"] = ratio(of(la, "ttft_p99"), of(without, "ttft_p99"))
    peers = [r for r in results if r.policy in ("rr", "least-request", "p2c")]
    for key, name in (("e2e_p99", "e2e_p99"), ("ttft_p99", "ttft_p99")):
        scored = [(of(r, key), r.policy) for r in peers if of(r, key) is not None]
        if scored:
            best, policy = min(scored)  # type: ignore[type-var]
            out[f"{name}_vs_best_peer"] = {"value": ratio(of(la, key), best), "best": policy}
    scored = [(r.focus_stretch_p99, r.policy) for r in peers if r.focus_stretch_p99 is not None]
    if scored and la.focus_stretch_p99 is not None:
        best, policy = min(scored)  # type: ignore[type-var]
        out["stretch_p99_vs_best_peer"] = {"value": ratio(la.focus_stretch_p99, best), "best": policy}
    if undisturbed is not None:
        out["undisturbed_e2e_p99"] = of(undisturbed, "e2e_p99")
        out["undisturbed_ttft_p99"] = of(undisturbed, "ttft_p99")
    return out


def print_timeline(scenario: Scenario, results: Sequence[TimelineResult], goals: dict[str, Any]) -> None:
    focus = scenario.focus_phase
    print(f"{scenario.name} in virtual time with the scheduler ({results[0].requests if results else 0} requests; "
          f"focus phase {focus!r})")
    print(f"{'policy':<20}{'TTFT P50':>9}{'P99':>8}{'E2E P50':>9}{'P99':>8}{'alone':>7}{'stretch':>8}   "
          f"{'to slowed (share; halved after)':<34}per node")
    for r in results:
        f = r.phases.get(focus, {})
        slowed = r.slowed_node
        cell = "-" if slowed is None else (
            f"{slowed['requests_in_focus']} ({100 * (slowed['share_in_focus'] or 0):.1f} %"
            + ("" if slowed["weight_reaction_s"] is None else f"; {slowed['weight_reaction_s']:.2f} s") + ")")
        print(f"{r.policy:<20}{_num(f.get('ttft_p50')):>9}{_num(f.get('ttft_p99')):>8}{_num(f.get('e2e_p50')):>9}"
              f"{_num(f.get('e2e_p99')):>8}{_num(r.focus_alone_p99):>7}{_num(r.focus_stretch_p99, 2):>8}   {cell:<34}"
              + " ".join(f"{n}={c}" for n, c in r.per_node.items()))
    for r in results:
        if r.fault is not None:
            out = "never" if r.fault["out_after_s"] is None else f"{r.fault['out_after_s']:.2f} s"
            print(f"{r.policy}: {r.fault['node']} out of routing {out} after its NPU fault, "
                  f"{r.fault['requests_in_focus']} requests to it in the {focus} phase")
    print(f"alone: the {focus} phase's E2E P99 had each request run alone on a healthy engine (no router is faster); "
          "stretch: P99 of E2E / alone")
    if goals:
        print("goals: " + json.dumps(goals))


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# the first second after the event (docs/evidence/replicas.md, "Timeline scenarios in virtual time")
OVERSHOOT_WINDOW_S = 1.0


def overshoot(scenario: Scenario, results: Sequence[RequestResult],
              window_s: float = OVERSHOOT_WINDOW_S) -> list[dict[str, Any]]:
    """Per capacity cut of the timeline: the requests sent to the node in the ``window_s`` after it
    beyond its new share (its capacity over the pool's, what the weights move to), counted over
    every proxy: ``sent`` there of ``total`` sent anywhere, ``expected`` = share x total, and
    ``overshoot`` = max(0, sent - expected)."""
    capacity = {e.node: e.capacity for e in scenario.engines}
    cuts = []
    for action in sorted(scenario.actions, key=lambda a: a.at_s):
        if action.kind != "capacity":
            continue
        before, capacity[action.node] = capacity[action.node], int(action.value)
        if capacity[action.node] >= before:
            continue
        share = capacity[action.node] / sum(capacity.values())
        window = [r for r in results if action.at_s <= r.start_s < action.at_s + window_s]
        sent = sum(1 for r in window if r.node == action.node)
        expected = share * len(window)
        cuts.append({"at_s": action.at_s, "node": action.node, "capacity": capacity[action.node],
                     "announced": action.announce, "share": round(share, 4), "total": len(window), "sent": sent,
                     "expected": round(expected, 2), "overshoot": round(max(0.0, sent - expected), 2)})
    return cuts


def bench_timeline(scenario: Scenario, policies: Sequence[str], affinity: str | None, seed: int, out: Path,
                   proxies: int = 1, peer_interval_ms: int = 0, peer_delay_ms: float = PEER_DELAY_MS,
                   peer_pick_ms: float = PEER_PICK_S * 1000) -> None:
    check_timeline(scenario)
    requests = timeline_requests(scenario, seed)
    alone = Alone(scenario)
    results = [run_timeline(scenario, policy, seed, requests, affinity or "prefix", alone, proxies, peer_interval_ms,
                            peer_delay_ms, peer_pick_ms=peer_pick_ms)
               for policy in rows_for(policies)]
    undisturbed = None
    if silent_loss(scenario) is not None:  # the same arrivals with nothing slowed: what the E2E tail is anyway
        undisturbed = run_timeline(replace(scenario, actions=()), "la-swrr", seed, requests, affinity or "prefix", alone,
                                   proxies, peer_interval_ms, peer_delay_ms, peer_pick_ms=peer_pick_ms)
    goals = status_goals(scenario, results, undisturbed)
    print_timeline(scenario, results, goals)
    cuts = {r.policy: overshoot(scenario, r.detail) for r in results}
    if any(cuts.values()):
        print(f"overshoot ({proxies} prox{'y' if proxies == 1 else 'ies'}; requests sent to the node beyond its new "
              f"share in the {OVERSHOOT_WINDOW_S:g} s after a capacity cut): " + "; ".join(
                  f"{policy} " + ", ".join(f"{c['node']}@{c['at_s']:g}s {c['sent']} of {c['total']} "
                                           f"(share {c['expected']:.2f}, over {c['overshoot']:.2f})" for c in found)
                  for policy, found in cuts.items()))
    target = out / scenario.name
    target.mkdir(parents=True, exist_ok=True)
    document = {"scenario": scenario.name, "seed": seed, "focus_phase": scenario.focus_phase, "goals": goals,
                "policies": [{k: v for k, v in asdict(r).items() if k != "detail"} for r in results]}
    if proxies != 1:
        document |= {"proxies": proxies, "peer_interval_ms": peer_interval_ms, "peer_delay_ms": peer_delay_ms,
                     "peer_pick_ms": peer_pick_ms}
    if any(cuts.values()):
        document["overshoot"] = cuts
    (target / "virtual.json").write_text(json.dumps(document, indent=1) + "\n")
