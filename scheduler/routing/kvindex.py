"""The exact cache view: each node's KV blocks as its engine's events tell them (``lb.kv.<node>``).

A proxy folds every ``CacheChanged`` (``schemas.kvcache``; published by ``laswrr kv-events``)
into ``KvIndex``: per node, the set of block keys its engine holds now and its block size. Keys
are computed from tokens (``schemas.kvcache.chain_keys``), so ``depths(token_ids, nodes)`` gives,
for each node whose view is exact, how many leading whole blocks of a request's tokens it holds,
as the engine would count them (its ``cached_tokens`` = depth x block size).

**Trust.** A node's view is exact only while its messages arrive in order: ``apply`` takes a
change whose counter ``n`` follows the last one taken (or any change that says ``cleared``,
which replaces the view whole); a change after a lost one marks the node *stale*: its keys are
dropped and it has no exact view (``exact`` is False: the router falls back to the estimated
view for it) until a ``cleared`` change starts it again. ``drop(node)`` forgets a node (removed,
or its events stopped). ``empty(node)``: the node was ejected, and its engine may come back
restarted with an empty cache before its first event says so (a restarted engine tells its restart
only with the first blocks it stores): its keys are dropped, its counter kept, so the view says
it holds nothing, and the next changes are taken. Pure: no clock, no socket; two proxies fed the same changes
hold the same view.

**In flight** (``in_flight``: the proxy's ``--kv-in-flight``, off by default). Between a pick
and the engine's ``BlockStored`` for it the events cannot know what the engine is about to hold:
a second request of the same system prompt or conversation, picked while the first still waits
in the engine's queue or prefills, would find the prefix on that node when the engine schedules
it (FCFS), but the events say "not held". So ``expect(node, token_ids)`` counts the whole blocks
of a picked request's prompt as held on its node (``NodeBlocks.pending``, a count per key) from
the pick until ``settle`` at the attempt's end. Over that span the blocks are about to be stored
(queued) or held (a running request's blocks are referenced and cannot be evicted; only a
preemption frees them); by its end the engine's events have said "stored" if it stored them.
Each proxy counts only its own picks (a replica's are in its events once stored).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from laswrr.schemas.kvcache import CacheChanged, chain_keys


@dataclass(slots=True)
class NodeBlocks:
    keys: set[int] = field(default_factory=set)
    block_size: int = 0
    last_n: int = 0
    stale: bool = False
    pending: dict[int, int] = field(default_factory=dict)  # key -> this proxy's picks in flight whose prompt has it


@dataclass(slots=True, eq=False)
class Expected:
    """A pick's prompt blocks counted as held on its node until ``KvIndex.settle``."""

    blocks: NodeBlocks
    keys: list[int]


class KvIndex:
    __slots__ = ("nodes", "in_flight")

    def __init__(self, in_flight: bool = False) -> None:
        self.nodes: dict[str, NodeBlocks] = {}
        self.in_flight = in_flight  # count the blocks of picks in flight as held (module docstring)

    def apply(self, node: str, change: CacheChanged) -> bool:
        """Fold one change; False when it could not be taken (the node is stale since a lost one)."""
        blocks = self.nodes.get(node)
        if blocks is None:
            blocks = self.nodes[node] = NodeBlocks()
            blocks.stale = not change.cleared and change.n != 1  # joined mid-stream: nothing known yet
        if change.cleared:
            blocks.keys.clear()
            blocks.stale = False
        elif blocks.stale or change.n != blocks.last_n + 1:
            blocks.keys.clear()
            blocks.stale = True
            blocks.last_n = change.n
            return False
        blocks.last_n = change.n
        blocks.block_size = change.block_size
        blocks.keys.update(change.stored_keys)
        blocks.keys.difference_update(change.removed_keys)
        return True

    def exact(self, node: str) -> bool:
        blocks = self.nodes.get(node)
        return blocks is not None and not blocks.stale and blocks.block_size > 0

    def drop(self, node: str) -> None:
        self.nodes.pop(node, None)

    def empty(self, node: str) -> None:
        blocks = self.nodes.get(node)
        if blocks is not None:
            blocks.keys.clear()

    def expect(self, node: str, token_ids: Sequence[int]) -> Expected | None:
        """``node`` was picked for a prompt of ``token_ids``: its whole blocks count as held there
        until ``settle`` (None: not counted: ``in_flight`` off, or no exact view of the node)."""
        if not self.in_flight or not token_ids or not self.exact(node):
            return None
        blocks = self.nodes[node]
        keys = chain_keys(token_ids, blocks.block_size)
        if not keys:
            return None
        pending = blocks.pending
        for key in keys:
            pending[key] = pending.get(key, 0) + 1
        return Expected(blocks, keys)

    @staticmethod
    def settle(expected: Expected) -> None:
        """The attempt of ``expected`` ended: its blocks count no more (the events say what is held)."""
        pending = expected.blocks.pending
        for key in expected.keys:
            left = pending.get(key, 0) - 1
            if left > 0:
                pending[key] = left
            else:
                pending.pop(key, None)
        expected.keys = []  # a second settle is a no-op

    def depths(self, token_ids: Sequence[int], nodes: Iterable[str]) -> dict[str, int]:
        """For each of ``nodes`` with an exact view: the leading whole blocks of ``token_ids`` it
        holds (nodes without one are left out). Keys are computed once per block size."""
        out: dict[str, int] = {}
        keys_by_size: dict[int, list[int]] = {}
        for node in nodes:
            if not self.exact(node):
                continue
            blocks = self.nodes[node]
            keys = keys_by_size.get(blocks.block_size)
            if keys is None:
                keys = keys_by_size[blocks.block_size] = chain_keys(token_ids, blocks.block_size)
            depth = 0
            held, pending = blocks.keys, blocks.pending
            for key in keys:
                if key not in held and key not in pending:
                    break
                depth += 1
            out[node] = depth
        return out

    def cached(self, token_ids: Sequence[int], nodes: Iterable[str]) -> dict[str, int]:
        """``depths`` in tokens: for each of ``nodes`` with an exact view, the prompt tokens its
        engine would find cached, as vLLM counts them: never the prompt's last token (it computes
        that one again for its logits), so a block ending at it does not count."""
        head = token_ids[:-1]
        return {node: depth * self.nodes[node].block_size for node, depth in self.depths(head, nodes).items()}

    def cached_tokens(self, token_ids: Sequence[int], node: str) -> int | None:
        """The prompt tokens ``node``'s engine would find cached (None: no exact view of it)."""
        depth = self.depths(token_ids, (node,)).get(node)
        return None if depth is None else depth * self.nodes[node].block_size
