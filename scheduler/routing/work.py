"""What a pick weighs beyond request counts: prefix affinity's scorer and P/D prefill speeds.

* **The scorer** (``PrefixScorer``, handed to the router for a policy that ``uses_affinity``:
  la-swrr; none, ``--affinity none``: the pick is exactly LA-SWRR's on request counts). Each pool
  keeps a ``PrefixIndex`` of the prompt prefixes this proxy sent each node (``new_index``). For a
  request with a prompt and a size, ``score`` gives the policy its ``Affinity``: the nodes holding
  more of the prompt, and the pick weighs work, not requests (``scheduler.policies.affinity``,
  "The work measure"): a node's load is its prefill backlog (own and the peers') plus ``M`` per
  request in flight, ``M`` the mean prompt of the sized requests admitted so far; the request's
  cost on a node is its prompt less the prefix the index says the node holds, plus ``M``.
  **The exact view** (``cached``: per eligible node whose engine publishes KV events, the prompt
  tokens it holds by ``scheduler.routing.kvindex.KvIndex``): for those nodes that figure replaces
  the index's estimate; the preference order is then by tokens held, deepest first (ties in the
  index's order, then by name), the nodes holding no more than every eligible node not preferred.
  Without ``cached`` (no node publishes events) the pick is exactly the estimated one.
* **Prefill speeds** (``PrefillSpeeds``, a P/D pool's prefill role): the proxy reports each
  prefill leg's time (``done``): per prefill node, a moving average of its rate (the prefill work
  it had at the pick over the leg's time), and a node measured below ``PREFILL_SPEED_ALIKE`` of
  the fastest one has its work counted as time in the prefill pick (``Affinity.speed``; LA-SWRR,
  "Prefill speed"): a silently slow prefill node, which queues nothing at low load and so keeps
  its weight, no longer gets its share of long prompts.
"""

from __future__ import annotations

from collections.abc import Mapping

from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE, Affinity, PrefixIndex
from laswrr.scheduler.routing.prompt import CHARS_PER_TOKEN, RequestSize

PREFILL_RATE_WEIGHT = 0.3  # the weight of each prefill leg's rate in its node's moving average
PREFILL_RATE_MIN_TOKENS = 256  # a leg with less work than this says more about the round trip than the rate
PREFILL_RATE_DRIFT = 0.02  # each prefill pick elsewhere moves a node's rate this share back toward the fastest's
PREFILL_SPEED_ALIKE = 0.8  # a node at least this share of the fastest's rate counts as fast as it


class PrefixScorer:
    """Prefix affinity: the per-pool index it keeps and the ``Affinity`` of each request."""

    mode = "prefix"  # the word /status reports (``--affinity``)

    def __init__(self, blocks_per_node: int = BLOCKS_PER_NODE) -> None:
        self.blocks_per_node = blocks_per_node
        self.sized = 0  # sized requests scored, and their prompt tokens: the mean prompt M
        self.sized_prompt_tokens = 0

    def new_index(self) -> PrefixIndex:
        return PrefixIndex(blocks_per_node=self.blocks_per_node)

    @property
    def mean_prompt(self) -> int:
        return self.sized_prompt_tokens // self.sized if self.sized else 0

    def score(self, index: PrefixIndex, keys: list[int], size: RequestSize, eligible: list[str],
              backlog: Mapping[str, int], load: Mapping[str, int], speed: Mapping[str, float],
              cached: Mapping[str, int] | None = None) -> Affinity:
        """The request's cost on each eligible node and each node's load (module docstring)."""
        self.sized += 1
        self.sized_prompt_tokens += size.prompt_tokens
        mean = self.mean_prompt
        preferred, depth, floor = index.match(keys, eligible)
        block = index.block_chars // CHARS_PER_TOKEN
        prompt = size.prompt_tokens
        if cached:
            return exact_affinity(preferred, depth, floor * block, block, cached, prompt, eligible,
                                  backlog, load, mean, speed)
        costs = {n: max(0, prompt - d * block) + mean for n, d in depth.items()}
        return Affinity(preferred, backlog, max(0, prompt - floor * block) + mean, costs, load, mean, speed)


def exact_affinity(preferred: list[str], depth: Mapping[str, int], floor_tokens: int, block: int,
                   cached: Mapping[str, int], prompt: int, eligible: list[str], backlog: Mapping[str, int],
                   load: Mapping[str, int], mean: int, speed: Mapping[str, float]) -> Affinity:
    """The ``Affinity`` with the exact view of the nodes in ``cached`` (module docstring): each
    eligible node's tokens held, by its engine's events or else by the index's estimate."""
    held = {n: cached[n] if n in cached else depth.get(n, 0) * block if n in depth else floor_tokens
            for n in eligible}
    floor = min(held.values(), default=0)
    order = {n: i for i, n in enumerate(preferred)}
    ranked = sorted((n for n, t in held.items() if t > floor), key=lambda n: (-held[n], order.get(n, len(order)), n))
    costs = {n: max(0, prompt - held[n]) + mean for n in ranked}
    return Affinity(ranked, backlog, max(0, prompt - floor) + mean, costs, load, mean, speed)


class PrefillSpeeds:
    """The measured prefill rate (tokens/s) of each P/D prefill node (module docstring)."""

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}

    def of(self, eligible: list[str]) -> dict[str, float]:
        """The eligible nodes' speeds relative to the fastest measured one (``Affinity.speed``):
        only the nodes below ``PREFILL_SPEED_ALIKE`` of it (empty: all alike, the pick as without).
        A node never measured counts as fast: its first legs measure it."""
        rates = [self.rate[n] for n in eligible if n in self.rate]
        fastest = max(rates, default=0.0)
        if not fastest:
            return {}
        return {n: rate / fastest for n in eligible
                if (rate := self.rate.get(n, fastest)) < PREFILL_SPEED_ALIKE * fastest}

    def drift(self, picked: str, targets: Mapping[str, object]) -> None:
        """After a prefill pick, every other measured node's rate moves ``PREFILL_RATE_DRIFT`` back
        toward the fastest's: a node that gets no legs because it measured slow is tried again
        in time, and measured afresh (an engine that recovered is not avoided forever)."""
        rates = self.rate
        fastest = max((rates[n] for n in targets if n in rates), default=0.0)
        for node in targets:
            rate = rates.get(node)
            if rate is not None and node != picked and rate < fastest:
                rates[node] = rate + PREFILL_RATE_DRIFT * (fastest - rate)

    def done(self, node: str, work: int, seconds: float) -> None:
        """A prefill leg of ``work`` tokens answered ``seconds`` after it was sent; legs with less
        work than ``PREFILL_RATE_MIN_TOKENS`` say nothing (the round trip dominates)."""
        if work < PREFILL_RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = work / seconds
        mean = self.rate.get(node)
        self.rate[node] = rate if mean is None else mean + PREFILL_RATE_WEIGHT * (rate - mean)
