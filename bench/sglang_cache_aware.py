"""A model of sglang-router's ``cache_aware`` policy, for the virtual benches (``bench/slo_mixed.py``).

The real router is a Rust binary and cannot run in virtual time; this is the same rule in Python,
written from a reading of its public sources (not a copy of them):

* sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs`` and ``sgl-router/src/policies/tree.rs``:
  the rule up to sglang-router 0.2.3, a miss going to the smallest tree;
* lightseekorg/smg (the gateway's history, where sglang-router is released from) at its commit
  c7f9bf9f5 "[smg] release 0.3.2": ``src/policies/cache_aware.rs`` and ``src/policies/tree.rs`` (the
  rule), ``src/routers/http/router.rs`` (the load: ``cache_aware`` counts a request on its worker
  from the pick until its response ends), ``bindings/python/src/sglang_router/router_args.py`` (the
  defaults ``launch_router`` starts it with); and its commit 6fe82758a "Fix cache-aware router should
  pick min load instead of min tenant size" (first released in 0.2.4): a miss goes to the least
  loaded worker since.

The rule, per request, from its text (characters, not tokens: what the router extracts of the
body) and each worker's load (its requests in flight through this router):

1. **Imbalanced** (``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``,
   over every worker's load): the least loaded worker.
2. Else the longest prefix of the text in the approximate radix tree (one tree of characters, each
   node owned by the workers whose requests went through it): when the matched share of the text
   (matched characters / text characters) is above ``cache_threshold`` (strictly), the worker that
   owns the deepest node reached.
3. Else (a miss) ``MISS_LOAD`` (0.2.4 on, what ``sglang-router>=0.3`` runs): the least loaded worker;
   ``MISS_TREE`` (up to 0.2.3): the worker whose tree holds the fewest characters.

Whichever branch picked, the text is then inserted under the picked worker. Eviction: every
``eviction_interval_s`` of the run's clock, each worker's characters beyond ``max_tree_size`` go,
its least recently used leaves first (a parent left without that worker's children becomes a leaf).
Defaults: sglang-router 0.3.2's (``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5, eviction every 60 s, ``max_tree_size`` 2^26 characters a worker).

Where the model is simpler, and deterministic: a tie on load or tree size goes to the first worker
in order (the router: the first in its list for load, a hash map's first entry for size); the owner
of a matched node is its first owner still holding it (0.3.2: the worker that created the node,
else any); the access times behind eviction are an operation counter, each insert stamping its path
(0.3.2 stamps the leaf, and one prefix match in eight). The router's retries, health checks and
circuit breaker are not modelled (engines never fail here).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

MISS_LOAD = "load"  # a miss goes to the least loaded worker (sglang-router 0.2.4 on)
MISS_TREE = "tree"  # a miss goes to the worker with the smallest tree (up to 0.2.3)


@dataclass(frozen=True, slots=True)
class Config:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2 ** 26
    miss: str = MISS_LOAD


class _Node:
    __slots__ = ("text", "children", "owners", "parent")

    def __init__(self, text: str, parent: _Node | None, owners: dict[str, int] | None = None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.owners: dict[str, int] = owners if owners is not None else {}  # worker -> last access; in order of arrival
        self.parent = parent


def _shared(node_text: str, text: str, at: int) -> int:
    """Characters ``node_text`` and ``text[at:]`` share at their start (galloping, then halving)."""
    most = min(len(node_text), len(text) - at)
    if text.startswith(node_text[:most], at):
        return most
    good, step = 0, 1
    while good + step <= most and text.startswith(node_text[good:good + step], at + good):
        good += step
        step *= 2
    bad = min(good + step, most)  # the prefix of this length differs (that of ``most`` does)
    while bad - good > 1:
        mid = (good + bad) // 2
        if text.startswith(node_text[good:mid], at + good):
            good = mid
        else:
            bad = mid
    return good


class Tree:
    """The approximate radix tree: one tree of request texts, its nodes owned by workers."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.size: dict[str, int] = {}  # worker -> characters of the nodes it owns
        self.clock = 0

    def add(self, worker: str) -> None:
        self.root.owners.setdefault(worker, 0)
        self.size.setdefault(worker, 0)

    def insert(self, text: str, worker: str) -> None:
        self.add(worker)
        self.clock += 1
        node, at = self.root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                node.children[text[at]] = _Node(text[at:], node, {worker: self.clock})
                self.size[worker] += len(text) - at
                return
            shared = _shared(child.text, text, at)
            if shared < len(child.text):  # split: the shared part becomes the child's parent
                upper = _Node(child.text[:shared], node, dict(child.owners))
                child.text, child.parent = child.text[shared:], upper
                upper.children[child.text[0]] = child
                node.children[text[at]] = upper
                child = upper
            if worker not in child.owners:
                self.size[worker] += len(child.text)
            child.owners[worker] = self.clock
            node, at = child, at + shared

    def match(self, text: str) -> tuple[int, str | None]:
        """(characters of ``text`` matched, the owner of the deepest node reached; None: none)."""
        node, at = self.root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                break
            shared = _shared(child.text, text, at)
            node, at = child, at + shared
            if shared < len(child.text):
                break
        return at, next(iter(node.owners), None)

    def evict(self, max_size: int) -> None:
        """Each worker over ``max_size`` characters loses its least recently used leaves until it is not."""
        for worker in [w for w, size in self.size.items() if size > max_size]:
            leaves = [(n.owners[worker], i, n) for i, n in enumerate(self._nodes()) if self._leaf(n, worker)]
            heapq.heapify(leaves)
            order = len(leaves)
            while leaves and self.size[worker] > max_size:
                _, _, node = heapq.heappop(leaves)
                del node.owners[worker]
                self.size[worker] -= len(node.text)
                parent = node.parent
                assert parent is not None
                if not node.owners and not node.children:
                    del parent.children[node.text[0]]
                if parent is not self.root and self._leaf(parent, worker):
                    heapq.heappush(leaves, (parent.owners[worker], order, parent))
                    order += 1

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @staticmethod
    def _leaf(node: _Node, worker: str) -> bool:
        return worker in node.owners and not any(worker in c.owners for c in node.children.values())


class CacheAware:
    """The policy over ``workers`` (in the router's order); ``pick`` a worker for a request's text
    at time ``now`` (seconds of the run), ``done`` when its response ended."""

    def __init__(self, workers: Sequence[str], config: Config = Config()) -> None:
        if config.miss not in (MISS_LOAD, MISS_TREE):
            raise ValueError(f"miss must be {MISS_LOAD!r} or {MISS_TREE!r}, not {config.miss!r}")
        self.workers = list(workers)
        self.config = config
        self.load = dict.fromkeys(self.workers, 0)
        self.tree = Tree()
        for worker in self.workers:
            self.tree.add(worker)
        self.next_eviction = config.eviction_interval_s
        self.decisions: Counter[str] = Counter()  # imbalanced / hit / miss

    def pick(self, text: str, now: float) -> str:
        cfg = self.config
        while cfg.eviction_interval_s > 0 and now >= self.next_eviction:
            self.tree.evict(cfg.max_tree_size)
            self.next_eviction += cfg.eviction_interval_s
        loads = self.load.values()
        most, least = max(loads), min(loads)
        if most - least > cfg.balance_abs_threshold and most > least * cfg.balance_rel_threshold:
            worker, branch = self._least_loaded(), "imbalanced"
        else:
            matched, owner = self.tree.match(text)
            if text and matched / len(text) > cfg.cache_threshold and owner in self.load:
                worker, branch = owner, "hit"
            elif cfg.miss == MISS_LOAD:
                worker, branch = self._least_loaded(), "miss"
            else:
                worker, branch = min(self.workers, key=lambda w: self.tree.size.get(w, 0)), "miss"
        self.tree.insert(text, worker)
        self.load[worker] += 1
        self.decisions[branch] += 1
        return worker

    def done(self, worker: str) -> None:
        self.load[worker] -= 1

    def _least_loaded(self) -> str:
        return min(self.workers, key=self.load.__getitem__)
