"""The proxy keeps a model name's plan (services/proxy/app.py, ``_plan``) until a snapshot is
installed, and a plan made with the ``/v1/models`` cache's answer only while that answer is the
cache's current one: a refresh that moved the model to another pool is followed at once."""

from __future__ import annotations

import time

import pytest

from laswrr.scheduler.routing.models import ModelPlan
from laswrr.scheduler.routing.router import Router
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.services.proxy.app import ProxyState, _plan
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.proxy.models import ModelCatalog

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


def snapshot(pool: str, seq: int) -> WeightSnapshot:
    view = NodeView(node=f"{pool}-1", url=f"http://{pool}:8000", phase="active", routable=True, capacity=4,
                    target_weight=1.0, effective_weight=1.0, inflight=0, chip="910B", health=1.0, load=LOAD)
    return WeightSnapshot(pool=pool, as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=[view])


def listed(catalog: ModelCatalog, model_pools: dict[str, str]) -> None:
    """What a refresh of the catalog leaves (a new mapping, fetched now), without the fetch."""
    catalog.model_pools, catalog.fetched_at = model_pools, time.monotonic()


@pytest.mark.asyncio
async def test_a_plan_made_with_the_model_listing_follows_its_refresh() -> None:
    router = Router("la-swrr", seed=1)
    for pool in ("pa", "pb"):
        router.table.offer(snapshot(pool, 1), 0.0)
    catalog = ModelCatalog(engines=None, router=router)  # type: ignore[arg-type]  # never fetches here
    state = ProxyState(config=ProxyConfig(), router=router, events=None, metrics=None, bus=None,  # type: ignore[arg-type]
                       catalog=catalog)
    listed(catalog, {"m": "pa"})
    first = await _plan(state, "m")
    assert first == ModelPlan("pa")
    assert await _plan(state, "m") is first  # kept: the same listing, the same snapshots

    listed(catalog, {"m": "pb"})  # the engines' listing moved "m" to pool pb
    assert await _plan(state, "m") == ModelPlan("pb")

    kept = await _plan(state, "m")
    router.table.offer(snapshot("pa", 2), 0.0)  # a snapshot installed: every plan is made again
    again = await _plan(state, "m")
    assert again == kept and again is not kept
