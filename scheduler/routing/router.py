"""The proxy's routing core, assembled: a routing table, an admitter and, when the proxies share
their views, the channel between them.

* ``table`` (``scheduler.routing.table.RoutingTable``): the newest snapshot of each pool (newest
  wins within one LB_WEIGHTS stream), one picker per node role per pool
  (``scheduler.routing.route``), the live counts the picks weigh (``scheduler.routing.load``).
* ``admitter`` (``scheduler.routing.admission.Admitter``): ``admit(AdmitRequest)`` ->
  ``Admission | Refusal``, ``release``, ``prefilled``, and flow control's questions.
* ``channel`` (``scheduler.routing.peers.PeerChannel``; None without ``share`` or a proxy id):
  takes the other proxies' messages and says what to send them.
* **Latency objectives** (``scheduler.routing.latency``): with a ``LatencyModel``, a request's
  ``AdmitRequest.objective`` removes the nodes predicted to miss it before the pick;
  ``Admitter.observed`` teaches the model each finished request's figures.
* **Affinity** is a scorer handed to the table (``scheduler.routing.work.PrefixScorer``), kept
  only for a policy that ``uses_affinity`` (la-swrr); ``scorer_for`` reads the ``--affinity``
  word.

Nothing here calls the shell back: the shell asks (``services/proxy/bus.py`` drains the
channel's outboxes). No IO and no clock: callers pass ``now`` (monotonic seconds).
"""

from __future__ import annotations

from laswrr.scheduler.policies import make_policy
from laswrr.scheduler.policies.affinity import BLOCKS_PER_NODE
from laswrr.scheduler.routing.admission import Admission, Admitter, AdmitRequest, Refusal
from laswrr.scheduler.routing.latency import LatencyModel
from laswrr.scheduler.routing.models import DEFAULT_POOL
from laswrr.scheduler.routing.peers import (PEER_FULL_S, PEER_GRID, PEER_MAX_KEYS, PEER_PICK_S, PEER_STAGGER_S,
                                            PEER_STALE_S, PeerChannel)
from laswrr.scheduler.routing.route import PoolRoute, others_inflight
from laswrr.scheduler.routing.table import Offered, RoutingTable
from laswrr.scheduler.routing.work import PrefixScorer

__all__ = ["DEFAULT_POOL", "PEER_MAX_KEYS", "PEER_PICK_S", "PEER_STAGGER_S", "PEER_STALE_S", "AFFINITY_MODES",
           "AdmitRequest", "Admission", "Offered", "PoolRoute", "Refusal", "Router", "others_inflight", "scorer_for"]

AFFINITY_MODES = ("prefix", "none")


def scorer_for(mode: str, blocks_per_node: int = BLOCKS_PER_NODE) -> PrefixScorer | None:
    """The scorer of an ``--affinity`` word: ``prefix`` or ``none``."""
    if mode not in AFFINITY_MODES:
        raise ValueError(f"affinity must be one of {', '.join(AFFINITY_MODES)} (got {mode!r})")
    return PrefixScorer(blocks_per_node) if mode == "prefix" else None


class Router:
    """The parts of the routing core, built together from the proxy's settings."""

    def __init__(self, policy: str, seed: int, inflight_cap_per_capacity: float | None = None,
                 scorer: PrefixScorer | type[PrefixScorer] | None = PrefixScorer, proxy_id: str | None = None, flow_limits: bool = False,
                 share: bool = False, peer_stale_s: float = PEER_STALE_S, peer_max_keys: int = PEER_MAX_KEYS,
                 peer_full_s: float = PEER_FULL_S, peer_grid: int = PEER_GRID, peer_stagger_s: float = PEER_STAGGER_S,
                 peer_pick_s: float = PEER_PICK_S, latency: LatencyModel | None = None,
                 serve_late: bool = False, kv_in_flight: bool = False) -> None:
        if isinstance(scorer, type):
            scorer = scorer()  # the default: prefix affinity with its default index size
        if scorer is not None and not make_policy(policy, seed).uses_affinity:
            scorer = None  # a policy that reads no affinity keeps no prefix index
        self.table = RoutingTable(policy, seed, proxy_id, scorer, kv_in_flight)
        self.channel = PeerChannel(self.table, peer_stale_s, peer_max_keys, peer_full_s, peer_grid, peer_stagger_s,
                                   peer_pick_s) if share and proxy_id is not None else None
        self.admitter = Admitter(self.table, inflight_cap_per_capacity, flow_limits, self.channel, latency, serve_late)

    @property
    def affinity_mode(self) -> str:
        """The ``--affinity`` word in force (/status): ``none`` for a policy that reads no affinity."""
        return "none" if self.table.scorer is None else self.table.scorer.mode

    def stagger_s(self, pool: str) -> float:
        """How long to wait before a pick in ``pool`` (``PeerChannel.stagger_s``; 0 without the channel)."""
        return 0.0 if self.channel is None else self.channel.stagger_s(pool)

    def first_byte(self, seconds: float) -> None:
        """A request's first byte came ``seconds`` after it arrived (``PeerChannel.first_byte``)."""
        if self.channel is not None:
            self.channel.first_byte(seconds)
