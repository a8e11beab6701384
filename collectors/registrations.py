"""The collector's node set at runtime: the nodes.toml start-up list, then what the scheduler applied.

Rules (pure: subjects and payloads in, changes out; the subscriptions are services/collector.py):

* The set starts as the nodes of the collector's nodes.toml; those are polled even when no
  registration for them was ever published.
* ``lb.admin.node.<id>`` (``NodeRegistered``) says how ``<id>`` would be polled: ``metrics_url``
  and ``health_url`` as given; when omitted, the nodes.toml entry of that id when its ``url`` is
  the registered one (its explicit or default URLs), else ``<url>/metrics`` and ``<url>/health``;
  ``engine`` as given, else the file's, else ``auto``. npu-smi settings only come from nodes.toml
  (a registration cannot name a host command).
* It is followed only once the scheduler applied it: once a weight snapshot (KV LB_WEIGHTS, the
  latest of each pool) lists ``<id>`` at the registered URL. A registration the scheduler
  rejected (a URL outside its allow-list, a capacity above ``max_capacity``, ...) never shows in
  a snapshot, so it is never polled (before, it was probed every interval and each probe became
  one more ``lb.health`` rejection). A node that leaves every snapshot (forgotten after a
  remove) stops being polled, unless it is a nodes.toml node.
* ``lb.admin.remove.<id>`` stops polling ``<id>`` at once (the scheduler drains, then forgets
  it); registering it again resumes once applied.
* A payload the scheduler would reject outright (bad JSON, bad field) changes nothing.

Fed the log in stream order and the snapshots, the set equals the scheduler's registered nodes
(plus the nodes.toml nodes it does not know), minus removals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import cast

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector
from laswrr.collectors.prometheus import EngineKind
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_event, decode_snapshot
from laswrr.schemas.events import NodeRegistered, NodeRemoveRequested

Change = tuple[str, Node | None]  # (node id, how to poll it now; None: stop polling)


def registered_node(node_id: str, event: NodeRegistered, file_node: Node | None) -> Node:
    """``node_id`` as ``event`` registers it, polled by the rules in the module doc."""
    url = event.url.rstrip("/")
    base = file_node if file_node is not None and file_node.url == url else None
    engine = event.engine or (file_node.engine if file_node is not None else "auto")
    return Node(
        id=node_id, url=url, pool=event.pool, chip=event.chip, capacity=event.capacity,
        metrics_url=event.metrics_url or (base.metrics_url if base else ""),
        health_url=event.health_url or (base.health_url if base else ""),
        engine=cast(EngineKind, engine),
        npu_smi=file_node.npu_smi if file_node is not None else None,
        selector=file_node.selector if file_node is not None else ChipSelector(),
        status_url=event.status_url or (base.status_url if base else None),
        npu_exporter=event.npu_exporter or (file_node.npu_exporter if file_node is not None else None),
        chips_per_npu=file_node.chips_per_npu if file_node is not None else 1,
        pod=file_node.pod if file_node is not None else ("", ""))


class RegisteredNodes:
    """The node set the collector polls: ``observe`` folds one admin message into it,
    ``observe_snapshot`` one pool's latest snapshot; each returns the changes to polling."""

    def __init__(self, file_nodes: Iterable[Node] = ()) -> None:
        self.file = {node.id: node for node in file_nodes}
        self.asked: dict[str, Node] = {}  # the newest registration of each id, applied or not
        self.applied: dict[str, dict[str, str]] = {}  # pool -> {node: url} of its latest snapshot
        self.in_flight: dict[str, set[str]] = {}  # pool -> its nodes with requests in flight, by that snapshot
        self.removed: set[str] = set()  # removal requested, not registered since
        self.nodes: dict[str, Node] = dict(self.file)  # what is polled now

    def observe(self, subject: str, data: bytes) -> list[Change]:
        """The changes ``subject``/``data`` makes to the polled set (none for other subjects or a
        payload that cannot be applied)."""
        if not subject.startswith((sj.ADMIN_NODE + ".", sj.ADMIN_REMOVE + ".")):
            return []
        try:
            node_id, event = decode_event(subject, data)
        except SchemaError:
            return []
        if node_id is None:
            return []
        if isinstance(event, NodeRemoveRequested):
            self.asked.pop(node_id, None)
            self.removed.add(node_id)
        else:
            assert isinstance(event, NodeRegistered)
            self.removed.discard(node_id)
            self.asked[node_id] = registered_node(node_id, event, self.file.get(node_id))
        return self._settle()

    def observe_snapshot(self, pool: str, data: bytes | None) -> list[Change]:
        """The changes one pool's latest snapshot (None or empty: the pool is gone) makes."""
        nodes: dict[str, str] = {}
        busy: set[str] = set()
        with contextlib.suppress(SchemaError):
            for view in decode_snapshot(data or b"").nodes:
                nodes[view.node] = view.url.rstrip("/")
                if view.inflight > 0:
                    busy.add(view.node)
        if nodes:
            self.applied[pool], self.in_flight[pool] = nodes, busy
        else:
            self.applied.pop(pool, None)
            self.in_flight.pop(pool, None)
        return self._settle()

    @property
    def busy(self) -> set[str]:
        """The nodes some pool's latest snapshot counts requests in flight on (not idle, whatever
        their samples say: the collector polls them at its normal interval)."""
        return set().union(*self.in_flight.values())

    def _applied_url(self, node_id: str) -> str | None:
        return next((nodes[node_id] for nodes in self.applied.values() if node_id in nodes), None)

    def _wanted(self, node_id: str) -> Node | None:
        if node_id in self.removed:
            return None
        asked, url = self.asked.get(node_id), self._applied_url(node_id)
        if asked is not None and url == asked.url:
            return asked  # the scheduler applied this registration
        current = self.nodes.get(node_id)
        if url is not None and current is not None and current.url == url:
            return current  # a newer registration is not (yet) applied: polled as before
        return self.file.get(node_id)

    def _settle(self) -> list[Change]:
        changes: list[Change] = []
        for node_id in sorted(set(self.nodes) | set(self.asked) | set(self.file)):
            wanted, known = self._wanted(node_id), self.nodes.get(node_id)
            if wanted is None:
                if known is not None:
                    del self.nodes[node_id]
                    changes.append((node_id, None))
                continue
            self.nodes[node_id] = wanted
            if known is None or known.polling != wanted.polling:
                changes.append((node_id, wanted))
        return changes
