"""`slo-mixed`: latency objectives on a heterogeneous pool, in virtual time (figures: docs/evidence/slo.md).

The pool: two 910C-like and two 910B-like simulated engines (``services.sim_engine.physics``) with
equal slots (10) and equal decode speed, the 910C-like prefilling twice as fast. The workload
(seeded, deterministic): 75 % short chat turns (prompt lognormal, median 300 tokens, sigma 0.6;
output uniform 60..240 tokens) of the *interactive* class (TTFT 1 s, TPOT 50 ms) and 25 % long
prompts (uniform 6 000..20 000 tokens; output uniform 50..150) of the *batch* class (TTFT 10 s, no
TPOT target), Poisson arrivals at 0.6x, 0.8x, 1.0x and 1.2x the pool's saturation throughput
(``capacity_rps``: every engine at its full batch with the mix's mean prompt and output).

Rows: ``la-swrr+slo`` (the proxy's router with the latency estimate and the requests' objectives;
a request no node is predicted to meet is served on the normal pick: ``--slo-serve-late``),
``la-swrr+slo-refuse`` (the same, answering those 429 ``slo_unmeetable`` at once: refused requests
count as missed), ``la-swrr`` (today: no objectives), ``p2c`` (vllm-router's power_of_two), ``rr``,
``least-request``, ``sglang-cache-aware`` (a model of sglang-router's ``cache_aware``, the rule of the
0.3 releases, from the request's text and its own counts of requests in flight:
``bench/sglang_cache_aware.py``), ``sglang-cache-aware-tree`` (the same before 0.2.4: a cache miss
goes to the smallest tree), and ``oracle`` (each request where its first token comes soonest, reading
the engines' exact state).

Metric: SLO goodput per class, requests per second of the run that met every target of their
class (TTFT, and TPOT = decode time per token after the first), plus TTFT/TPOT P50/P99 per class;
for the ``+slo`` rows the estimate's accuracy: median and P90 absolute error of the TTFT predicted
at the pick (for the node picked) against the TTFT measured, and those requests' measured median
(and the same error of the TPOT predicted, for the requests of more than one output token).

Run: ``laswrr bench --scenario slo-mixed --virtual [--seed S]`` (every row and load, 1 500 requests
each, ``<out>/slo-mixed/virtual.json``), or ``python -m laswrr.bench.slo_mixed [--requests N]
[--seed S] [--loads ...] [--rows ...] [--interactive-tpot-ms MS] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from laswrr.bench.sglang_cache_aware import MISS_LOAD, MISS_TREE, CacheAware, Config
from laswrr.scheduler.routing.latency import LatencyModel, Objective
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Refusal, Router, scorer_for
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas.words import Band, Phase
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile

NAME = "slo-mixed"
DESCRIPTION = "latency objectives: 2x910C-like + 2x910B-like, chat turns and long prompts, two classes, 0.6-1.2x load"
SLOTS = 10
NODES = (("c1", 2.0), ("c2", 2.0), ("b1", 1.0), ("b2", 1.0))  # node, prefill speed relative to a 910B
CLASSES: dict[str, Objective] = {Band.INTERACTIVE: Objective(1000.0, 50.0), Band.BATCH: Objective(10000.0, None)}
LOADS = (0.6, 0.8, 1.0, 1.2)
ROWS = ("la-swrr+slo", "la-swrr+slo-refuse", "la-swrr", "p2c", "rr", "least-request", "sglang-cache-aware",
        "sglang-cache-aware-tree", "oracle")
SGLANG_ROWS = {"sglang-cache-aware": MISS_LOAD, "sglang-cache-aware-tree": MISS_TREE}  # row -> its rule on a miss
_LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


@dataclass(frozen=True, slots=True)
class Req:
    index: int
    at: float
    prompt: int
    output: int
    klass: str


def engines() -> dict[str, EngineSim]:
    base = get_profile("910B")
    return {node: EngineSim(replace(base, chip=f"910x{speed:g}", prefill_speed=speed), SLOTS) for node, speed in NODES}


def _mix(rng: random.Random) -> tuple[int, int, str]:
    if rng.random() < 0.75:
        return max(16, round(rng.lognormvariate(math.log(300), 0.6))), rng.randint(60, 240), Band.INTERACTIVE
    return rng.randint(6000, 20000), rng.randint(50, 150), Band.BATCH


def capacity_rps(seed: int = 0, samples: int = 20000) -> float:
    """The pool's saturation throughput for the mix: per engine, SLOTS requests decode in a full
    batch's step while each request's prefill stalls the engine (bench/scenarios.py, "Load level")."""
    rng = random.Random(seed)
    draws = [_mix(rng) for _ in range(samples)]
    mean_prompt = statistics.fmean(p for p, _, _ in draws)
    mean_output = statistics.fmean(o for _, o, _ in draws)
    total = 0.0
    for engine in engines().values():
        per_request = mean_output * engine.decode_step_s(SLOTS) / SLOTS + engine.prefill_s(round(mean_prompt))
        total += 1.0 / per_request
    return total


def workload(load: float, requests: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    rate = load * capacity_rps()
    now, out = 0.0, []
    for i in range(requests):
        now += rng.expovariate(rate)
        prompt, output, klass = _mix(rng)
        out.append(Req(i, now, prompt, output, klass))
    return out


def _snapshot() -> WeightSnapshot:
    nodes = [NodeView(node=n, url=f"http://{n}", phase=Phase.ACTIVE, routable=True, capacity=SLOTS, target_weight=SLOTS,
                      effective_weight=SLOTS, inflight=0, chip="910B", health=1.0, load=_LOAD) for n, _ in NODES]
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=1, ts_ns=0, panic=False, nodes=nodes)


def _text(req: Req) -> bytes:
    return (f"r{req.index}-".encode() * (req.prompt * 4 // 4 + 1))[:req.prompt * 4]


@dataclass(slots=True)
class Outcome:
    klass: str
    ttft: float | None = None  # None: refused
    tpot: float | None = None
    predicted: float | None = None
    predicted_tpot: float | None = None

    def good(self) -> bool:
        target = CLASSES[self.klass]
        if self.ttft is None:
            return False
        if target.ttft_ms is not None and self.ttft * 1000 > target.ttft_ms:
            return False
        return not (target.tpot_ms is not None and self.tpot is not None and self.tpot * 1000 > target.tpot_ms)


@dataclass(slots=True)
class Row:
    row: str
    load: float
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    decisions: dict[str, int] | None = None  # an sglang row's picks per branch (imbalanced, hit, miss)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"row": self.row, "load": self.load}
        for klass in CLASSES:
            mine = [o for o in self.outcomes if o.klass == klass]
            served = [o for o in mine if o.ttft is not None]
            ttft = sorted(o.ttft for o in served if o.ttft is not None)
            tpot = sorted(o.tpot for o in served if o.tpot is not None)
            out[klass] = {"goodput_rps": round(sum(o.good() for o in mine) / self.duration_s, 4),
                          "good_share": round(sum(o.good() for o in mine) / max(1, len(mine)), 4),
                          "refused": len(mine) - len(served),
                          "ttft_p50": _q(ttft, 0.5), "ttft_p99": _q(ttft, 0.99),
                          "tpot_p50": _q(tpot, 0.5), "tpot_p99": _q(tpot, 0.99)}
        judged = [o for o in self.outcomes if o.predicted is not None and o.ttft is not None]
        errors = sorted(abs(o.predicted - o.ttft) for o in judged if o.predicted is not None and o.ttft is not None)
        if errors:
            measured = sorted(o.ttft for o in judged if o.ttft is not None)
            tpot = sorted(abs(o.predicted_tpot - o.tpot) for o in judged
                          if o.predicted_tpot is not None and o.tpot is not None and o.tpot > 0)
            out["estimate_abs_error_s"] = {"p50": _q(errors, 0.5), "p90": _q(errors, 0.9), "n": len(errors),
                                           "measured_p50": _q(measured, 0.5), "tpot_p50": _q(tpot, 0.5),
                                           "tpot_p90": _q(tpot, 0.9)}
        if self.decisions is not None:
            out["decisions"] = self.decisions
        return out


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def run(row: str, load: float, requests: list[Req], seed: int) -> Row:
    sims = engines()
    objectives = row.startswith("la-swrr+slo")
    policy = "la-swrr" if row.startswith("la-swrr") else row
    router: Router | None = None
    model: LatencyModel | None = None
    sglang = CacheAware([n for n, _ in NODES], Config(miss=SGLANG_ROWS[row])) if row in SGLANG_ROWS else None
    if row != "oracle" and sglang is None:
        model = LatencyModel() if objectives else None
        router = Router(policy, seed, scorer=scorer_for("prefix"), latency=model, serve_late=row == "la-swrr+slo")
        router.table.offer(_snapshot(), 0.0)
    result = Row(row, load, requests[-1].at)
    queue: list[tuple[float, int, int, Any]] = [(r.at, 1, r.index, r) for r in requests]
    heapq.heapify(queue)
    order = len(requests)
    live: dict[tuple[str, int], tuple[Req, Admission | None, Outcome, float]] = {}
    first: dict[tuple[str, int], float] = {}

    def wake(node: str, now: float) -> None:
        nonlocal order
        at = sims[node].next_event_time()
        if at is not None:
            heapq.heappush(queue, (max(at, now), 0, order, node))
            order += 1

    while queue:
        now, kind, _, item = heapq.heappop(queue)
        if kind == 1:
            req: Req = item
            outcome = Outcome(req.klass)
            result.outcomes.append(outcome)
            admission = None
            if sglang is not None:
                node = sglang.pick(_text(req).decode(), now)  # the text la-swrr's prefix affinity reads
            elif router is None:
                node = min(sims, key=lambda n: (sims[n].first_token_eta(req.prompt, "", now), n))
            else:
                objective = CLASSES[req.klass] if objectives else None
                picked = router.admitter.admit(AdmitRequest(DEFAULT_POOL, (), _text(req), RequestSize(req.prompt, req.output),
                                                            objective=objective))
                if isinstance(picked, Refusal):
                    continue
                admission = picked
                node = admission.node
                if model is not None and admission.estimate is not None:
                    prediction = admission.estimate.predict(model)
                    outcome.predicted, outcome.predicted_tpot = prediction.ttft_s, prediction.tpot_s
            submitted = sims[node].submit(req.prompt, req.output, now)
            live[(node, submitted.req_id)] = (req, admission, outcome, now)
            wake(node, now)
            continue
        node = item
        for event in sims[node].advance(now):
            key = (node, event.req_id)
            req, admission, outcome, began = live[key]
            if event.index == 0:
                first[key] = event.time
                outcome.ttft = event.time - began
                if router is not None and admission is not None:
                    router.admitter.prefilled(admission)
            if event.finished:
                started = first.pop(key)
                outcome.tpot = (event.time - started) / (req.output - 1) if req.output > 1 else 0.0
                del live[key]
                if sglang is not None:
                    sglang.done(node)
                if router is not None and admission is not None:
                    router.admitter.release(admission)
                    router.admitter.observed(admission, (started - began) * 1000, 0.0, (event.time - began) * 1000,
                                             req.output)
        wake(node, now)
    if sglang is not None:
        result.decisions = dict(sglang.decisions)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.slo_mixed", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--loads", default=",".join(map(str, LOADS)))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--interactive-tpot-ms", type=float, default=CLASSES[Band.INTERACTIVE].tpot_ms,
                        help="the interactive class's TPOT target (default %(default)s)")
    args = parser.parse_args(argv)
    CLASSES[Band.INTERACTIVE] = Objective(CLASSES[Band.INTERACTIVE].ttft_ms, args.interactive_tpot_ms)
    summaries = []
    print(f"pool capacity {capacity_rps():.3f} requests/s; {args.requests} requests per run, seed {args.seed}; "
          f"classes {CLASSES}")
    print(f"{'load':>4} {'row':<24} {'int good/s':>10} {'int share':>9} {'int TTFT p50/p99':>18} "
          f"{'int TPOT p50/p99':>18} {'bat good/s':>10} {'bat TTFT p50/p99':>18} {'refused':>7} "
          f"{'est err p50/p90':>16} {'measured p50':>12} {'TPOT err p50/p90':>16}")
    for load in (float(x) for x in args.loads.split(",")):
        requests = workload(load, args.requests, args.seed)
        for row in args.rows.split(","):
            s = run(row, load, requests, args.seed).summary()
            summaries.append(s)
            i, b = s[Band.INTERACTIVE], s[Band.BATCH]
            err = s.get("estimate_abs_error_s")
            print(f"{load:>4} {row:<24} {i['goodput_rps']:>10} {i['good_share']:>9} "
                  f"{i['ttft_p50']!s:>8}/{i['ttft_p99']!s:<9} {i['tpot_p50']!s:>8}/{i['tpot_p99']!s:<9} "
                  f"{b['goodput_rps']:>10} {b['ttft_p50']!s:>8}/{b['ttft_p99']!s:<9} {i['refused'] + b['refused']:>7} "
                  f"{'' if err is None else str(err['p50']) + '/' + str(err['p90']):>16} "
                  f"{'' if err is None else str(err['measured_p50']):>12} "
                  f"{'' if err is None else str(err['tpot_p50']) + '/' + str(err['tpot_p90']):>16}"
                  f"{'' if 'decisions' not in s else ' ' + str(s['decisions'])}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
