"""Model ids -> pool, eligible nodes and rewriting (scheduler.routing.models; docs/wire.md, "Model ids").

The router must never cause a 404 by its own rewriting: a pool's name goes to any node as that
node's own id, a model id only to the nodes listing it, and in a pool serving several ids a
name none serves is the router's own 404. A pool serving one id keeps forwarding any name to
it as that id (single-pool clients that send any name keep working).
"""

from __future__ import annotations

from laswrr.scheduler.routing.models import ModelPlan, Unknown, mixed_models, node_model, plan
from tests.scheduler.routing_help import admit
from laswrr.scheduler.routing.router import Router
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot

LOAD = LoadView(queue=0.0, running=0.0, kv=0.0, npu=0.0, latency=0.0, load=0.0, sample_age_ms=0, stale=False)


def view(name: str, *models: str, routable: bool = True) -> NodeView:
    extra = {"models": list(models)} if models else {}
    return NodeView(node=name, url=f"http://{name}:8000", phase="active" if routable else "draining",
                    routable=routable, capacity=4, target_weight=4.0, effective_weight=4.0 if routable else 0.0,
                    inflight=0, chip="910B", health=1.0, load=LOAD, **extra)  # type: ignore[arg-type]


def pools(**members: list[NodeView]) -> dict[str, WeightSnapshot]:
    return {pool: WeightSnapshot(pool=pool, as_of_seq=1, tick=0, ts_ns=0, panic=False, nodes=nodes)
            for pool, nodes in members.items()}


MIXED = pools(default=[view("a", "qwen"), view("b", "qwen"), view("c", "llama")])


def test_a_pool_name_goes_to_every_node_as_the_picked_nodes_own_id() -> None:
    assert plan(MIXED, "default") == ModelPlan("default", alias=True)
    assert node_model(["qwen"], "default") == "qwen" and node_model(["llama"], "default") == "llama"
    assert node_model(None, "default") is None  # never listed: the body is left alone
    assert node_model(["default", "x"], "default") is None  # the node serves the name itself


def test_a_model_id_goes_only_to_the_nodes_listing_it() -> None:
    assert plan(MIXED, "llama") == ModelPlan("default", exclude=frozenset({"a", "b"}))
    assert plan(MIXED, "qwen") == ModelPlan("default", exclude=frozenset({"c"}))
    # listed only by a node that is not routable now: still its pool and node (the admission finds none: 503)
    draining = pools(default=[view("a", "qwen"), view("c", "llama", routable=False)])
    assert plan(draining, "llama") == ModelPlan("default", exclude=frozenset({"a"}))


def test_a_name_no_node_serves_in_a_mixed_pool_is_the_routers_404() -> None:
    assert plan(MIXED, "gpt-4") == Unknown("gpt-4", "default", ("llama", "qwen"))
    assert mixed_models(MIXED["default"]) == {"a": ["qwen"], "b": ["qwen"], "c": ["llama"]}


def test_a_single_model_pool_takes_any_name_as_its_model_as_before() -> None:
    single = pools(default=[view("a", "qwen"), view("b", "qwen"), view("c")])
    assert plan(single, "gpt-4") == ModelPlan("default", alias=True)
    assert plan(single, None) == ModelPlan("default")  # no name: the engine's own default
    assert mixed_models(single["default"]) is None
    unlisted = pools(default=[view("a"), view("b")])
    assert plan(unlisted, "anything") == ModelPlan("default", alias=True)


def test_pools_by_name_by_listing_and_by_the_proxys_cache() -> None:
    both = pools(default=[view("a", "qwen")], big=[view("x", "org/big-model"), view("y", "org/big-model")])
    assert plan(both, "big") == ModelPlan("big", alias=True)
    assert plan(both, "org/big-model") == ModelPlan("big", exclude=frozenset())
    unlisted = pools(default=[view("a")], big=[view("x")])
    assert plan(unlisted, "org/big-model", {"org/big-model": "big"}) == ModelPlan("big")
    assert plan(pools(big=[view("x", "m")]), "unknown") == Unknown("unknown", None)
    assert plan(pools(big=[view("x", "m")]), None) == Unknown(None, None)


def test_the_admission_carries_the_nodes_model_ids() -> None:
    router = Router("rr", seed=0)
    router.table.offer(MIXED["default"], now=0)
    seen = {}
    for _ in range(3):
        admission = admit(router, "default")
        assert admission is not None
        seen[admission.node] = admission.models
        router.admitter.release(admission)
    assert seen == {"a": ["qwen"], "b": ["qwen"], "c": ["llama"]}
    only_c = admit(router, "default", plan(MIXED, "llama").exclude)  # type: ignore[union-attr]
    assert only_c is not None and only_c.node == "c"
