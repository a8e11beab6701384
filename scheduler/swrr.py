"""nginx smooth weighted round robin over integer weights (ngx_http_upstream_get_peer).

One pass:  for each eligible node: cw += w; total += w
           best = the node with the greatest cw (ties: earliest in list order)
           best.cw -= total
so Σ cw = 0 after every pass. Weights 5,1,1 give the period a a b a c a a (nginx commit
52327e062), and with fixed integer weights the state is all zeros again after W = Σw picks.

Weight changes keep the accumulators (``set_weights``): a node that stays eligible keeps its
cw; a new node starts at exactly 0; a node that leaves or drops to weight 0 is re-centred to 0
and the credit or debt it held is spread over the nodes that stay (docs/algorithm.md §5, "Re-centring"),
so the sum is still exactly 0 and a node coming back never bursts on stale credit. Integer
arithmetic throughout; the remainder of the spread goes to the earliest nodes.

State is kept in parallel lists indexed by position (the hot path of a proxy's pick); ``add_step``
does the add step, finds the leader and hands back the eligible positions, for LA-SWRR's referee.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


class Swrr:
    __slots__ = ("nodes", "weights", "cw", "index", "active", "total")

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.weights: list[int] = []
        self.cw: list[int] = []
        self.index: dict[str, int] = {}
        self.active: list[int] = []  # positions with weight > 0
        self.total = 0  # Σ weights over ``active``

    @property
    def current(self) -> dict[str, int]:
        """The accumulators by node (a copy, for inspection)."""
        return dict(zip(self.nodes, self.cw))

    def set_weights(self, weights: Sequence[tuple[str, int]]) -> None:
        old_cw = dict(zip(self.nodes, self.cw))
        old_weight = dict(zip(self.nodes, self.weights))
        self.nodes = [node for node, _ in weights]
        self.weights = [max(0, weight) for _, weight in weights]
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.active = [i for i, weight in enumerate(self.weights) if weight > 0]
        self.total = sum(self.weights[i] for i in self.active)
        self.cw = [0] * len(self.nodes)
        kept = [i for i in self.active if old_weight.get(self.nodes[i], 0) > 0]
        for i in kept:
            self.cw[i] = old_cw[self.nodes[i]]
        self._recentre(kept)

    def _recentre(self, kept: list[int]) -> None:
        """Spread the departed nodes' cw over ``kept`` so that Σ cw = 0 again."""
        surplus = sum(self.cw[i] for i in kept)
        if surplus == 0 or not kept:
            return
        share, remainder = divmod(surplus, len(kept))
        for rank, i in enumerate(kept):
            self.cw[i] -= share + (1 if rank < remainder else 0)

    def add_step(self, exclude: Container[str] = ()) -> tuple[int, int, list[int]]:
        """The add step over the eligible nodes: (leader or -1, total, eligible positions)."""
        cw, weights = self.cw, self.weights
        if exclude:
            nodes = self.nodes
            active = [i for i in self.active if nodes[i] not in exclude]
            total = sum(weights[i] for i in active)
        else:
            active, total = self.active, self.total
        lead = -1
        lead_cw = 0
        for i in active:
            value = cw[i] + weights[i]
            cw[i] = value
            if lead < 0 or value > lead_cw:
                lead, lead_cw = i, value
        return lead, total, active

    def pick(self, exclude: Container[str] = ()) -> str | None:
        """Plain nginx SWRR."""
        lead, total, _ = self.add_step(exclude)
        if lead < 0:
            return None
        self.cw[lead] -= total
        return self.nodes[lead]
