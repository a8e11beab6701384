"""The proxy's routing table: the newest snapshot of each pool, one pick policy per pool, live in-flight.

Rules:

* **Newest wins, within one LB_WEIGHTS stream.** ``offer(snapshot)`` installs a pool's snapshot
  only if its ``as_of_seq`` is higher than the one held; a late or replayed older snapshot never
  replaces a newer one. ``as_of_seq`` numbers only compare within one stream, though: when the
  bus finds LB_WEIGHTS recreated (``services.proxy.bus``), ``new_stream()`` marks every held
  snapshot *superseded*, and the next snapshot offered for that pool replaces it whatever its
  ``as_of_seq`` (a fresh scheduler on a fresh stream counts from 1 again). With NATS gone, or a
  pool the new stream does not (yet) carry, the last snapshot stays in force (never fail closed).
* **Candidates.** A node is a candidate iff the snapshot marks it ``routable`` and its
  ``effective_weight`` > 0 (the core already folded phase and the panic rail into ``routable``).
  Each new snapshot goes to the pool's policy with ``set_candidates``; policy state (SWRR
  accumulators) carries across snapshots.
* **One load view across replicas.** The policy picks on an estimate of each node's *pool-wide*
  in-flight count, not this proxy's alone (``load``): the other replicas' requests as the
  snapshot counts them, plus this proxy's own live count,

      load[n] = others[n] + own[n],   others[n] = snapshot.inflight[n] - snapshot.proxy_inflight[me][n]

  ``snapshot.proxy_inflight[me]`` is what the scheduler had seen of *this* proxy at
  ``as_of_seq`` (schemas.outputs.WeightSnapshot), so this proxy's own requests are counted once,
  live, whatever its events' lag; only the other replicas' part is as old as the snapshot (its
  staleness: docs/design.md, "Proxy replicas and workers"). ``me`` is ``proxy_id`` (a router
  built without one routes on its own counts alone). A snapshot
  without ``proxy_inflight`` (no request open in the pool, or a scheduler from before the field)
  gives ``others = 0``: the pick is then exactly the one on own counts, as it is whenever this
  proxy is the pool's only one (others are 0 by construction).
* **Admission binds.** ``admit`` picks with the policy on ``load``, excluding the nodes already
  tried for the request (nginx's per-request ``tried`` set) and, with a cap, the nodes whose
  estimated in-flight reached ``ceil(F x capacity)``; it returns the node's URL from
  the snapshot in force *at admission* and counts the request in flight. Later snapshots
  (weight change, drain, capacity 0, removal) never touch an admitted request: it holds its own
  ``Admission``; only ``release`` ends it.
* **Prefix affinity** (la-swrr, on unless ``affinity="none"``): each pool keeps a
  ``PrefixIndex`` of the prompt prefixes this proxy sent each node; ``admit`` given the prompt's
  text prefers the nodes holding more of it, and LA-SWRR's pick lets one of them take the request
  only under the token guard (``scheduler.policies.affinity``). A node that leaves the snapshot
  or is ejected is dropped from the index at once.
* **Work** (with affinity, for a request whose size is known): the pick weighs work, not
  requests (``scheduler.policies.affinity``, "The work measure"). The proxy keeps, per node, the
  *prefill backlog*: the uncached prompt estimate of each admitted request that has not sent its
  first byte yet (``prefilled`` takes it off when the engine's first byte arrives, ``release`` at
  the latest), and the mean prompt ``M`` of the sized requests admitted so far. A node's load is
  its backlog plus ``M`` per request in flight; the request's cost on a node is its prompt less
  the prefix the index says the node holds, plus ``M``. Without a prompt, or with
  ``affinity="none"``, the pick is exactly LA-SWRR's on request counts. The index and the
  backlog are this proxy's own (another replica's prefixes are not known here); the requests in
  flight are the pool-wide ``load``, another replica's counting ``M`` each.
* **Seeds.** Each pool's policy is seeded from the proxy's seed and the pool name, so replicas
  (different proxy ids) start their SWRR/P2C sequences at different points (docs/algorithm.md
  §5, "Seeded warm-up").

No IO and no clock: callers pass ``now`` (monotonic seconds) where an age is needed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from laswrr.scheduler.policies import Candidate, Policy, canonical_policy, make_policy
from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE, Affinity, PrefixIndex
from laswrr.scheduler.policies.la_swrr import LaSwrr
from laswrr.schemas.outputs import NodeView, WeightSnapshot
from laswrr.services.proxy.prompt import CHARS_PER_TOKEN, RequestSize

DEFAULT_POOL = "default"


@dataclass(slots=True, eq=False)
class Admission:
    """A request bound to one node: everything the forwarder needs, fixed at admission."""

    pool: str
    node: str
    url: str
    snapshot_seq: int
    size: RequestSize | None = None  # the request's tokens, as the proxy estimates them
    backlog: int = 0  # its uncached prompt estimate, in the node's prefill backlog until prefilled


@dataclass(slots=True)
class PoolRoute:
    snapshot: WeightSnapshot
    policy: Policy
    received_at: float
    targets: dict[str, NodeView] = field(default_factory=dict)
    superseded: bool = False  # from a stream that no longer exists: any next snapshot replaces it
    index: PrefixIndex | None = None  # prefix affinity (la-swrr only)
    others: dict[str, int] = field(default_factory=dict)  # node -> the other replicas' in-flight (> 0 only)

    def install(self, snapshot: WeightSnapshot, now: float, proxy_id: str | None = None) -> None:
        self.snapshot, self.received_at, self.superseded = snapshot, now, False
        self.others = others_inflight(snapshot, proxy_id)
        self.targets = {n.node: n for n in snapshot.nodes if n.routable and n.effective_weight > 0}
        self.policy.set_candidates([Candidate.from_weight(n.node, n.effective_weight) for n in self.targets.values()])
        if self.index is not None:
            kept = {n.node for n in snapshot.nodes if n.phase != "ejected"}
            for node in self.index.nodes():
                if node not in kept:
                    self.index.drop(node)


def others_inflight(snapshot: WeightSnapshot, proxy_id: str | None) -> dict[str, int]:
    """Per node, the requests other proxies have open on it as of the snapshot (module doc); only
    the nodes with some. Empty when the snapshot carries no ``proxy_inflight``, or without a
    ``proxy_id`` (a router that does not know which share is its own cannot subtract it)."""
    if not snapshot.proxy_inflight or proxy_id is None:
        return {}
    mine = snapshot.proxy_inflight.get(proxy_id, {})
    others = {}
    for view in snapshot.nodes:
        count = view.inflight - mine.get(view.node, 0)
        if count > 0:
            others[view.node] = count
    return others


class Router:
    def __init__(self, policy: str, seed: int, inflight_cap_per_capacity: float | None = None,
                 affinity: str = "prefix", affinity_blocks: int = BLOCKS_PER_NODE,
                 proxy_id: str | None = None) -> None:
        make_policy(policy, seed)  # fail fast on an unknown name
        self.proxy_id = proxy_id  # whose share of the snapshot's in-flight is this proxy's own
        self.policy_name = policy
        self.seed = seed
        self.cap_factor = inflight_cap_per_capacity
        la_swrr = canonical_policy(policy) == LaSwrr.name
        self.affinity_blocks = affinity_blocks if affinity == "prefix" and la_swrr else 0
        self.affinity_mode = "prefix" if self.affinity_blocks else "none"
        self.pools: dict[str, PoolRoute] = {}
        self.inflight: dict[str, int] = {}  # node -> this proxy's own live in-flight (> 0 only)
        self.load: dict[str, int] = {}  # node -> others + own: what the policy picks on (> 0 only)
        self.backlog: dict[str, int] = {}  # node -> prefill backlog (tokens) of its admitted requests
        self.sized = 0  # sized requests admitted, and their prompt tokens: the mean prompt M
        self.sized_prompt_tokens = 0
        self.total_inflight = 0

    # -- snapshots ----------------------------------------------------------------------------

    def offer(self, snapshot: WeightSnapshot, now: float) -> bool:
        """Install ``snapshot`` if it is newer than the pool's current one (or that one is superseded); True if installed."""
        route = self.pools.get(snapshot.pool)
        if route is None:
            seed = (self.seed ^ zlib.crc32(snapshot.pool.encode())) & ((1 << 64) - 1)
            index = PrefixIndex(blocks_per_node=self.affinity_blocks) if self.affinity_blocks else None
            route = PoolRoute(snapshot=snapshot, policy=make_policy(self.policy_name, seed), received_at=now,
                              index=index)
            self.pools[snapshot.pool] = route
        elif snapshot.as_of_seq <= route.snapshot.as_of_seq and not route.superseded:
            return False
        before = route.others
        route.install(snapshot, now, self.proxy_id)
        if before or route.others:
            self._reload(before.keys() | route.others.keys())
        return True

    def _reload(self, nodes: Iterable[str]) -> None:
        """``load`` of ``nodes`` again from the own counts and every pool's others."""
        for node in nodes:
            count = self.inflight.get(node, 0) + sum(r.others.get(node, 0) for r in self.pools.values())
            if count > 0:
                self.load[node] = count
            else:
                self.load.pop(node, None)

    def new_stream(self) -> None:
        """LB_WEIGHTS was recreated: its ``as_of_seq`` restart; each pool takes the next snapshot offered."""
        for route in self.pools.values():
            route.superseded = True

    def forget(self, pool: str) -> None:
        """The pool's key was deleted from the bucket: the scheduler no longer knows it."""
        route = self.pools.pop(pool, None)
        if route is not None and route.others:
            self._reload(route.others)

    def resolve_pool(self, model: str | None, model_pools: dict[str, str] | None = None) -> str | None:
        """The pool named by ``model``; else the pool whose engines serve it; else ``default``."""
        if model and model in self.pools:
            return model
        if model and model_pools and model_pools.get(model) in self.pools:
            return model_pools[model]
        return DEFAULT_POOL if DEFAULT_POOL in self.pools else None

    def routable_urls(self) -> list[tuple[str, str]]:
        """(pool, url) of every candidate node, for /v1/models."""
        return [(pool, n.url) for pool, route in self.pools.items() for n in route.targets.values()]

    # -- admission ----------------------------------------------------------------------------

    def admit(self, pool: str, tried: Iterable[str] = (), prompt: bytes = b"",
              size: RequestSize | None = None) -> Admission | None:
        """Pick a node for a request (``prompt``: its text, for affinity; ``size``: its tokens)."""
        route = self.pools.get(pool)
        if route is None or not route.targets:
            return None
        exclude = set(tried)
        if self.cap_factor is not None:
            exclude.update(n for n, view in route.targets.items() if self.at_cap(view))
        index = route.index
        backlog = 0
        if index is not None and prompt and size is not None:
            assert isinstance(route.policy, LaSwrr)
            keys = index.keys(prompt)
            affinity = self._work(index, keys, size, [n for n in route.targets if n not in exclude])
            node = route.policy.pick(self.load, exclude, affinity)
            if node is not None:
                index.record(node, keys)
                backlog = affinity.cost_on(node) - affinity.mean  # its uncached prompt there
        else:
            node = route.policy.pick(self.load, exclude)
        if node is None:
            return None
        self.inflight[node] = self.inflight.get(node, 0) + 1
        self.load[node] = self.load.get(node, 0) + 1
        admission = Admission(pool=pool, node=node, url=route.targets[node].url,
                              snapshot_seq=route.snapshot.as_of_seq, size=size, backlog=backlog)
        if backlog:
            self.backlog[node] = self.backlog.get(node, 0) + backlog
        self.total_inflight += 1
        return admission

    @property
    def mean_prompt(self) -> int:
        return self.sized_prompt_tokens // self.sized if self.sized else 0

    def _work(self, index: PrefixIndex, keys: list[int], size: RequestSize, eligible: list[str]) -> Affinity:
        """The request's cost on each eligible node and each node's load (see the module docstring)."""
        self.sized += 1
        self.sized_prompt_tokens += size.prompt_tokens
        mean = self.mean_prompt
        preferred, depth, floor = index.match(keys, eligible)
        block = index.block_chars // CHARS_PER_TOKEN
        prompt = size.prompt_tokens
        costs = {n: max(0, prompt - d * block) + mean for n, d in depth.items()}
        return Affinity(preferred, self.backlog, max(0, prompt - floor * block) + mean, costs, self.load, mean)

    def prefilled(self, admission: Admission) -> None:
        """The engine sent the admission's first byte: its prompt has left the node's prefill backlog."""
        if admission.backlog:
            left = self.backlog[admission.node] - admission.backlog
            if left:
                self.backlog[admission.node] = left
            else:
                del self.backlog[admission.node]
            admission.backlog = 0

    def at_cap(self, view: NodeView) -> bool:
        assert self.cap_factor is not None
        return self.load.get(view.node, 0) >= math.ceil(self.cap_factor * view.capacity)

    def release(self, admission: Admission) -> None:
        self.prefilled(admission)
        node = admission.node
        count = self.inflight[node] - 1
        self.total_inflight -= 1
        load = self.load[node] - 1
        if load > 0:
            self.load[node] = load
        else:
            del self.load[node]
        if count > 0:
            self.inflight[node] = count
        else:
            del self.inflight[node]
