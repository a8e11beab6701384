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


class KvIndex:
    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: dict[str, NodeBlocks] = {}

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
            for key in keys:
                if key not in blocks.keys:
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
