"""Model ids -> pool, eligible nodes and the id each node is sent (pure; docs/wire.md, "Model ids").

Each node's ``NodeView.models`` is what its engine lists on ``GET /v1/models`` (the collector
asks, ``lb.metrics.models.<node>``; absent until listed). A request's ``model`` is planned so
that the router never causes an engine's 404 by its own rewriting:

* **A pool's name** (``"model": "default"``): every routable node of the pool is eligible, and
  the request is forwarded as the id of *the node picked* (its first listed id), decided per
  attempt, so a retry or continuation on another node carries that node's id.
* **A model id some pool's nodes list**: that pool (the one with the most nodes listing it,
  then by name), and only its nodes listing the id are eligible; the body is not touched.
* **Any other name**, or no name: the pool ``default``. If the pool's nodes list one model id
  between them (or none is listed yet), the request goes to the pool forwarded as the picked
  node's id, as before (a single-pool client may send any name). If they list several, no node
  serves the name and the router answers its own 404 (``Unknown``), never an engine's.
* A model id listed by no node, when no listing is known at all, falls back to the proxy's own
  ``/v1/models`` cache (``hint``: model id -> pool), as before.

``mixed_models`` says when a pool's nodes do not all list the same ids (``laswrr nodes`` and
the proxy's log say so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from msgspec import UnsetType

from laswrr.schemas.outputs import NodeView, WeightSnapshot

DEFAULT_POOL = "default"


def listed(view: NodeView) -> list[str] | None:
    """The model ids a node's engine lists; None until the collector has listed them."""
    return None if isinstance(view.models, UnsetType) else view.models


def pool_ids(nodes: Iterable[NodeView]) -> set[str]:
    """Every model id any of ``nodes`` lists."""
    ids: set[str] = set()
    for view in nodes:
        ids.update(listed(view) or ())
    return ids


def mixed_models(snapshot: WeightSnapshot) -> dict[str, list[str]] | None:
    """When the pool's listed nodes do not all list the same ids: each node's ids (the nodes
    that listed some); else None. Nodes never listed are left out (nothing is known of them)."""
    lists = {view.node: ids for view in snapshot.nodes if (ids := listed(view))}
    if len({tuple(sorted(ids)) for ids in lists.values()}) <= 1:
        return None
    return lists


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """Where a request goes: ``pool``, minus the nodes in ``exclude`` (they do not list the id);
    ``alias``: forward it as each picked node's own model id (``node_model``)."""

    pool: str
    exclude: frozenset[str] = frozenset()
    alias: bool = False


@dataclass(frozen=True, slots=True)
class Unknown:
    """No pool serves the name: the router's 404 (``ids``: what the pool its name fell to lists)."""

    model: str | None
    pool: str | None
    ids: tuple[str, ...] = ()


def plan(snapshots: Mapping[str, WeightSnapshot], model: str | None,
         hint: Mapping[str, str] | None = None) -> ModelPlan | Unknown:
    """The plan for a request naming ``model`` (module docstring); ``snapshots``: pool -> the
    snapshot in force; ``hint``: the proxy's ``/v1/models`` cache, model id -> pool."""
    if model is not None and model in snapshots:
        return ModelPlan(model, alias=True)
    if model is not None:
        serving = []
        for pool, snapshot in snapshots.items():
            listing = [view.node for view in snapshot.nodes if model in (listed(view) or ())]
            if listing:
                serving.append((-len(listing), pool, snapshot))
        if serving:
            _, pool, snapshot = min(serving, key=lambda entry: entry[:2])
            return ModelPlan(pool, exclude=frozenset(
                view.node for view in snapshot.nodes if model not in (listed(view) or ())))
        if hint and hint.get(model) in snapshots and not pool_ids(snapshots[hint[model]].nodes):
            return ModelPlan(hint[model])
    if DEFAULT_POOL not in snapshots:
        return Unknown(model, None)
    ids = pool_ids(snapshots[DEFAULT_POOL].nodes)
    if len(ids) > 1 and model is not None:
        return Unknown(model, DEFAULT_POOL, tuple(sorted(ids)))
    return ModelPlan(DEFAULT_POOL, alias=model is not None)


def node_model(ids: list[str] | None, model: str | None) -> str | None:
    """The id to forward a pool-name (alias) request as on a node listing ``ids``: its first
    listed id, unless it lists ``model`` itself; None: leave the body alone (the node lists
    nothing known, or already serves the name)."""
    if not ids or model in ids:
        return None
    return ids[0]
