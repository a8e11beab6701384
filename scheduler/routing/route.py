"""One pool's route: its newest snapshot and one picker per node role.

* **Candidates.** A node is a candidate iff the snapshot marks it ``routable`` and its
  ``effective_weight`` > 0 (the core already folded phase and the panic rail into ``routable``).
  Each new snapshot goes to each picker's policy with ``set_candidates``; policy state (SWRR
  accumulators) carries across snapshots.
* **One picker per role.** A pool of whole nodes has one role that takes requests, ``whole``
  (``Picker.role`` None). A P/D pool (nodes whose snapshot view has a ``role``, ``vllm`` or
  ``sglang``; docs/proxy.md, "Prefill/decode pairs") has two: ``prefill`` (the
  first admission of a request: prefix affinity, prefill speeds, flow control's limits) and
  ``decode`` (its own policy, no affinity, never held: its request was admitted already). A
  ``both`` node in a P/D pool is picked by neither role. What differs between roles is data of
  the picker (``index``, ``speeds``, ``limited``), never a branch of the admission.
* **The other replicas' in-flight** (``others``): the snapshot's count less this proxy's own
  share of it (``others_inflight``), where a peer's message is newer than the snapshot's view of
  it, that peer's own count instead (``merged_others``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from laswrr.scheduler.policies import Candidate, Policy
from laswrr.scheduler.policies.affinity import PrefixIndex
from laswrr.scheduler.routing.work import PrefillSpeeds
from laswrr.schemas.outputs import NodeView, WeightSnapshot
from laswrr.schemas.peers import PrefixRecord
from laswrr.schemas.words import Band, NodeRole, PdProtocol, Phase


@dataclass(slots=True)
class PeerView:
    """The last message of one other proxy about one pool (``PeerChannel.receive``)."""

    boot_id: str
    seq: int
    ts_ns: int
    received_at: float  # the receiver's monotonic seconds
    inflight: dict[str, int]
    backlog: dict[str, int]
    held: dict[Band, int]
    held_oldest_ms: dict[Band, int]


@dataclass(slots=True)
class Picker:
    """The candidates of one node role of a pool and the policy that picks among them."""

    policy: Policy
    role: NodeRole | None = None  # the admissions' role: None a whole request
    targets: dict[str, NodeView] = field(default_factory=dict)
    index: PrefixIndex | None = None  # prefix affinity's index for this role (None: no affinity)
    speeds: PrefillSpeeds | None = None  # measured prefill rates (a P/D pool's prefill role)
    limited: bool = True  # flow control's slot limits may hold a new request of this role

    def install(self, role: NodeRole | None, views: Iterable[NodeView], speeds: PrefillSpeeds | None) -> None:
        self.role, self.speeds = role, speeds
        self.targets = {n.node: n for n in views}
        self.policy.set_candidates([Candidate.from_weight(n.node, n.effective_weight) for n in self.targets.values()])


@dataclass(slots=True)
class PoolRoute:
    snapshot: WeightSnapshot
    first: Picker  # a request's first admission: whole, or a P/D pool's prefill leg
    decode: Picker  # a P/D pool's decode leg (no candidates in a pool of whole nodes)
    received_at: float
    superseded: bool = False  # from a stream that no longer exists: any next snapshot replaces it
    others: dict[str, int] = field(default_factory=dict)  # node -> the other replicas' in-flight (> 0 only)
    pd_protocol: PdProtocol | None = None  # a P/D pool's protocol
    # the channel between proxies (scheduler.routing.peers): proxy id -> its last message, the
    # prefix records for the next message, and what this proxy's last message made its counts for
    # the peers (in-flight, backlog, whether flow control held requests); None: no message yet
    peers: dict[str, PeerView] = field(default_factory=dict)
    outbox: list[PrefixRecord] = field(default_factory=list)
    told: tuple[dict[str, int], dict[str, int], bool] | None = None

    def picker(self, role: NodeRole | None) -> Picker:
        """The picker of a leg: ``decode`` for a P/D pair's decode leg, else the first admission's."""
        if role is None:  # a whole request, or a pair's first leg (no enum member read: a lookup on Python 3.11)
            return self.first
        return self.decode if role is NodeRole.DECODE else self.first

    @property
    def index(self) -> PrefixIndex | None:
        return self.first.index

    def candidates(self) -> set[str]:
        """Every node some role of the pool may pick."""
        return self.first.targets.keys() | self.decode.targets.keys()

    def install(self, snapshot: WeightSnapshot, now: float, proxy_id: str | None, speeds: PrefillSpeeds) -> None:
        self.snapshot, self.received_at, self.superseded = snapshot, now, False
        self.others = self.merged_others(proxy_id)
        live = [n for n in snapshot.nodes if n.routable and n.effective_weight > 0]
        self.pd_protocol = pd_protocol_of(snapshot)
        if self.pd_protocol is None:
            self.decode.install(NodeRole.DECODE, (), None)
            self.first.install(None, live, None)
        else:
            self.decode.install(NodeRole.DECODE, (n for n in live if n.role == NodeRole.DECODE), None)
            self.first.install(NodeRole.PREFILL, (n for n in live if n.role == NodeRole.PREFILL), speeds)
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
    """Per node, the requests other proxies have open on it as of the snapshot; only the nodes
    with some. Empty when the snapshot carries no ``proxy_inflight``, or without a ``proxy_id``
    (a router that does not know which share is its own cannot subtract it)."""
    if not snapshot.proxy_inflight or proxy_id is None:
        return {}
    mine = snapshot.proxy_inflight.get(proxy_id, {})
    others = {}
    for view in snapshot.nodes:
        count = view.inflight - mine.get(view.node, 0)
        if count > 0:
            others[view.node] = count
    return others
