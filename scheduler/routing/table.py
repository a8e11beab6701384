"""The routing table: the newest snapshot of each pool, and the live counts the picks weigh.

* **Newest wins, within one LB_WEIGHTS stream.** ``offer(snapshot)`` installs a pool's snapshot
  only if its ``as_of_seq`` is higher than the one held; a late or replayed older snapshot never
  replaces a newer one. ``as_of_seq`` numbers only compare within one stream, though: when the
  bus finds LB_WEIGHTS recreated (``services.proxy.bus``), ``new_stream()`` marks every held
  snapshot *superseded*, and the next snapshot offered for that pool replaces it whatever its
  ``as_of_seq`` (a fresh scheduler on a fresh stream counts from 1 again). With NATS gone, or a
  pool the new stream does not (yet) carry, the last snapshot stays in force (never fail closed).
* **One load view across replicas** (``scheduler.routing.load``): the policy picks on an
  estimate of each node's *pool-wide* in-flight count, the other replicas' requests as the
  snapshot counts them (``snapshot.inflight[n] - snapshot.proxy_inflight[me][n]``) plus this
  proxy's own live count. ``snapshot.proxy_inflight[me]`` is what the scheduler had seen of
  *this* proxy at ``as_of_seq``, so this proxy's own requests are counted once, live, whatever
  its events' lag; only the other replicas' part is as old as the snapshot (docs/proxy.md,
  "Proxy replicas and workers"). ``me`` is ``proxy_id`` (a table without one routes on its own
  counts alone); a snapshot without ``proxy_inflight`` gives ``others = 0``.
* **Seeds.** Each pool's policies are seeded from the proxy's seed and the pool name, so
  replicas (different proxy ids) start their SWRR/P2C sequences at different points
  (docs/algorithm.md §5, "Seeded warm-up"); a P/D pool's decode role starts elsewhere again.
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Iterable, Iterator
from enum import IntEnum

from laswrr.scheduler.policies import make_policy
from laswrr.scheduler.routing.kvindex import KvIndex
from laswrr.scheduler.routing.load import Load
from laswrr.scheduler.routing.route import Picker, PoolRoute
from laswrr.scheduler.routing.work import PrefillSpeeds, PrefixScorer
from laswrr.schemas.outputs import WeightSnapshot
from laswrr.schemas.words import Phase

_DECODE_SEED = 0x5EED_DEC0DE  # the decode role's policy starts elsewhere than the prefill role's


class Offered(IntEnum):
    """What ``RoutingTable.offer`` did with a snapshot (falsy: refused)."""

    REFUSED = 0  # not newer than the one held (nor was that one superseded)
    INSTALLED = 1
    NARROWED = 2  # installed, and some node the pool's previous snapshot let take requests left rotation


class RoutingTable:
    def __init__(self, policy: str, seed: int, proxy_id: str | None = None,
                 scorer: PrefixScorer | None = None, kv_in_flight: bool = False) -> None:
        make_policy(policy, seed)  # fail fast on an unknown name
        self.policy_name = policy
        self.seed = seed
        self.proxy_id = proxy_id  # whose share of the snapshot's in-flight is this proxy's own
        self.scorer = scorer
        self._pools: dict[str, PoolRoute] = {}
        self.views = 0  # counts the snapshots installed and the pools forgotten: what a cache of plans keys on
        self.load = Load()
        self.speeds = PrefillSpeeds()
        self.kv = KvIndex(kv_in_flight)  # the exact view of the nodes whose engines publish KV events (lb.kv.<node>)

    def offer(self, snapshot: WeightSnapshot, now: float) -> Offered:
        """Install ``snapshot`` if it is newer than the pool's current one (or that one is superseded)."""
        route = self._pools.get(snapshot.pool)
        before: set[str] = set()
        if route is None:
            seed = (self.seed ^ zlib.crc32(snapshot.pool.encode())) & ((1 << 64) - 1)
            first = Picker(make_policy(self.policy_name, seed),
                           index=self.scorer.new_index() if self.scorer is not None else None)
            decode = Picker(make_policy(self.policy_name, seed ^ _DECODE_SEED), limited=False)
            route = self._pools[snapshot.pool] = PoolRoute(snapshot, first, decode, received_at=now)
        elif snapshot.as_of_seq <= route.snapshot.as_of_seq and not route.superseded:
            return Offered.REFUSED
        else:
            before = route.candidates()
        others = route.others
        route.install(snapshot, now, self.proxy_id, self.speeds)
        for view in snapshot.nodes:  # an ejected node may return restarted: its cache is not known to hold anything
            if view.phase == Phase.EJECTED:
                self.kv.empty(view.node)
        self.views += 1
        if others or route.others:
            self.reload(others.keys() | route.others.keys())
        return Offered.NARROWED if before - route.candidates() else Offered.INSTALLED

    def forget(self, pool: str) -> None:
        """The pool's key was deleted from the bucket: the scheduler no longer knows it."""
        route = self._pools.pop(pool, None)
        self.views += 1
        if route is not None and route.others:
            self.reload(route.others)
        if route is not None and route.peers:
            self.sum_peer_backlog()

    def new_stream(self) -> None:
        """LB_WEIGHTS was recreated: its ``as_of_seq`` restart; each pool takes the next snapshot offered."""
        for route in self._pools.values():
            route.superseded = True

    def applied_seq(self) -> int | None:
        """The newest ``as_of_seq`` this proxy routes on, any pool of the current stream (the
        heartbeat's ``snapshot_seq``: a drain waits until it reaches the drain's seq); None: none yet."""
        return max((route.snapshot.as_of_seq for route in self._pools.values() if not route.superseded), default=None)

    def reload(self, nodes: Iterable[str]) -> None:
        """``load`` of ``nodes`` again from the own counts and every pool's others."""
        self.load.reload(nodes, [route.others for route in self._pools.values()])

    def repeer(self, route: PoolRoute) -> None:
        """``others`` and the peers' prefill backlog again after a pool's peers changed."""
        before = route.others
        route.others = route.merged_others(self.proxy_id)
        if before or route.others:
            self.reload(before.keys() | route.others.keys())
        self.sum_peer_backlog()

    def sum_peer_backlog(self) -> None:
        backlog: dict[str, int] = {}
        for route in self._pools.values():
            for view in route.peers.values():
                for node, tokens in view.backlog.items():
                    if tokens > 0:
                        backlog[node] = backlog.get(node, 0) + tokens
        self.load.peer_backlog = backlog

    def route(self, pool: str) -> PoolRoute | None:
        return self._pools.get(pool)

    def routes(self) -> Iterator[tuple[str, PoolRoute]]:
        return iter(list(self._pools.items()))

    def names(self) -> list[str]:
        """The pools held, in the order their first snapshot came."""
        return list(self._pools)

    def snapshots(self) -> dict[str, WeightSnapshot]:
        return {pool: route.snapshot for pool, route in self._pools.items()}

    def candidates(self, pool: str, exclude: Container[str] = ()) -> list[str]:
        """The nodes of ``pool`` a first admission may pick (routable), less ``exclude``."""
        route = self._pools.get(pool)
        return [] if route is None else [node for node in route.first.targets if node not in exclude]

    def routable_urls(self) -> list[tuple[str, str]]:
        """(pool, url) of every candidate node, for /v1/models."""
        return [(pool, n.url) for pool, route in self._pools.items() for n in route.first.targets.values()]
