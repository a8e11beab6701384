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
  staleness: docs/proxy.md, "Proxy replicas and workers"). ``me`` is ``proxy_id`` (a router
  built without one routes on its own counts alone). A snapshot
  without ``proxy_inflight`` (no request open in the pool, or a scheduler from before the field)
  gives ``others = 0``: the pick is then exactly the one on own counts, as it is whenever this
  proxy is the pool's only one (others are 0 by construction).
* **Admission binds.** ``admit`` picks with the policy on ``load``, excluding the nodes already
  tried for the request (nginx's per-request ``tried`` set) and, with a cap, the nodes whose
  estimated in-flight reached ``ceil(F x capacity)`` and, with ``flow_limits`` (flow control), the
  nodes at the slot limit their snapshot publishes (``NodeView.concurrency_limit``; not for a
  retry or a continuation, whose request was admitted already: flow control never holds those,
  so it never cuts one); it returns the node's URL from
  the snapshot in force *at admission* and counts the request in flight. Later snapshots
  (weight change, drain, capacity 0, removal) never touch an admitted request: it holds its own
  ``Admission``; only ``release`` ends it. When ``admit`` finds no node, ``refusal`` says why
  (``Refusal``): no snapshot for the pool, no routable untried node, or every routable untried
  node at its limit (*saturated*: a request that could wait, where the others could not).
* **One call for every policy.** The pick gets a ``PickContext`` (``scheduler.policies.base``):
  ``load``, the excluded nodes, and the request's ``Affinity`` when the policy ``uses_affinity``
  and the request has a prompt and a size. The router never asks which policy it holds.
* **Prefix affinity** (for a policy that ``uses_affinity``: la-swrr; on unless
  ``affinity="none"``): each pool keeps a
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
  ``affinity="none"``, the pick is exactly LA-SWRR's on request counts. The requests in flight
  are the pool-wide ``load``, another replica's counting ``M`` each.
* **The channel between proxies** (``share``, with a ``proxy_id``; docs/proxy.md): ``peer_message``
  is this proxy's view of a pool for the others (own in-flight and prefill backlog per node, flow
  control's held requests per band as ``note_held`` last set them, the prefix records admitted
  since the last call, at most ``peer_max_keys`` block keys), whole or as the changes since its
  last message (``schemas.peers``); while it hears no peer, only its first whole view and the
  heartbeat are due (``on_pick``: a pick is told ``peer_pick_s`` after it, with the other picks of
  that window; ``peer_due``);
  ``peer_update`` takes another proxy's: its prefix records go into this pool's index (hints),
  its in-flight replaces the snapshot's ``proxy_inflight[peer]`` in ``others`` while its
  ``ts_ns`` is after the snapshot's, and its backlog joins this proxy's in the work referee
  (``peer_backlog``), its held counts into ``peer_held``. ``expire_peers(now)`` drops a peer silent for ``peer_stale_s``: its share
  is then the snapshot's again, exactly the rule without the channel. Without ``share`` (or
  without peers) nothing of this runs and the picks are the ones above.
* **Prefill/decode pairs** (a P/D pool: nodes whose snapshot view has a ``role``, ``vllm`` or
  ``sglang``; docs/proxy.md, "Prefill/decode pairs"): the pool keeps a policy per
  role; the first ``admit`` of a request picks its prefill node (affinity, backlog and flow
  limits as above; ``Admission.role`` prefill, with the pool's protocol and the node's bootstrap
  port) and ``admit(..., role=decode)`` its decode node with the decode role's own policy (no
  affinity, never held). A ``both`` node in a P/D pool is picked by neither role. The proxy
  reports each prefill leg's time (``prefill_done``): per prefill node, a moving average of its
  rate (the prefill work it had at the pick over the leg's time), and a node measured below
  ``PREFILL_SPEED_ALIKE`` of the fastest one has its work counted as time in the prefill pick
  (``Affinity.speed``; LA-SWRR, "Prefill speed"): a silently slow prefill node, which queues
  nothing at low load and so keeps its weight, no longer gets its share of long prompts.
* **Seeds.** Each pool's policy is seeded from the proxy's seed and the pool name, so replicas
  (different proxy ids) start their SWRR/P2C sequences at different points (docs/algorithm.md
  §5, "Seeded warm-up").

No IO and no clock: callers pass ``now`` (monotonic seconds) where an age is needed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from laswrr.scheduler.policies import Candidate, PickContext, Policy, make_policy
from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE, Affinity, PrefixIndex, grid_positions
from laswrr.schemas.outputs import NodeView, WeightSnapshot
from laswrr.schemas.peers import PeerDelta, PeerMessage, PeerState, PrefixRecord, pack_keys, unpack_keys
from laswrr.schemas.words import NodeRole, PdProtocol, Phase
from laswrr.scheduler.routing.models import DEFAULT_POOL, listed
from laswrr.scheduler.routing.flow import reserved_limit
from laswrr.scheduler.routing.prompt import CHARS_PER_TOKEN, RequestSize

__all__ = ["DEFAULT_POOL", "PEER_MAX_KEYS", "PEER_STALE_S", "Admission", "PeerView", "PoolRoute", "Router",
           "others_inflight"]

PEER_STALE_S = 2.0  # a peer's message is used this long after it arrived (its heartbeat: every second)
PEER_FULL_S = 5.0  # a busy proxy's messages carry its whole view at least this often (else only changes)
PEER_MAX_KEYS = 256  # prefix block keys per peer message (a whole indexed prompt); beyond, the oldest records go
PEER_GRID = 16  # a peer is told the keys at these grid positions only (PrefixIndex, "Sparse records")
PEER_PICK_S = 0.001  # a pick is told this long after it, with every other pick of the window (peer_pick_s)
PEER_STAGGER_S = 0.010  # a proxy's rank among the replicas it hears times this: its wait before a pick (stagger_s)
PEER_STAGGER_RANKS = 3  # ranks beyond this wait as long as this one: the wait is at most 3 x PEER_STAGGER_S
PEER_STAGGER_SHARE = 0.1  # the whole wait (3 turns) at most this share of the pool's first-byte time (first_byte)
PEER_STAGGER_MIN_S = 0.0005  # a turn shorter than this is no wait at all
FIRST_BYTE_WEIGHT = 0.05  # the weight of each request's first-byte time in the moving average
# A P/D pool's prefill speeds (``prefill_done``, "Prefill/decode pairs" above)
PREFILL_RATE_WEIGHT = 0.3  # the weight of each prefill leg's rate in its node's moving average
PREFILL_RATE_MIN_TOKENS = 256  # a leg with less work than this says more about the round trip than the rate
PREFILL_RATE_DRIFT = 0.02  # each prefill pick elsewhere moves a node's rate this share back toward the fastest's
PREFILL_SPEED_ALIKE = 0.8  # a node at least this share of the fastest's rate counts as fast as it

_ALIKE: dict[str, float] = {}  # ``Affinity.speed`` of every pick but a measured P/D prefill pick (never written)
_DECODE_SEED = 0x5EED_DEC0DE  # the decode role's policy starts elsewhere than the prefill role's


class Refusal(StrEnum):
    """Why ``Router.admit`` found no node for a request (``Router.refusal``)."""

    NO_POOL = "no_pool"  # no snapshot for the pool (unknown, or forgotten)
    NO_NODE = "no_routable_node"  # no routable node that was not tried already
    SATURATED = "saturated"  # routable untried nodes exist, every one at its in-flight limit


@dataclass(slots=True, eq=False)
class Admission:
    """A request bound to one node: everything the forwarder needs, fixed at admission."""

    pool: str
    node: str
    url: str
    snapshot_seq: int
    size: RequestSize | None = None  # the request's tokens, as the proxy estimates them
    backlog: int = 0  # its uncached prompt estimate, in the node's prefill backlog until prefilled
    models: list[str] | None = None  # the model ids the node listed (NodeView.models); None: never listed
    role: NodeRole | None = None  # a P/D pool's leg: prefill (the first admission) or decode; None: whole
    protocol: PdProtocol | None = None  # a P/D pool's protocol (with ``role``)
    bootstrap_port: int | None = None  # an sglang prefill node's bootstrap server port (its registration's)
    work: int = 0  # a prefill leg's: its node's prefill backlog at the pick plus its own (``prefill_done``)


@dataclass(slots=True)
class PeerView:
    """The last message of one other proxy about one pool (``Router.peer_update``)."""

    boot_id: str
    seq: int
    ts_ns: int
    received_at: float  # the receiver's monotonic seconds
    inflight: dict[str, int]
    backlog: dict[str, int]
    held: dict[str, int]
    held_oldest_ms: dict[str, int]


@dataclass(slots=True)
class PoolRoute:
    snapshot: WeightSnapshot
    policy: Policy
    received_at: float
    targets: dict[str, NodeView] = field(default_factory=dict)
    superseded: bool = False  # from a stream that no longer exists: any next snapshot replaces it
    index: PrefixIndex | None = None  # prefix affinity (la-swrr only)
    others: dict[str, int] = field(default_factory=dict)  # node -> the other replicas' in-flight (> 0 only)
    peers: dict[str, PeerView] = field(default_factory=dict)  # proxy id -> its last message (the channel)
    outbox: list[PrefixRecord] = field(default_factory=list)  # prefix records for the next peer message
    # what this proxy's last peer message of the pool made its counts for the peers (in-flight,
    # backlog) and whether flow control held requests then; None: no message yet (``peer_message``)
    told: tuple[dict[str, int], dict[str, int], bool] | None = None
    # A P/D pool (docs/proxy.md, "Prefill/decode pairs"): its protocol;
    # ``targets``/``policy`` are the prefill role's and these the decode role's (its own LA-SWRR)
    pd_protocol: PdProtocol | None = None
    decode_policy: Policy | None = None
    decode_targets: dict[str, NodeView] = field(default_factory=dict)

    def install(self, snapshot: WeightSnapshot, now: float, proxy_id: str | None = None) -> None:
        self.snapshot, self.received_at, self.superseded = snapshot, now, False
        self.others = self.merged_others(proxy_id)
        live = [n for n in snapshot.nodes if n.routable and n.effective_weight > 0]
        self.pd_protocol = pd_protocol_of(snapshot)
        if self.pd_protocol is None:
            self.targets = {n.node: n for n in live}
        else:  # the first pick is the prefill leg's
            self.targets = {n.node: n for n in live if n.role == NodeRole.PREFILL}
            self.decode_targets = {n.node: n for n in live if n.role == NodeRole.DECODE}
        if self.pd_protocol is None:
            self.decode_targets = {}
        if self.decode_policy is not None:
            self.decode_policy.set_candidates([Candidate.from_weight(n.node, n.effective_weight)
                                               for n in self.decode_targets.values()])
        self.policy.set_candidates([Candidate.from_weight(n.node, n.effective_weight) for n in self.targets.values()])
        if self.index is not None:
            kept = {n.node for n in snapshot.nodes if n.phase != Phase.EJECTED}
            for node in self.index.nodes():
                if node not in kept:
                    self.index.drop(node)

    def merged_others(self, proxy_id: str | None) -> dict[str, int]:
        """The other replicas' in-flight per node: the snapshot's (``others_inflight``), where a
        peer's message is newer than the snapshot's view of it, that peer's own count instead."""
        others = others_inflight(self.snapshot, proxy_id)
        if not self.peers:
            return others
        seen_by = self.snapshot.proxy_inflight
        for proxy, view in self.peers.items():
            if view.ts_ns <= self.snapshot.ts_ns:
                continue  # the snapshot knows this peer as well or better
            seen = seen_by.get(proxy, {})
            for node in seen.keys() | view.inflight.keys():
                delta = view.inflight.get(node, 0) - seen.get(node, 0)
                if delta:
                    others[node] = others.get(node, 0) + delta
        return {node: count for node, count in others.items() if count > 0}


def pd_protocol_of(snapshot: WeightSnapshot) -> PdProtocol | None:
    """The pool's P/D protocol: the one its prefill and decode nodes name (the scheduler holds a
    pool to one); None for a pool without such nodes."""
    for view in snapshot.nodes:
        if isinstance(view.role, NodeRole) and view.role != NodeRole.BOTH and isinstance(view.pd_protocol, PdProtocol):
            return view.pd_protocol
    return None


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
                 proxy_id: str | None = None, flow_limits: bool = False, share: bool = False,
                 peer_stale_s: float = PEER_STALE_S, peer_max_keys: int = PEER_MAX_KEYS, peer_full_s: float = PEER_FULL_S,
                 peer_grid: int = PEER_GRID, peer_stagger_s: float = PEER_STAGGER_S,
                 peer_pick_s: float = PEER_PICK_S) -> None:
        uses_affinity = make_policy(policy, seed).uses_affinity  # and fail fast on an unknown name
        self.proxy_id = proxy_id  # whose share of the snapshot's in-flight is this proxy's own
        self.policy_name = policy
        self.seed = seed
        self.cap_factor = inflight_cap_per_capacity
        self.flow_limits = flow_limits  # flow control: a node at its snapshot's concurrency_limit takes nothing
        self.affinity_blocks = affinity_blocks if affinity == "prefix" and uses_affinity else 0
        self.affinity_mode = "prefix" if self.affinity_blocks else "none"
        self.pools: dict[str, PoolRoute] = {}
        self.views = 0  # counts the snapshots installed and the pools forgotten: what a cache of plans keys on
        self.inflight: dict[str, int] = {}  # node -> this proxy's own live in-flight (> 0 only)
        self.load: dict[str, int] = {}  # node -> others + own: what the policy picks on (> 0 only)
        self.backlog: dict[str, int] = {}  # node -> prefill backlog (tokens) of its admitted requests
        self.sized = 0  # sized requests admitted, and their prompt tokens: the mean prompt M
        self.sized_prompt_tokens = 0
        self.total_inflight = 0
        # the channel between proxies (``peer_update``, ``peer_message``): off, nothing changes
        self.share = share and proxy_id is not None
        self.peer_stale_s = peer_stale_s
        self.peer_full_s = peer_full_s
        self.peer_max_keys = peer_max_keys
        self.peer_grid = peer_grid  # 0: every key of a record is sent (no sparse records)
        self.peer_stagger_s = peer_stagger_s  # 0: no proxy waits before its picks (``stagger_s``)
        # the IO side tells the picks this long after the first of them, all in one message (the
        # picks of a burst, and at most one pick message per window at any rate); 0: each
        # event-loop turn's picks at once
        self.peer_pick_s = peer_pick_s
        self.first_byte_s: float | None = None  # moving average of the requests' first-byte times (``first_byte``)
        self.peer_backlog: dict[str, int] = {}  # node -> the fresh peers' prefill backlogs, summed (> 0 only)
        self.changed: set[str] = set()  # pools whose own counts or records changed since their last message
        # pool -> (band -> requests flow control holds that any node may take, band -> oldest age ms): ``note_held``
        self.held: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        # the IO side's hook, called with the pool after each admission while sharing: a pick is
        # told to the peers within ``peer_pick_s`` (a release or a first byte waits for the interval)
        self.on_pick: Callable[[str], None] | None = None
        self.prefill_rate: dict[str, float] = {}  # node -> a P/D prefill node's measured tokens/s (``prefill_done``)

    # -- snapshots ----------------------------------------------------------------------------

    def offer(self, snapshot: WeightSnapshot, now: float) -> bool:
        """Install ``snapshot`` if it is newer than the pool's current one (or that one is superseded); True if installed."""
        route = self.pools.get(snapshot.pool)
        if route is None:
            seed = (self.seed ^ zlib.crc32(snapshot.pool.encode())) & ((1 << 64) - 1)
            index = PrefixIndex(blocks_per_node=self.affinity_blocks) if self.affinity_blocks else None
            route = PoolRoute(snapshot=snapshot, policy=make_policy(self.policy_name, seed), received_at=now,
                              index=index, decode_policy=make_policy(self.policy_name, seed ^ _DECODE_SEED))
            self.pools[snapshot.pool] = route
        elif snapshot.as_of_seq <= route.snapshot.as_of_seq and not route.superseded:
            return False
        before = route.others
        route.install(snapshot, now, self.proxy_id)
        self.views += 1
        if before or route.others:
            self._reload(before.keys() | route.others.keys())
        return True

    def applied_seq(self) -> int | None:
        """The newest ``as_of_seq`` this router routes on, any pool of the current stream (the
        heartbeat's ``snapshot_seq``: a drain waits until it reaches the drain's seq); None: none yet."""
        return max((route.snapshot.as_of_seq for route in self.pools.values() if not route.superseded), default=None)

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
        self.views += 1
        if route is not None and route.others:
            self._reload(route.others)
        if route is not None and route.peers:
            self._sum_peer_backlog()

    def routable_urls(self) -> list[tuple[str, str]]:
        """(pool, url) of every candidate node, for /v1/models."""
        return [(pool, n.url) for pool, route in self.pools.items() for n in route.targets.values()]

    # -- admission ----------------------------------------------------------------------------

    def admit(self, pool: str, tried: Iterable[str] = (), prompt: bytes = b"",
              size: RequestSize | None = None, limited: bool | None = None, reserve: float = 0.0,
              role: NodeRole | None = None) -> Admission | None:
        """Pick a node for a request (``prompt``: its text, for affinity; ``size``: its tokens).
        ``limited``: whether flow control's slot limits apply (default: for a request with nothing
        ``tried``, i.e. not a retry or a continuation); ``reserve``: the share of each limit kept
        for more urgent requests (``scheduler.routing.flow``, the interactive reserve). In a
        P/D pool this is the prefill leg's node (with affinity), and with ``role`` decode
        the decode leg's (its role's own policy, no affinity, never held by flow control: its
        request was admitted already)."""
        route = self.pools.get(pool)
        decode = role == NodeRole.DECODE
        if route is None:
            return None
        targets = route.decode_targets if decode else route.targets
        policy = route.decode_policy if decode else route.policy
        if not targets or policy is None:
            return None
        exclude = set(tried)
        # a retry or continuation of an admitted request is never held, nor a P/D pair's decode leg
        flow = self.flow_limits and not decode and (not exclude if limited is None else limited)
        if self.cap_factor is not None or flow:
            exclude.update(n for n, view in targets.items() if self.at_limit(view, flow, reserve))
        index = None if decode else route.index  # only for a policy that uses affinity (``offer``)
        affinity = None
        keys: list[int] = []
        if index is not None and prompt and size is not None:
            keys = index.keys(prompt)
            eligible = [n for n in targets if n not in exclude]
            speed = self._speeds(eligible) if self.prefill_rate and route.pd_protocol is not None and not decode \
                else _ALIKE
            affinity = self._work(index, keys, size, eligible, speed)
        node = policy.pick(PickContext(self.load, exclude, affinity))
        if node is None:
            return None
        backlog = 0
        if index is not None and affinity is not None:
            # the peers are told only the blocks this index did not hold on the node yet (they
            # heard of the others as this proxy did: its own records, or a peer's, sent to all),
            # and of those only the keys at the grid positions (PrefixIndex, "Sparse records")
            held = index.depths(keys, (node,))[node] if self.share and keys else 0
            index.record(node, keys)
            backlog = affinity.cost_on(node) - affinity.mean  # its uncached prompt there
            if self.share and len(keys) > held:
                told = ([keys[p] for p in grid_positions(len(keys), self.peer_grid) if p >= held] if self.peer_grid
                        else keys[held:])
                if told:
                    route.outbox.append(PrefixRecord(node, pack_keys(told)))
                if len(route.outbox) > self.peer_max_keys:  # never sent (NATS away): bounded all the same
                    del route.outbox[0]
        self.inflight[node] = self.inflight.get(node, 0) + 1
        self.load[node] = self.load.get(node, 0) + 1
        view = targets[node]
        if route.pd_protocol is None:  # a whole request (built positionally: once per request)
            admission = Admission(pool, node, view.url, route.snapshot.as_of_seq, size, backlog, listed(view))
        else:
            admission = Admission(pool, node, view.url, route.snapshot.as_of_seq, size, backlog, listed(view),
                                  NodeRole.DECODE if decode else NodeRole.PREFILL, route.pd_protocol,
                                  view.bootstrap_port if isinstance(view.bootstrap_port, int) else None)
            if not decode and affinity is not None:
                admission.work = affinity.backlog.get(node, 0) + backlog
                if self.prefill_rate:
                    self._drift(node, targets)
        if backlog:
            self.backlog[node] = self.backlog.get(node, 0) + backlog
        self.total_inflight += 1
        if self.share:
            self.changed.add(pool)
            if self.on_pick is not None and (route.peers or route.told is None):
                self.on_pick(pool)  # a proxy that hears no peer tells nobody, past its first whole view
        return admission

    def refusal(self, pool: str, tried: Iterable[str] = (), role: NodeRole | None = None) -> Refusal:
        """Why ``admit(pool, tried)`` returned None, as of now (call it right after)."""
        route = self.pools.get(pool)
        if route is None:
            return Refusal.NO_POOL
        done = set(tried)
        decode = role == NodeRole.DECODE
        targets = route.decode_targets if decode else route.targets
        untried = [view for node, view in targets.items() if node not in done]
        flow = self.flow_limits and not done and not decode
        if untried and all(self.at_limit(view, flow) for view in untried):
            return Refusal.SATURATED
        return Refusal.NO_NODE

    @property
    def mean_prompt(self) -> int:
        return self.sized_prompt_tokens // self.sized if self.sized else 0

    def _work(self, index: PrefixIndex, keys: list[int], size: RequestSize, eligible: list[str],
              speed: dict[str, float]) -> Affinity:
        """The request's cost on each eligible node and each node's load (see the module docstring)."""
        self.sized += 1
        self.sized_prompt_tokens += size.prompt_tokens
        mean = self.mean_prompt
        preferred, depth, floor = index.match(keys, eligible)
        block = index.block_chars // CHARS_PER_TOKEN
        prompt = size.prompt_tokens
        costs = {n: max(0, prompt - d * block) + mean for n, d in depth.items()}
        backlog = self.backlog
        if self.peer_backlog:
            backlog = dict(self.peer_backlog)
            for node, tokens in self.backlog.items():
                backlog[node] = backlog.get(node, 0) + tokens
        return Affinity(preferred, backlog, max(0, prompt - floor * block) + mean, costs, self.load, mean, speed)

    def _speeds(self, eligible: list[str]) -> dict[str, float]:
        """The eligible prefill nodes' speeds relative to the fastest measured one (``Affinity.speed``):
        only the nodes below ``PREFILL_SPEED_ALIKE`` of it (empty: all alike, the pick as without).
        A node never measured counts as fast: its first legs measure it."""
        rates = [self.prefill_rate[n] for n in eligible if n in self.prefill_rate]
        fastest = max(rates, default=0.0)
        if not fastest:
            return {}
        return {n: rate / fastest for n in eligible
                if (rate := self.prefill_rate.get(n, fastest)) < PREFILL_SPEED_ALIKE * fastest}

    def _drift(self, picked: str, targets: dict[str, NodeView]) -> None:
        """After a prefill pick, every other measured node's rate moves ``PREFILL_RATE_DRIFT`` back
        toward the fastest's: a node that gets no legs because it measured slow is tried again
        in time, and measured afresh (an engine that recovered is not avoided forever)."""
        rates = self.prefill_rate
        fastest = max((rates[n] for n in targets if n in rates), default=0.0)
        for node in targets:
            rate = rates.get(node)
            if rate is not None and node != picked and rate < fastest:
                rates[node] = rate + PREFILL_RATE_DRIFT * (fastest - rate)

    def prefill_done(self, admission: Admission, seconds: float) -> None:
        """A P/D pair's prefill leg answered ``seconds`` after it was sent: its node's rate, the
        prefill work it had at the pick (``Admission.work``: its backlog and this leg's uncached
        prompt) over that time, joins the node's moving average (``prefill_rate``). Legs with
        less work than ``PREFILL_RATE_MIN_TOKENS`` say nothing (the round trip dominates)."""
        if admission.role != NodeRole.PREFILL or admission.work < PREFILL_RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = admission.work / seconds
        mean = self.prefill_rate.get(admission.node)
        self.prefill_rate[admission.node] = rate if mean is None else mean + PREFILL_RATE_WEIGHT * (rate - mean)

    def prefilled(self, admission: Admission) -> None:
        """The engine sent the admission's first byte: its prompt has left the node's prefill backlog."""
        if admission.backlog:
            left = self.backlog[admission.node] - admission.backlog
            if left:
                self.backlog[admission.node] = left
            else:
                del self.backlog[admission.node]
            admission.backlog = 0
            if self.share:
                self.changed.add(admission.pool)

    def at_limit(self, view: NodeView, flow: bool = True, reserve: float = 0.0) -> bool:
        """The node can take no request now: at ``--inflight-cap-per-capacity``'s cap, or, with
        flow control (``flow``: a new request, not a retry), at the slot limit the snapshot
        publishes (``NodeView.concurrency_limit``, 0: none), both on the pool-wide estimate ``load``."""
        if self.cap_factor is not None and self.at_cap(view):
            return True
        if not (flow and self.flow_limits and view.concurrency_limit > 0):
            return False
        return reserved_limit(view.concurrency_limit, reserve) <= self.load.get(view.node, 0)

    def can_take(self, pool: str, exclude: Container[str] = (), reserve: float = 0.0) -> bool:
        """Some routable node of ``pool`` not in ``exclude`` is under its limits (less ``reserve``):
        a held request may be dispatched."""
        route = self.pools.get(pool)
        return route is not None and any(not self.at_limit(view, True, reserve) for node, view in route.targets.items()
                                         if node not in exclude)

    def free_slots(self, pool: str, reserve: float = 0.0) -> int | None:
        """The pool's free slots: the sum over its routable nodes of their slot limit (less
        ``reserve``: ``flow.reserved_limit``) less the pool-wide ``load`` (none below 0); None when
        some node publishes no limit (unlimited)."""
        route = self.pools.get(pool)
        if route is None:
            return 0
        free = 0
        for node, view in route.targets.items():
            if view.concurrency_limit <= 0:
                return None
            free += max(0, reserved_limit(view.concurrency_limit, reserve) - self.load.get(node, 0))
        return free

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
        if self.share:
            self.changed.add(admission.pool)

    # -- the channel between proxies ------------------------------------------------------------

    def peer_message(self, pool: str, boot_id: str, seq: int, ts_ns: int,
                     full: bool = False) -> PeerMessage | None:
        """This proxy's view of ``pool`` for the other proxies (None: no such pool), with the
        prefix records added since the last call, newest kept within ``peer_max_keys`` block
        keys: a ``PeerDelta`` of its own in-flight and prefill backlog per node since its last
        message, or the whole view (``PeerState``) when ``full`` (the heartbeat), for its first
        message, and while flow control holds requests (their ages move without a change). A
        heartbeat while no peer is heard carries no records (they are dropped: nobody listens)."""
        route = self.pools.get(pool)
        self.changed.discard(pool)
        if route is None:
            return None
        nodes = {view.node for view in route.snapshot.nodes}
        records: list[PrefixRecord] = []
        room = 0 if full and not route.peers else self.peer_max_keys  # a heartbeat to nobody: no records
        for record in reversed(route.outbox):
            if room <= 0:
                break
            count = min(record.count, room)  # the leading blocks matter most
            records.append(record if count == record.count else PrefixRecord(record.node, record.keys[:4 * count]))
            room -= count
        route.outbox.clear()
        records.reverse()
        held, oldest = self.held.get(pool, ({}, {}))
        inflight = {n: c for n, c in self.inflight.items() if n in nodes}
        backlog = {n: t for n, t in self.backlog.items() if n in nodes}
        told, route.told = route.told, (inflight, backlog, bool(held))
        if full or told is None or held or told[2]:
            return PeerState(boot_id=boot_id, seq=seq, ts_ns=ts_ns, inflight=inflight, backlog=backlog,
                             held=dict(held), held_oldest_ms=dict(oldest), prefixes=records)
        return PeerDelta(seq=seq, ts_ns=ts_ns, inflight=_changes(told[0], inflight), backlog=_changes(told[1], backlog),
                         prefixes=records)

    def note_held(self, pool: str, held: dict[str, int], oldest_ms: dict[str, int]) -> None:
        """Flow control's held requests of ``pool`` per band (> 0 only) and the oldest one's age,
        for the next peer message; a changed count makes the pool ``changed`` (sent within one
        interval)."""
        before = self.held.get(pool)
        if held:
            self.held[pool] = (held, oldest_ms)
        else:
            self.held.pop(pool, None)
        if self.share and (before[0] if before is not None else {}) != held:
            self.changed.add(pool)

    def peer_due(self, pool: str, since_s: float) -> bool:
        """The pool's message is due at an interval: its counts changed since the last one (a first
        byte, a release, flow control's held counts) and some peer is heard (a proxy alone tells
        nobody), or the heartbeat (``since_s``, seconds since the pool's last message, reached half
        ``peer_stale_s``). A pick is told within ``peer_pick_s`` instead (``on_pick``)."""
        if since_s >= self.peer_stale_s / 2:
            return True
        route = self.pools.get(pool)
        return pool in self.changed and route is not None and bool(route.peers)

    def full_due(self, since_s: float, since_full_s: float) -> bool:
        """The next message is a whole view: the heartbeat (``since_s``, as ``peer_due``), or the
        last whole view (``since_full_s`` ago) is ``peer_full_s`` old. A receiver that missed a
        message is whole again by then."""
        return since_s >= self.peer_stale_s / 2 or since_full_s >= self.peer_full_s

    def peer_update(self, proxy: str, pool: str, message: PeerMessage, now: float) -> bool:
        """Take another proxy's message about ``pool`` (``now``: monotonic seconds); False when
        ignored (this proxy's own, an unknown pool, a state not newer than the one held from the
        same boot, a delta that does not follow the message held)."""
        route = self.pools.get(pool)
        if route is None or proxy == self.proxy_id or not proxy:
            return False
        held = route.peers.get(proxy)
        if isinstance(message, PeerDelta):
            if held is None or message.seq != held.seq + 1:
                return False  # a message was missed: wait for the next whole view
            held.seq, held.ts_ns, held.received_at = message.seq, message.ts_ns, now
            _apply(held.inflight, message.inflight)
            _apply(held.backlog, message.backlog)
        else:
            if held is not None and held.boot_id == message.boot_id and message.seq <= held.seq:
                return False
            if self.share and (held is None or held.boot_id != message.boot_id):
                # a peer new to this proxy (started, restarted, or back after a silence) has not
                # heard its whole view: the next message, within one interval, carries it
                route.told = None
                self.changed.add(pool)
            route.peers[proxy] = PeerView(message.boot_id, message.seq, message.ts_ns, now, dict(message.inflight),
                                          dict(message.backlog), dict(message.held), dict(message.held_oldest_ms))
        index = route.index
        if index is not None and message.prefixes:
            kept = {view.node for view in route.snapshot.nodes if view.phase != Phase.EJECTED}
            if self.peer_grid:
                index.grid = self.peer_grid  # sparse records from now on: match looks at the grid too
            for record in message.prefixes:
                if record.node in kept and record.keys and len(record.keys) % 4 == 0:  # else a hint lost
                    index.record(record.node, unpack_keys(record.keys)[:index.max_prompt_blocks])
        self._repeer(route)
        return True

    def stagger_s(self, pool: str) -> float:
        """How long this proxy waits before a request's pick in ``pool``: its rank among itself and
        the peers it hears there (by proxy id), times ``peer_stagger_s``. The replicas that take
        one burst of requests between them then pick in turn, each after the picks of those ranked
        before it have reached it (docs/proxy.md, "Bursts across replicas"), as one proxy picks a
        burst one request after the other. Ranks past ``PEER_STAGGER_RANKS`` wait as long as that
        one (the wait stays bounded with many replicas), and a turn is shortened so that the
        longest wait is at most ``PEER_STAGGER_SHARE`` of the requests' first-byte time
        (``first_byte``): requests answered in a few ms are not held 10 ms. 0 for the first in
        rank, alone, without the channel, or when a turn would be under ``PEER_STAGGER_MIN_S``."""
        if not self.share or not self.peer_stagger_s:
            return 0.0
        route = self.pools.get(pool)
        if route is None or not route.peers:
            return 0.0
        me = self.proxy_id
        assert me is not None  # sharing needs a proxy id
        turn = self.peer_stagger_s
        if self.first_byte_s is not None:
            turn = min(turn, PEER_STAGGER_SHARE * self.first_byte_s / PEER_STAGGER_RANKS)
        if turn < PEER_STAGGER_MIN_S:
            return 0.0
        return min(PEER_STAGGER_RANKS, sum(proxy < me for proxy in route.peers)) * turn

    def first_byte(self, seconds: float) -> None:
        """A request's first byte came ``seconds`` after it arrived: the moving average that
        bounds ``stagger_s``."""
        if seconds < 0:
            return
        mean = self.first_byte_s
        self.first_byte_s = seconds if mean is None else mean + FIRST_BYTE_WEIGHT * (seconds - mean)

    def expire_peers(self, now: float) -> int:
        """Drop every peer whose last message is older than ``peer_stale_s``; how many went.
        Without a peer the pool routes on the snapshot's counts: exactly the rule without the channel."""
        gone = 0
        for route in self.pools.values():
            stale = [p for p, view in route.peers.items() if now - view.received_at > self.peer_stale_s]
            for proxy in stale:
                del route.peers[proxy]
            if stale:
                gone += len(stale)
                self._repeer(route)
        return gone

    def peer_held(self, pool: str) -> dict[str, int]:
        """Per band, the requests the fresh peers' flow control holds for ``pool`` (summed): the
        ones any node of the pool may take (``scheduler.routing.flow.defer_to_peers``)."""
        held: dict[str, int] = {}
        route = self.pools.get(pool)
        for view in route.peers.values() if route is not None else ():
            for band, count in view.held.items():
                held[band] = held.get(band, 0) + count
        return held

    def _repeer(self, route: PoolRoute) -> None:
        """``others`` and ``peer_backlog`` again after a pool's peers changed."""
        before = route.others
        route.others = route.merged_others(self.proxy_id)
        if before or route.others:
            self._reload(before.keys() | route.others.keys())
        self._sum_peer_backlog()

    def _sum_peer_backlog(self) -> None:
        backlog: dict[str, int] = {}
        for pool_route in self.pools.values():
            for view in pool_route.peers.values():
                for node, tokens in view.backlog.items():
                    if tokens > 0:
                        backlog[node] = backlog.get(node, 0) + tokens
        self.peer_backlog = backlog


def _changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per key, ``after`` less ``before`` (!= 0 only; a missing key counts 0)."""
    changes = {key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key, 0)}
    for key, value in before.items():
        if key not in after:
            changes[key] = -value
    return changes


def _apply(counts: dict[str, int], changes: dict[str, int]) -> None:
    """``counts`` plus ``changes``, keeping positive counts only."""
    for key, change in changes.items():
        value = counts.get(key, 0) + change
        if value > 0:
            counts[key] = value
        else:
            counts.pop(key, None)
