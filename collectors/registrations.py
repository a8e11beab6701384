"""The collector's node set at runtime: the nodes.toml start-up list, then the registrations.

Rules (pure: subjects and payloads in, changes out; the subscription is services/collector.py):

* The set starts as the nodes of the collector's nodes.toml; those are polled even when no
  registration for them was ever published.
* ``lb.admin.node.<id>`` (``NodeRegistered``) starts polling ``<id>``, or changes how it is
  polled: ``metrics_url`` and ``health_url`` as given; when omitted, the nodes.toml entry of
  that id when its ``url`` is the registered one (its explicit or default URLs), else
  ``<url>/metrics`` and ``<url>/health``; ``engine`` as given, else the file's, else ``auto``.
  npu-smi settings only come from nodes.toml (a registration cannot name a host command).
* ``lb.admin.remove.<id>`` stops polling ``<id>`` (the scheduler drains, then forgets it);
  registering it again resumes.
* A payload the scheduler would reject (bad JSON, bad field) changes nothing: the scheduler
  records the rejection; the collector only follows what can be applied.

Fed the log in stream order (the subscription first replays the newest message of each admin
subject, in stream order, then follows new ones), the set equals the scheduler's registered
nodes, minus removals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector
from laswrr.collectors.prometheus import EngineKind
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_event
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
        selector=file_node.selector if file_node is not None else ChipSelector())


class RegisteredNodes:
    """The node set the collector polls; ``observe`` folds one admin message into it."""

    def __init__(self, file_nodes: Iterable[Node] = ()) -> None:
        self.file = {node.id: node for node in file_nodes}
        self.nodes: dict[str, Node] = dict(self.file)

    def observe(self, subject: str, data: bytes) -> Change | None:
        """The change ``subject``/``data`` makes to the set, or None (not a node or remove
        subject, a payload that cannot be applied, or nothing new)."""
        if not subject.startswith((sj.ADMIN_NODE + ".", sj.ADMIN_REMOVE + ".")):
            return None
        try:
            node_id, event = decode_event(subject, data)
        except SchemaError:
            return None
        if node_id is None:
            return None
        if isinstance(event, NodeRemoveRequested):
            return (node_id, None) if self.nodes.pop(node_id, None) is not None else None
        assert isinstance(event, NodeRegistered)
        node = registered_node(node_id, event, self.file.get(node_id))
        known = self.nodes.get(node_id)
        self.nodes[node_id] = node
        if known is not None and known.polling == node.polling:
            return None  # registered again (maybe with another capacity): polled as before
        return node_id, node
