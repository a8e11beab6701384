"""Benchmark metrics (pure): latency percentiles per phase and load balance over time.

Definitions:

* **Percentiles** use linear interpolation between closest ranks (numpy's default "linear"):
  for sorted x[0..n-1], the q-th percentile sits at rank (n-1)·q/100.
* **Phase** of a request = the phase its *start* falls into (phases are half-open [start, end)).
  TTFT counts every request that received a first token; E2E counts completed requests only.
* **Load balance** is measured on *utilisation*: at each sample time t (every ``step_s``),
  u_i(t) = in-flight_i(t) / capacity_i(t), where in-flight is what the clients had open on node i
  (from send until the stream ended; queued requests count) and capacity is the node's *true*
  engine capacity at t (from the scenario timeline, not what the scheduler believes). Nodes with
  capacity 0 (crashed, drained to 0) are left out of that sample; samples where no request is in
  flight are skipped. Over the remaining nodes:
    CoV(t)      = population std(u) / mean(u)
    max/mean(t) = max(u) / mean(u)
    Jain(t)     = (Σu)² / (n · Σu²)        (1 = perfectly even, 1/n = all on one node)
  and the reported figures are their time averages over the samples of a phase or the whole run.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from laswrr.schemas.words import RequestOutcome


class ClientOutcome(StrEnum):
    """How one request ended as the load generator's client saw it (bench/load.py's header).

    Not the proxy's ``RequestOutcome``: a client sees no retries and no upstream, only whether
    its stream reached ``[DONE]``; the two words both sides use are spelled by the schema."""

    COMPLETED = RequestOutcome.COMPLETED.value
    CLIENT_CANCELLED = RequestOutcome.CLIENT_CANCELLED.value
    ERROR = "error"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw of one request (times in seconds from the start of the run)."""

    index: int
    start_s: float
    end_s: float
    ttft_s: float | None  # first content chunk, from start
    e2e_s: float | None  # [DONE], from start; None unless completed
    node: str | None  # x-laswrr-node
    outcome: ClientOutcome
    status: int | None = None  # HTTP status, None when the connection failed
    tokens: int = 0
    error: str = ""
    tenant: str = ""  # the API key's name it was sent with (multi-tenant scenarios)
    priority: str = ""  # its x-laswrr-priority
    max_tokens: int = 0  # what it asked for (the simulated engine emits exactly that many): its offered work
    request_id: str = ""  # x-laswrr-request-id (the proxy's id: its events' request_id)
    cached_tokens: int | None = None  # the engine's usage: prompt tokens it found cached (None: no usage asked)
    prompt_tokens: int | None = None  # the engine's usage: the prompt's tokens


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start_s: float
    end_s: float

    def contains(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """q in [0, 100]; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cov(values: Sequence[float]) -> float | None:
    """Coefficient of variation (population std / mean); None if empty or the mean is 0."""
    m = mean(values)
    if m is None or m == 0:
        return None
    variance = sum((v - m) ** 2 for v in values) / len(values)
    return math.sqrt(variance) / m


def max_over_mean(values: Sequence[float]) -> float | None:
    m = mean(values)
    if m is None or m == 0:
        return None
    return max(values) / m


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²); None if empty or all zero."""
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)


# --------------------------------------------------------------------------- latency


def phase_of(t: float, phases: Sequence[Phase]) -> str | None:
    for phase in phases:
        if phase.contains(t):
            return phase.name
    return None


def latency_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Counts by outcome and P50/P90/P99 of TTFT and E2E (seconds) for one group of requests."""
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    e2e = [r.e2e_s for r in results if r.outcome == ClientOutcome.COMPLETED and r.e2e_s is not None]
    summary: dict[str, Any] = {"requests": len(results)}
    for outcome in ClientOutcome:
        summary[outcome.value] = sum(1 for r in results if r.outcome == outcome)
    for name, values in (("ttft", ttft), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = _round(percentile(values, q))
        summary[f"{name}_max"] = _round(max(values) if values else None)
    return summary


def by_phase(results: Sequence[RequestResult], phases: Sequence[Phase]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestResult]] = {p.name: [] for p in phases}
    for result in results:
        name = phase_of(result.start_s, phases)
        if name is not None:
            groups[name].append(result)
    return {name: latency_summary(group) for name, group in groups.items()}


# --------------------------------------------------------------------------- load balance


CapacityAt = Callable[[str, float], float]


def inflight_series(results: Iterable[RequestResult], nodes: Sequence[str], times: Sequence[float]
                    ) -> dict[str, list[int]]:
    """In-flight count per node at each time in ``times`` (sorted), from request intervals."""
    starts: dict[str, list[float]] = {n: [] for n in nodes}
    ends: dict[str, list[float]] = {n: [] for n in nodes}
    for r in results:
        if r.node in starts:
            starts[r.node].append(r.start_s)
            ends[r.node].append(r.end_s)
    series: dict[str, list[int]] = {}
    for node in nodes:
        s, e = sorted(starts[node]), sorted(ends[node])
        series[node] = [bisect_right(s, t) - bisect_right(e, t) for t in times]
    return series


def sample_times(start_s: float, end_s: float, step_s: float) -> list[float]:
    count = max(0, math.floor((end_s - start_s) / step_s))
    return [round(start_s + i * step_s, 6) for i in range(count)]


def utilisation_samples(results: Sequence[RequestResult], nodes: Sequence[str], capacity_at: CapacityAt,
                        times: Sequence[float]) -> list[tuple[float, list[float]]]:
    """(t, [u_i for nodes with capacity > 0]) for every t with something in flight."""
    series = inflight_series(results, nodes, times)
    samples: list[tuple[float, list[float]]] = []
    for k, t in enumerate(times):
        utils = [series[n][k] / capacity_at(n, t) for n in nodes if capacity_at(n, t) > 0]
        if utils and sum(utils) > 0:
            samples.append((t, utils))
    return samples


def balance_summary(samples: Sequence[tuple[float, list[float]]]) -> dict[str, Any]:
    """Time averages of CoV, max/mean and Jain's index, plus the mean utilisation."""
    covs = [c for _, u in samples if (c := cov(u)) is not None]
    ratios = [r for _, u in samples if (r := max_over_mean(u)) is not None]
    jains = [j for _, u in samples if (j := jain(u)) is not None]
    utils = [m for _, u in samples if (m := mean(u)) is not None]
    return {"samples": len(samples), "cov": _round(mean(covs)), "max_mean": _round(mean(ratios)),
            "jain": _round(mean(jains)), "mean_util": _round(mean(utils))}


def balance(results: Sequence[RequestResult], nodes: Sequence[str], capacity_at: CapacityAt,
            phases: Sequence[Phase], step_s: float = 0.1) -> dict[str, Any]:
    """Balance over the whole run and per phase."""
    if not phases:
        return {"overall": balance_summary([])}
    times = sample_times(phases[0].start_s, phases[-1].end_s, step_s)
    samples = utilisation_samples(results, nodes, capacity_at, times)
    out: dict[str, Any] = {"overall": balance_summary(samples)}
    for phase in phases:
        out[phase.name] = balance_summary([s for s in samples if phase.contains(s[0])])
    return out


def node_shares(results: Sequence[RequestResult]) -> dict[str, int]:
    """Requests per node (as routed), sorted by node."""
    counts: dict[str, int] = {}
    for r in results:
        if r.node is not None:
            counts[r.node] = counts.get(r.node, 0) + 1
    return dict(sorted(counts.items()))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return _round(a / b)


def capacity_timeline(initial: Mapping[str, float], changes: Sequence[tuple[float, str, float]]) -> CapacityAt:
    """A ``capacity_at(node, t)`` from initial capacities and (t, node, new capacity) changes."""
    ordered = sorted(changes)

    def capacity_at(node: str, t: float) -> float:
        value = initial.get(node, 0.0)
        for when, who, cap in ordered:
            if when > t:
                break
            if who == node:
                value = cap
        return value

    return capacity_at


# --------------------------------------------------------------------------- tenants (overload)


def max_min_fair(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of ``capacity`` among ``demands`` (water filling): nobody gets more than
    it asks, and what the small demands leave is split equally among the others."""
    shares = {name: 0.0 for name in demands}
    left, open_ = capacity, sorted(demands, key=lambda n: demands[n])
    while open_ and left > 1e-12:
        equal = left / len(open_)
        smallest = open_[0]
        if demands[smallest] <= equal:
            shares[smallest] = demands[smallest]
            left -= demands[smallest]
            open_.pop(0)
        else:
            for name in open_:
                shares[name] = equal
            left, open_ = 0.0, []
    return shares


def tenant_summary(results: Sequence[RequestResult], window_s: float) -> dict[str, Any]:
    """Per API key: offered and completed output tokens per second inside ``[0, window_s]``
    (goodput: requests completed by then), its max-min fair share of the total goodput given the
    offered loads, and Jain's index of goodput / fair share; TTFT per priority; answers by status."""
    tenants = sorted({r.tenant for r in results})
    offered = {t: sum(r.max_tokens for r in results if r.tenant == t) / window_s for t in tenants}
    done = [r for r in results if r.outcome == ClientOutcome.COMPLETED and r.end_s <= window_s]
    goodput = {t: sum(r.tokens for r in done if r.tenant == t) / window_s for t in tenants}
    total = sum(goodput.values())
    fair = max_min_fair(offered, total)
    ratios = [goodput[t] / fair[t] for t in tenants if fair[t] > 0]
    per_priority = {}
    for priority in sorted({r.priority for r in results}):
        mine = [r for r in results if r.priority == priority]
        ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]
        per_priority[priority or "none"] = {
            "requests": len(mine), "ttft_p50": _round(percentile(ttfts, 50)), "ttft_p99": _round(percentile(ttfts, 99)),
            "answered_429": sum(1 for r in mine if r.status == 429)}
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "window_s": window_s,
        "total_goodput_tps": round(total, 1),
        "jain_of_fair_share": _round(jain(ratios)),
        "per_key": {t: {"offered_tps": round(offered[t], 1), "goodput_tps": round(goodput[t], 1),
                        "fair_tps": round(fair[t], 1),
                        "ratio": round(goodput[t] / fair[t], 3) if fair[t] > 0 else None} for t in tenants},
        "per_priority": per_priority,
        "statuses": dict(sorted(statuses.items())),
        "answered_5xx": sum(1 for r in results if r.status is not None and r.status >= 500),
    }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
