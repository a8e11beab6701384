"""The live counts a pick weighs: this proxy's own in-flight and prefill backlog per node, and
the pool-wide in-flight estimate (``load``), the other replicas' part plus this proxy's own.

    load[n] = others[n] + own[n]

``others`` is each pool's (``scheduler.routing.route.PoolRoute.others``: the snapshot's, or a
fresher peer message's); ``reload`` recomputes ``load`` of some nodes after it changed. Every
dict keeps positive counts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def _add(counts: dict[str, int], key: str, change: int) -> None:
    value = counts.get(key, 0) + change
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


class Load:
    """Per node: own in-flight (``own``), the pool-wide estimate (``load``), own prefill backlog
    (``backlog``) and the fresh peers' (``peer_backlog``); ``total``: own requests in flight."""

    def __init__(self) -> None:
        self.own: dict[str, int] = {}  # node -> this proxy's own live in-flight
        self.load: dict[str, int] = {}  # node -> others + own: what the policy picks on
        self.backlog: dict[str, int] = {}  # node -> prefill backlog (tokens) of its admitted requests
        self.peer_backlog: dict[str, int] = {}  # node -> the fresh peers' prefill backlogs, summed
        self.total = 0

    def bind(self, node: str, backlog: int) -> None:
        """A request was admitted on ``node`` with ``backlog`` tokens still to prefill."""
        self.own[node] = self.own.get(node, 0) + 1
        self.load[node] = self.load.get(node, 0) + 1
        if backlog:
            self.backlog[node] = self.backlog.get(node, 0) + backlog
        self.total += 1

    def unbind(self, node: str, backlog: int = 0) -> None:
        """A request on ``node`` ended, ``backlog`` tokens of it not prefilled yet (0: ``prefilled`` took them)."""
        self.total -= 1
        if backlog:
            _add(self.backlog, node, -backlog)
        _add(self.load, node, -1)
        _add(self.own, node, -1)

    def prefilled(self, node: str, backlog: int) -> None:
        """``backlog`` tokens of ``node`` were prefilled (a first byte, or the request's end)."""
        _add(self.backlog, node, -backlog)

    def reload(self, nodes: Iterable[str], others: Iterable[Mapping[str, int]]) -> None:
        """``load`` of ``nodes`` again from the own counts and every pool's ``others``."""
        every = list(others)
        for node in nodes:
            _add(self.load, node, self.own.get(node, 0) + sum(o.get(node, 0) for o in every) - self.load.get(node, 0))

    def own_of(self, node: str) -> int:
        return self.own.get(node, 0)

    def estimate_of(self, node: str) -> int:
        """The pool-wide in-flight estimate of ``node`` the picks use."""
        return self.load.get(node, 0)

    def work_of(self, node: str) -> int:
        """``work_backlog()[node]`` without building the dict."""
        return self.backlog.get(node, 0) + self.peer_backlog.get(node, 0)

    def work_backlog(self) -> dict[str, int]:
        """The prefill backlog the work referee weighs: own plus the fresh peers'."""
        if not self.peer_backlog:
            return self.backlog
        backlog = dict(self.peer_backlog)
        for node, tokens in self.backlog.items():
            backlog[node] = backlog.get(node, 0) + tokens
        return backlog
