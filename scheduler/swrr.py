"""nginx smooth weighted round robin over integer weights (ngx_http_upstream_get_peer).

One pass:  for each eligible node: cw += w; total += w
           best = the node with the greatest cw (ties: earliest in list order)
           best.cw -= total
so Σ cw = 0 after every pass. Weights 5,1,1 give the period a a b a c a a (nginx commit
52327e062). ``Swrr`` keeps the accumulators across weight changes: a node that stays keeps its
cw, a new node starts at 0, and the cw of a node that left is spread over the others so the sum
is still exactly 0 (integer arithmetic throughout).
"""

from __future__ import annotations

from collections.abc import Container, Sequence


class Swrr:
    __slots__ = ("nodes", "weights", "current")

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.weights: dict[str, int] = {}
        self.current: dict[str, int] = {}

    def set_weights(self, weights: Sequence[tuple[str, int]]) -> None:
        previous = self.current
        self.nodes = [node for node, _ in weights]
        self.weights = {node: max(0, weight) for node, weight in weights}
        self.current = {node: previous.get(node, 0) for node in self.nodes}
        self._recentre(sum(self.current.values()))

    def _recentre(self, surplus: int) -> None:
        """Spread ``surplus`` (the cw of departed nodes, negated) so that Σ cw = 0 again."""
        if surplus == 0 or not self.nodes:
            return
        share, remainder = divmod(surplus, len(self.nodes))
        for index, node in enumerate(self.nodes):
            self.current[node] -= share + (1 if index < remainder else 0)

    def add_step(self, exclude: Container[str] = ()) -> tuple[list[str], int]:
        """Credit every eligible node its weight; return the eligible nodes and the total."""
        eligible = [n for n in self.nodes if self.weights[n] > 0 and n not in exclude]
        total = 0
        for node in eligible:
            self.current[node] += self.weights[node]
            total += self.weights[node]
        return eligible, total

    def best(self, eligible: Sequence[str], skip: str | None = None) -> str | None:
        best: str | None = None
        for node in eligible:
            if node != skip and (best is None or self.current[node] > self.current[best]):
                best = node
        return best

    def charge(self, node: str, total: int) -> None:
        self.current[node] -= total

    def pick(self, exclude: Container[str] = ()) -> str | None:
        """Plain nginx SWRR."""
        eligible, total = self.add_step(exclude)
        chosen = self.best(eligible)
        if chosen is not None:
            self.charge(chosen, total)
        return chosen
