"""The engines' KV cache events in virtual time (``laswrr bench --virtual --kv-events``).

What ``laswrr kv-events`` does for a vLLM engine (docs/design.md, "The engines' own KV cache
events"), for the simulated engines of ``bench/virtual.py``: each engine's prefix cache logs the
blocks it stores and evicts (``PrefixCache.take_changes``); after each engine step that changed
it, the change becomes one ``CacheChanged`` for the node (``n`` from 1, ``seq`` the engine's step
count, its keys the simulator's ``chain_keys`` over its token ids: the keys a router computes from
the same ids), and every router folds it into its exact view (``table.kv``) ``delay_s`` later,
the bus's delivery time, in the order sent. Before any request each node's first message (empty:
an engine starts with an empty cache) makes every view exact from the start. ``messages`` and
``bytes`` count what the bus would carry (each message as encoded on ``lb.kv.<node>``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from laswrr.scheduler.routing.router import Router
from laswrr.schemas import subjects as sj
from laswrr.schemas.kvcache import CACHE_ENCODER, CacheChanged, pack_block_keys
from laswrr.services.sim_engine.physics import EngineSim


class KvFeed:
    def __init__(self, engines: Mapping[str, EngineSim], routers: Sequence[Router],
                 schedule: Callable[[float, Callable[[float], None]], None], delay_s: float = 0.0) -> None:
        self.engines = engines
        self.routers = routers
        self.schedule = schedule
        self.delay_s = delay_s
        self.sent: dict[str, int] = dict.fromkeys(engines, 0)  # messages sent for each node (the last n)
        self.messages = 0
        self.bytes = 0  # payloads and subjects

    def start(self, now: float) -> None:
        """Each node's first message, before any request: its view is exact (and empty) from here."""
        for node in self.engines:
            self._send(node, now, [], [])

    def step(self, node: str, now: float) -> None:
        """After ``node``'s engine advanced to ``now``: the blocks it stored and evicted, if any."""
        stored, removed = self.engines[node].prefix_cache.take_changes()
        if stored or removed:
            self._send(node, now, stored, removed)

    def _send(self, node: str, now: float, stored: list[int], removed: list[int]) -> None:
        self.sent[node] += 1
        engine = self.engines[node]
        change = CacheChanged(n=self.sent[node], seq=engine.steps, block_size=engine.params.kv_block_tokens,
                              stored=pack_block_keys(stored), removed=pack_block_keys(removed))
        self.messages += 1
        self.bytes += len(CACHE_ENCODER.encode(change)) + len(sj.kv(node))

        def deliver(_at: float) -> None:
            for router in self.routers:
                router.table.kv.apply(node, change)

        if self.delay_s > 0:
            self.schedule(now + self.delay_s, deliver)
        else:
            deliver(now)
