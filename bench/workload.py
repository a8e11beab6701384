"""LLM-shaped open-loop workloads, generated up front from a seed (pure: no IO, no clock).

A workload is a list of ``RequestSpec`` (arrival offset, prompt length, max_tokens, optional
client-cancel delay) drawn from ``random.Random(seed)`` only, so every policy of a benchmark run
gets byte-for-byte the same requests at the same offsets.

Arrivals:
  * ``poisson``: exponential inter-arrival gaps at ``rate_rps``;
  * ``bursty``: an on/off modulated Poisson process (a two-state MMPP with fixed periods): during
    ``burst_on_s`` the rate is ``rate_rps · burst_factor``, during ``burst_off_s`` it is chosen so
    the long-run mean stays ``rate_rps`` (floored at 0). Gaps are drawn by thinning against the peak
    rate, which is exact for a piecewise-constant rate.

Lengths are lognormal (LLM prompt and output lengths are heavy-tailed: BurstGPT, Azure traces):
``median · exp(sigma · N(0,1))``, rounded and clamped to ``[1, max]``. The simulated engine emits
exactly ``max_tokens`` tokens, so ``max_tokens`` is the output length.

**Stratified lengths** (optional ``strata``: time windows such as a scenario's phases). A tail
percentile over a few dozen requests is mostly the luck of the longest outputs drawn, so phases
would differ by their draws, not by what the system did. Within each window holding N requests,
lengths are the lognormal's quantiles at (i + 0.5) / N, i = 0..N-1, in a seeded random order
(Latin-hypercube sampling): every phase gets the same length distribution, tail included, and
phase-to-phase P99 differences come from the system under test.

A share ``cancel_share`` of requests is cancelled by the client ``cancel_after_s`` after it was
sent, drawn uniformly in ``[cancel_min_s, cancel_max_s]``.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Any, Literal

from laswrr.schemas.words import Band

Arrival = Literal["poisson", "bursty"]
ARRIVALS: tuple[str, ...] = ("poisson", "bursty")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate; every field has an LLM-chat-like default."""

    duration_s: float = 30.0
    rate_rps: float = 5.0
    arrival: Arrival = "poisson"
    burst_on_s: float = 2.0
    burst_off_s: float = 6.0
    burst_factor: float = 3.0  # rate during a burst, as a multiple of rate_rps
    prompt_median: float = 400.0
    prompt_sigma: float = 0.8
    prompt_max: int = 4096
    output_median: float = 96.0
    output_sigma: float = 0.6
    output_max: int = 512
    cancel_share: float = 0.03
    cancel_min_s: float = 0.2
    cancel_max_s: float = 2.0

    def validate(self) -> None:
        if self.duration_s <= 0 or self.rate_rps <= 0:
            raise ValueError("duration_s and rate_rps must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.burst_on_s <= 0 or self.burst_off_s < 0 or self.burst_factor < 1:
            raise ValueError("burst_on_s must be > 0, burst_off_s >= 0, burst_factor >= 1")
        if not 0 <= self.cancel_share <= 1 or not 0 <= self.cancel_min_s <= self.cancel_max_s:
            raise ValueError("cancel_share must be in 0..1 and 0 <= cancel_min_s <= cancel_max_s")
        if min(self.prompt_median, self.output_median) < 1 or min(self.prompt_max, self.output_max) < 1:
            raise ValueError("length medians and maxima must be >= 1")

    def scaled(self, factor: float) -> "WorkloadSpec":
        """The same workload shape over ``factor`` times the duration."""
        return replace(self, duration_s=self.duration_s * factor)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    offset_s: float  # when to send, from the start of the run
    prompt_tokens: int
    max_tokens: int
    cancel_after_s: float | None  # None: the client waits for the end
    block_ids: tuple[int, ...] = ()  # a trace's prefix-block ids (bench.trace): shared ids, shared text
    tenant: str = ""  # the API key's name it is sent with ("" : none; bench.scenarios.Tenant)
    priority: str = ""  # its x-laswrr-priority ("": none)
    # a chat of several messages (role, text), sent as they are instead of ``prompt_text``
    # (bench.conversations: shared system prompts, multi-turn conversations)
    messages: tuple[tuple[str, str], ...] = ()
    entry: int | None = None  # which proxy it enters through (an index into the URLs); None: they alternate


@dataclass(frozen=True, slots=True)
class Tenant:
    """One client of a multi-tenant workload: its API key's name, its share of the arrivals, and
    the ``x-laswrr-priority`` it sends (``mix``: ``interactive`` or ``default``, half each)."""

    name: str
    share: float
    priority: str


TENANT_SEED = 0x7E4A47  # mixed into the seed: tenants are drawn from their own stream


def assign_tenants(requests: Sequence[RequestSpec], tenants: Sequence[Tenant], seed: int) -> list[RequestSpec]:
    """Each request given a tenant in proportion to the shares, and that tenant's priority, drawn
    from ``seed`` only (the arrivals and lengths are unchanged)."""
    rng = random.Random(seed ^ TENANT_SEED)
    weights = [t.share for t in tenants]
    out = []
    for spec in requests:
        tenant = rng.choices(tenants, weights)[0]
        mix = rng.random()
        priority = tenant.priority if tenant.priority != "mix" else (Band.INTERACTIVE if mix < 0.5 else Band.DEFAULT)
        out.append(replace(spec, tenant=tenant.name, priority=priority))
    return out


def burst_rates(spec: WorkloadSpec) -> tuple[float, float]:
    """(rate during a burst, rate between bursts) with the long-run mean equal to rate_rps."""
    if spec.arrival == "poisson":
        return spec.rate_rps, spec.rate_rps
    period = spec.burst_on_s + spec.burst_off_s
    on = spec.rate_rps * spec.burst_factor
    if spec.burst_off_s == 0:
        return on, on
    off = max(0.0, (spec.rate_rps * period - on * spec.burst_on_s) / spec.burst_off_s)
    return on, off


def rate_at(spec: WorkloadSpec, t: float) -> float:
    """The arrival rate at offset ``t`` (bursts start at t = 0)."""
    on, off = burst_rates(spec)
    if spec.arrival == "poisson":
        return on
    return on if t % (spec.burst_on_s + spec.burst_off_s) < spec.burst_on_s else off


def arrival_offsets(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration) by thinning a Poisson process at the peak rate."""
    peak = max(burst_rates(spec))
    offsets: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= spec.duration_s:
            return offsets
        accept = rng.random()  # always drawn, so the stream of draws does not depend on the rate
        if accept * peak < rate_at(spec, t):
            offsets.append(t)


def lognormal_int(rng: random.Random, median: float, sigma: float, upper: int) -> int:
    return max(1, min(upper, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def lognormal_quantiles(count: int, median: float, sigma: float, upper: int, rng: random.Random) -> list[int]:
    """The lognormal's quantiles at (i + 0.5) / count, rounded and clamped, in a random order."""
    unit = NormalDist()
    values = [max(1, min(upper, round(median * math.exp(sigma * unit.inv_cdf((i + 0.5) / count)))))
              for i in range(count)]
    rng.shuffle(values)
    return values


def _stratified_lengths(offsets: Sequence[float], spec: WorkloadSpec, strata: Sequence[tuple[float, float]],
                        rng: random.Random) -> dict[int, tuple[int, int]]:
    """(prompt, output) for every request inside a stratum, by request index."""
    lengths: dict[int, tuple[int, int]] = {}
    for start, end in strata:
        members = [i for i, t in enumerate(offsets) if start <= t < end and i not in lengths]
        if not members:
            continue
        prompts = lognormal_quantiles(len(members), spec.prompt_median, spec.prompt_sigma, spec.prompt_max, rng)
        outputs = lognormal_quantiles(len(members), spec.output_median, spec.output_sigma, spec.output_max, rng)
        lengths.update(zip(members, zip(prompts, outputs)))
    return lengths


def generate(spec: WorkloadSpec, seed: int, strata: Sequence[tuple[float, float]] = ()) -> list[RequestSpec]:
    """The whole workload for ``spec`` and ``seed`` (same inputs, same list); see ``strata`` above."""
    spec.validate()
    rng = random.Random(seed)
    offsets = arrival_offsets(spec, rng)
    stratified = _stratified_lengths(offsets, spec, strata, rng)
    requests: list[RequestSpec] = []
    for index, offset in enumerate(offsets):
        prompt = lognormal_int(rng, spec.prompt_median, spec.prompt_sigma, spec.prompt_max)
        output = lognormal_int(rng, spec.output_median, spec.output_sigma, spec.output_max)
        prompt, output = stratified.get(index, (prompt, output))
        cancel_roll, cancel_delay = rng.random(), rng.uniform(spec.cancel_min_s, spec.cancel_max_s)
        cancel = round(cancel_delay, 4) if cancel_roll < spec.cancel_share else None
        requests.append(RequestSpec(index, round(offset, 6), prompt, output, cancel))
    return requests


def prompt_text(spec: RequestSpec) -> str:
    """A chat message whose simulated token count (chars / 4, + 1 for the message) is the prompt.

    Without ``block_ids`` the text is unique to the request (it starts with its index). With them
    it is the blocks' texts in order (``block_text``), cut to length: prompts share text exactly
    as far as their leading ids agree."""
    chars = max(0, spec.prompt_tokens - 1) * 4
    if spec.block_ids:
        return "".join(block_text(b) for b in spec.block_ids)[:chars] or "x"
    unit = f"r{spec.index} npu pool route "
    return (unit * (chars // len(unit) + 1))[:chars] or "x"


TRACE_BLOCK_CHARS = 512 * 4  # a trace block is 512 tokens; the simulator counts 4 characters a token


@functools.lru_cache(maxsize=65536)
def block_text(block_id: int) -> str:
    """The one fixed text of a trace block id (2048 characters, distinct from its first 64)."""
    unit = f"block {block_id} kv npu prefix "
    return (unit * (TRACE_BLOCK_CHARS // len(unit) + 1))[:TRACE_BLOCK_CHARS]


def mean_output_tokens(spec: WorkloadSpec) -> float:
    """Expected output length of the (unclamped) lognormal: median · exp(sigma² / 2)."""
    return spec.output_median * math.exp(spec.output_sigma**2 / 2)
