"""Prefix affinity for LA-SWRR: which node likely holds a prompt's prefix, and the load guard.

**The index** (``PrefixIndex``, one per pool in each proxy) remembers, for each node, the
prompt prefixes this proxy sent it: a prompt's text is cut into blocks of ``block_chars``
characters (512, about 128 tokens), and block i's key is the CRC-32 of the whole text up to the
end of block i (a running ``zlib.crc32``: equal keys mean an equal prefix, as vLLM's block hashes
chain the parent's hash). Only the first ``max_prompt_blocks`` blocks are indexed. Each node
keeps at most ``blocks_per_node`` keys, least recently routed evicted first: an approximation of
the engine's own KV cache, which evicts its least recently used blocks when its KV room is full
(set the bound to the engine's KV room in index blocks). ``drop(node)`` forgets a node at once
(removed from the snapshot, or ejected: its cache is gone). Memory: at most
``nodes x blocks_per_node`` keys. Nothing here reads a clock or draws a random number: two
proxies fed the same prompts and picks hold the same index.

**The match.** ``preferred(keys, eligible)`` lists the eligible nodes whose cached prefix is
longer than the shortest one among the eligible nodes, longest first; ties go by a hash of the
deepest matched key and the node name (rendezvous hashing), so replicas that hold the same
entries rank them the same way. A prefix every eligible node holds (one system prompt for all)
tells nothing and prefers nobody: the pick is then exactly LA-SWRR's.

**Sparse records** (``grid``, 0: off; the channel between proxies, docs/proxy.md): another
proxy tells this one only the keys at the *grid positions* of a prompt it routed (block p with
p + 1 a power of two below ``grid``, or a multiple of ``grid``: ``grid_positions``), a few keys
where the whole chain would be dozens. A key is the hash of the whole prefix up to its block, so
a node holding the key at position p holds the whole prefix up to p: with ``grid`` set, ``match``
also looks the request's own keys up at the grid positions and gives each node the deeper of its
contiguous depth and its deepest grid hit. With ``grid`` 0 (one proxy) nothing of this runs.

**The work measure** (``Affinity``, built by the proxy for a request whose size it knows).
Tokens in flight count what makes a request wait for its first token: a node's *load* is its
prefill backlog (the prompt tokens, less the prefix the index says it holds, of the requests
admitted to it that have not sent their first byte yet) plus ``M`` for each request in flight,
``M`` being the mean prompt of the pool's sized requests so far (one request in flight weighs one
average prompt: decode slots and KV are taken while the prefill backlog is gone). A request's
*cost* on a node is its uncached prompt there plus ``M``: a node holding the prefix is cheaper.
LA-SWRR's referee then compares work instead of request counts (``LaSwrr.pick``).

**The guard** (``LaSwrr.pick`` applies it, ``guard_allows`` states it): the preferred node A
takes the request only if, before taking it, its load per unit of weight is below that of the
lightest eligible node C after C took it:

    T_A · w_C  <  (T_C + t) · w_A          T: load, t: the request's cost on C, w: weight

the referee's rule (challenger after the pick against the leader now) with work for requests.
So an affinity pick can put a node at most one request (t / w_C) ahead of the lightest node per
unit of weight, and a node that is ahead gets no affinity pick until the others catch up: every
prompt sharing one long prefix still spreads over the pool, and no node runs away with a
conversation-heavy load (hypothesis test). Candidates are what LA-SWRR may pick at all: routable
(never draining, drained or ejected), weight > 0, not tried for this request; a slow-start
node's weight is its slow-start share, so the guard holds it there.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from functools import lru_cache
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

BLOCK_CHARS = 512
MAX_PROMPT_BLOCKS = 256  # 128 KiB of prompt text
BLOCKS_PER_NODE = 16384  # 2 M tokens at ~128 tokens a block


def prefix_keys(text: bytes, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_PROMPT_BLOCKS) -> list[int]:
    """The prefix-chain keys of the full blocks of ``text`` (at most ``max_blocks``)."""
    count = min(max_blocks, len(text) // block_chars)
    keys: list[int] = []
    running = 0
    view = memoryview(text)
    for i in range(count):
        running = zlib.crc32(view[i * block_chars:(i + 1) * block_chars], running)
        keys.append(running)
    return keys


@lru_cache(maxsize=1024)
def grid_positions(count: int, grid: int) -> tuple[int, ...]:
    """The block positions below ``count`` that sparse records carry (module doc): p with p + 1 a
    power of two below ``grid``, or a multiple of ``grid``."""
    positions: list[int] = []
    step = 1
    while step < grid and step <= count:
        positions.append(step - 1)
        step *= 2
    positions += range(grid - 1, count, grid)
    return tuple(positions)


def rendezvous(key: int, node: str) -> int:
    return zlib.crc32(node.encode(), key)


def guard_allows(tokens_a: float, weight_a: float, tokens_c: float, weight_c: float, cost: float) -> bool:
    """The guard above: A (now) is lighter per unit of weight than C after taking ``cost``."""
    return tokens_a * weight_c < (tokens_c + cost) * weight_a


@dataclass(frozen=True, slots=True)
class Affinity:
    """What a work-aware pick needs: the preference order, each node's load, the request's cost.

    A node's load is ``backlog[n] + mean * counts[n]``; the request's cost on it ``costs[n]``,
    or ``cost`` where it holds no more of the prefix than every node does. ``speed`` (a P/D pool's
    prefill pick only; empty: every node alike) is a node's measured prefill speed relative to the
    fastest eligible one (0 < speed <= 1, a node not named: 1): its load and the request's cost
    there count as tokens of the fastest node, i.e. as time (``LaSwrr.pick``, "Prefill speed")."""

    preferred: Sequence[str]
    backlog: Mapping[str, int]
    cost: int
    costs: Mapping[str, int] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)
    mean: int = 0
    speed: Mapping[str, float] = field(default_factory=dict)

    def load(self, node: str) -> int:
        return self.backlog.get(node, 0) + self.mean * self.counts.get(node, 0)

    def timed(self, node: str, tokens: int) -> float:
        """``tokens`` of work on ``node`` in the fastest node's tokens (``speed``)."""
        return tokens / self.speed.get(node, 1.0)

    def cost_on(self, node: str) -> int:
        return self.costs.get(node, self.cost)


class PrefixIndex:
    __slots__ = ("block_chars", "max_prompt_blocks", "blocks_per_node", "holders", "lru", "grid", "_alone")

    def __init__(self, block_chars: int = BLOCK_CHARS, max_prompt_blocks: int = MAX_PROMPT_BLOCKS,
                 blocks_per_node: int = BLOCKS_PER_NODE) -> None:
        if min(block_chars, max_prompt_blocks, blocks_per_node) < 1:
            raise ValueError("block_chars, max_prompt_blocks and blocks_per_node must be >= 1")
        self.block_chars = block_chars
        self.max_prompt_blocks = max_prompt_blocks
        self.blocks_per_node = blocks_per_node
        # key -> nodes that hold the prefix ending there; a key one node holds (most keys) maps to that
        # node's one shared frozenset (``_alone``), not to a set of its own: 216 bytes less a key
        self.holders: dict[int, set[str] | frozenset[str]] = {}
        self._alone: dict[str, frozenset[str]] = {}  # node -> frozenset({node})
        self.lru: dict[str, OrderedDict[int, None]] = {}  # node -> its keys, least recently routed first
        self.grid = 0  # > 0 once sparse records may be held: ``match`` also looks at the grid positions

    def keys(self, text: bytes) -> list[int]:
        return prefix_keys(text, self.block_chars, self.max_prompt_blocks)

    def entries(self) -> int:
        return sum(len(keys) for keys in self.lru.values())

    def _levels(self, keys: Sequence[int], nodes: set[str]) -> list[set[str]]:
        """For each leading key, the ``nodes`` that hold the prefix up to it (nested, shrinking)."""
        holders = self.holders
        levels: list[set[str]] = []
        alive = nodes
        for key in keys:
            held = holders.get(key)
            if not held:
                break
            alive = alive & held
            if not alive:
                break
            levels.append(alive)
        return levels

    def depths(self, keys: Sequence[int], nodes: Iterable[str]) -> dict[str, int]:
        """How many leading ``keys`` each of ``nodes`` holds."""
        depth = dict.fromkeys(nodes, 0)
        for level, alive in enumerate(self._levels(keys, set(depth)), 1):
            for node in alive:
                depth[node] = level
        return depth

    def preferred(self, keys: Sequence[int], eligible: Sequence[str]) -> list[str]:
        """Eligible nodes holding more of the prefix than the least-holding one, best first."""
        return self.match(keys, eligible)[0]

    def match(self, keys: Sequence[int], eligible: Sequence[str]) -> tuple[list[str], dict[str, int], int]:
        """From one walk of the index: ``preferred(keys, eligible)``, the depth (leading keys
        held) of each of those nodes, and the floor: the depth every eligible node reaches."""
        if not keys or not eligible:
            return [], {}, 0
        everyone = set(eligible)
        levels = self._levels(keys, everyone)
        floor = 0
        while floor < len(levels) and len(levels[floor]) == len(everyone):
            floor += 1
        if self.grid and self._grid_adds(keys, everyone, levels):
            return self._match_sparse(keys, everyone, levels)
        ranked: list[str] = []
        depth: dict[str, int] = {}
        for level in range(len(levels), floor, -1):
            fresh = [n for n in levels[level - 1] if n not in depth]
            if not fresh:
                continue
            key = keys[level - 1]
            fresh.sort(key=lambda n: (-rendezvous(key, n), n))
            ranked += fresh
            for n in fresh:
                depth[n] = level
        return ranked, depth, floor

    def _grid_adds(self, keys: Sequence[int], everyone: set[str], levels: list[set[str]]) -> bool:
        """Some eligible node holds a grid key of the request deeper than its contiguous depth
        (else the sparse match is the contiguous one, and cheaper)."""
        holders, reached = self.holders, len(levels)
        for p in grid_positions(len(keys), self.grid):
            held = holders.get(keys[p])
            if held and (held - levels[p] if p < reached else held) & everyone:
                return True
        return False

    def _match_sparse(self, keys: Sequence[int], everyone: set[str],
                      levels: list[set[str]]) -> tuple[list[str], dict[str, int], int]:
        """``match`` with sparse records: each node's depth is the deeper of its contiguous one and
        its deepest grid hit; the same ranking (deepest first, rendezvous on the deepest key held)."""
        reach = dict.fromkeys(everyone, 0)
        for level, alive in enumerate(levels, 1):
            for node in alive:
                reach[node] = level
        holders = self.holders
        for p in grid_positions(len(keys), self.grid):
            held = holders.get(keys[p])
            if held:
                for node in held & everyone:
                    if reach[node] <= p:
                        reach[node] = p + 1
        floor = min(reach.values())
        ranked = sorted((n for n, d in reach.items() if d > floor),
                        key=lambda n: (-reach[n], -rendezvous(keys[reach[n] - 1], n), n))
        return ranked, {n: reach[n] for n in ranked}, floor

    def record(self, node: str, keys: Sequence[int]) -> None:
        """``node`` was sent a prompt with these keys: it holds them now (most recently)."""
        if not keys:
            return
        lru = self.lru.get(node)
        if lru is None:
            lru = self.lru[node] = OrderedDict()
        holders = self.holders
        alone = self._alone.get(node)
        if alone is None:
            alone = self._alone[node] = frozenset((node,))
        for key in reversed(keys):  # the leading blocks end most recent: evicted last, as the chain needs
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                held = holders.get(key)
                if held is None:
                    holders[key] = alone
                elif isinstance(held, frozenset):  # a node's shared one: never changed in place
                    holders[key] = {*held, node}
                else:
                    held.add(node)
        while len(lru) > self.blocks_per_node:
            old, _ = lru.popitem(last=False)
            self._unhold(old, node)

    def drop(self, node: str) -> None:
        """Forget everything ``node`` held (removed or ejected: its cache is gone)."""
        for key in self.lru.pop(node, ()):
            self._unhold(key, node)
        self._alone.pop(node, None)

    def nodes(self) -> list[str]:
        return list(self.lru)

    def _unhold(self, key: int, node: str) -> None:
        held = self.holders[key]
        if len(held) == 1:
            del self.holders[key]
        else:
            held.discard(node)  # type: ignore[union-attr]  # a set of two or more: its own, mutable
