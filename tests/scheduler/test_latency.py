"""Latency objectives in the routing core (scheduler/routing/latency.py): the per-node estimate
follows a node whose speed changes, and the admitter removes the nodes predicted to miss a
request's targets, refusing ``slo_unmeetable`` at once when no node could meet it."""

from __future__ import annotations

import pytest

from laswrr.schemas.words import Band
from laswrr.scheduler.routing.latency import (Estimate, LatencyModel, Objective, PoolSignals, Prediction, SloDefaults,
                                             SloError, meets, pool_signals)
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Refusal, Router
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas.refusals import ANSWERS
from laswrr.schemas.words import RefusalCause

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


def node(name: str, weight: float = 1.0, capacity: int = 8) -> NodeView:
    return NodeView(node=name, url=f"http://{name}:8000", phase="active", routable=True, capacity=capacity,
                    target_weight=weight, effective_weight=weight, inflight=0, chip="910B", health=1.0, load=LOAD)


def snap(*nodes: NodeView) -> WeightSnapshot:
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=1, ts_ns=0, panic=False, nodes=list(nodes))


def simulate(model: LatencyModel, node: str, rate: float, tpot: float, requests: int, fixed: float = 0.0) -> None:
    """``requests`` measured on a node prefilling ``rate`` tokens/s after a ``fixed`` cost and decoding at
    ``tpot`` s a token (plus 1 ms a token per request of its batch), with varied prompts and batches."""
    for i in range(requests):
        work, batch, tokens = 200 + (i * 977) % 3000, 1 + i % 7, 50 + i % 40
        model.observe_prefill(node, work, fixed + work / rate)
        model.observe_decode(node, batch, tokens, (tokens - 1) * (tpot + 0.001 * batch))


def test_the_estimate_converges_on_a_node_whose_speed_changes_mid_run() -> None:
    model = LatencyModel()
    assert model.ttft("n", 1000) is None and model.tpot("n", 1) is None  # never measured: no prediction
    simulate(model, "n", rate=4000.0, tpot=0.020, requests=40, fixed=0.15)
    assert abs(model.ttft("n", 4000) - 1.15) < 0.01 and abs(model.ttft("n", 0) - 0.15) < 0.01
    assert abs(model.tpot("n", 4) - 0.024) < 0.001
    simulate(model, "n", rate=1000.0, tpot=0.040, requests=3, fixed=0.15)  # just changed: still mostly the old node
    assert model.ttft("n", 4000) < 3.0
    simulate(model, "n", rate=1000.0, tpot=0.040, requests=40, fixed=0.15)  # five half-lives later
    assert abs(model.ttft("n", 4000) - 4.15) / 4.15 < 0.05
    assert abs(model.tpot("n", 4) - 0.044) / 0.044 < 0.05
    assert abs(model.tpot("n", 1) - 0.041) / 0.041 < 0.05  # the batch slope is kept


def test_nodes_are_learned_apart() -> None:
    model = LatencyModel()
    simulate(model, "c", rate=8000.0, tpot=0.02, requests=30)
    simulate(model, "b", rate=4000.0, tpot=0.02, requests=30)
    assert abs(model.prefill_rate("c") / model.prefill_rate("b") - 2.0) < 0.02


def _served(model: LatencyModel, node: str, slots: int, batch: int, ttft: float, requests: int = 20) -> None:
    """``requests`` attempts of 1 000 uncached tokens on ``node``, each decoding 101 tokens in 2 s after its
    first token, picked at an in-flight of ``batch`` (``slots`` engine slots), measuring ``ttft``."""
    for _ in range(requests):
        model.learn(Estimate(node, 0, 1000, batch, model.learned(node), 101, slots), ttft * 1000, 0.0,
                    ttft * 1000 + 2000.0, 101)


def test_a_node_with_its_slots_full_predicts_the_wait_for_the_requests_ahead() -> None:
    model = LatencyModel()
    _served(model, "n", 4, 2, 0.25)  # a free slot: 0.25 s for 1 000 tokens, so 4 000 tokens/s
    hold = 2.0 + 0.25  # a request holds its slot for its decode and its own prefill
    free = Estimate("n", 0, 1000, 4, 20, 101, 4).predict(model).ttft_s  # the 4th of 4 slots: no wait
    assert free is not None and abs(free - 0.25) < 1e-6
    waits = {}
    for batch in (5, 8, 12):  # batch - 4 requests ahead must end, one every hold / 4 seconds
        waited = Estimate("n", 0, 1000, batch, 20, 101, 4).predict(model).ttft_s
        assert waited is not None
        waits[batch] = waited - free
    assert abs(waits[5] - hold / 4) / (hold / 4) < 0.01  # (the first attempt's hold had no prefill rate yet)
    assert abs(waits[8] - 4 * waits[5]) < 1e-9 and abs(waits[12] - 8 * waits[5]) < 1e-9
    unknown = Estimate("n", 0, 1000, 12, 20, 101, 0).predict(model).ttft_s  # slots not known: as before
    assert unknown == free
    # the TPOT of a request that waits: decoding in a full batch, the queue ahead prefilled before it starts
    assert Estimate("n", 9000, 1000, 12, 20, 101, 4).predict(model).tpot_s == model.tpot("n", 4)
    assert Estimate("n", 9000, 1000, 3, 20, 101, 4).predict(model).tpot_s > model.tpot("n", 3)  # the stall
    _served(model, "n", 4, 12, 0.25 + 8 * hold / 4)  # attempts that waited do not slow the prefill rate learned
    assert abs(model.prefill_rate("n") - 4000.0) < 1e-6


def test_a_node_whose_every_attempt_waited_learns_its_prefill_rate_less_the_wait() -> None:
    model = LatencyModel()
    hold = 2.0 + 0.25
    _served(model, "n", 4, 12, 0.25 + 8 * hold / 4, requests=1)  # its first attempt: no hold known, nothing learned
    assert model.prefill_rate("n") is None and model.ttft("n", 1000) is None
    _served(model, "n", 4, 12, 0.25 + 8 * 2.0 / 4, requests=1)  # the wait it predicts from the hold it knows now
    assert abs(model.ttft("n", 1000) - 0.25) < 1e-6
    _served(model, "n", 4, 12, 30.0, requests=5)  # later attempts that waited teach it nothing more
    assert abs(model.ttft("n", 1000) - 0.25) < 1e-6


def test_the_slo_filter_removes_a_node_whose_slots_are_full() -> None:
    model = LatencyModel()
    router = Router("la-swrr", 7, scorer=None, latency=model)
    router.table.offer(snap(node("full", capacity=4), node("idle", capacity=4)), 0.0)
    for name in ("full", "idle"):
        _served(model, name, 4, 2, 0.25)
    for _ in range(6):  # in flight on "full": the next request waits for 3 of them to end, 1.7 s
        router.table.load.bind("full", 0)
    for _ in range(4):
        admission = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=RequestSize(1000),
                                                       objective=Objective(ttft_ms=1000)))
        assert isinstance(admission, Admission) and admission.node == "idle"
        assert admission.predicted is not None and abs(admission.predicted.ttft_s - 0.25) < 1e-6
        router.admitter.release(admission)


def test_meets_reads_only_the_targets_set_and_the_figures_known() -> None:
    assert meets(Prediction(2.0, 0.1), Objective())
    assert not meets(Prediction(2.0, None), Objective(ttft_ms=1000))
    assert meets(Prediction(None, None), Objective(ttft_ms=1, tpot_ms=1))
    assert not meets(Prediction(0.5, 0.06), Objective(ttft_ms=1000, tpot_ms=50))


def _router(serve_late: bool = False) -> tuple[Router, LatencyModel]:
    model = LatencyModel()
    router = Router("la-swrr", 7, scorer=None, latency=model, serve_late=serve_late)
    router.table.offer(snap(node("fast"), node("slow")), 0.0)
    simulate(model, "fast", rate=8000.0, tpot=0.02, requests=20)
    simulate(model, "slow", rate=2000.0, tpot=0.02, requests=20)
    return router, model


def test_only_nodes_that_meet_the_target_are_picked() -> None:
    router, _ = _router()
    size = RequestSize(4000)  # 0.5 s on fast, 2 s on slow
    for _ in range(6):
        admission = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1000)))
        assert isinstance(admission, Admission) and admission.node == "fast"
        router.admitter.release(admission)
    # without an objective the weights spread the load as before
    plain = [router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size)) for _ in range(6)]
    assert {a.node for a in plain if isinstance(a, Admission)} == {"fast", "slow"}


def test_the_queue_ahead_counts() -> None:
    router, _ = _router()
    size = RequestSize(4000)  # fast: 0.5 s alone; a second one waits for the first: 1 s; a third 1.5 s
    first = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1100)))
    second = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1100)))
    third = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1100)))
    assert isinstance(first, Admission) and isinstance(second, Admission) and first.node == second.node == "fast"
    assert isinstance(third, Refusal) and third.saturated  # 1.5 s now, 0.5 s once the queue drains: hold it
    router.admitter.prefilled(first)
    again = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1100)))
    assert isinstance(again, Admission) and again.node == "fast"


def test_a_target_no_node_can_meet_is_refused_at_once_with_its_figures() -> None:
    router, _ = _router()
    refusal = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=RequestSize(16000),
                                                 objective=Objective(ttft_ms=1000)))
    assert isinstance(refusal, Refusal) and refusal.cause is RefusalCause.SLO_UNMEETABLE
    assert not refusal.saturated  # even an idle node needs 2 s: answer now, not after the deadline
    assert refusal.predicted is not None and abs(refusal.predicted.ttft_s - 2.0) < 0.01
    assert refusal.objective == Objective(ttft_ms=1000)
    assert ANSWERS[RefusalCause.SLO_UNMEETABLE].status == 429


def test_headers_win_over_the_key_default_over_the_band_default() -> None:
    defaults = SloDefaults.parse(["interactive=1000/50", "batch=10000/", "key:etl=/200"])
    assert defaults.objective(None, None, Band.INTERACTIVE, None) == Objective(1000, 50)
    assert defaults.objective(None, None, Band.BATCH, None) == Objective(10000, None)
    assert defaults.objective(None, None, Band.DEFAULT, None) is None  # served as before
    assert defaults.objective(None, None, Band.INTERACTIVE, "etl") == Objective(None, 200)
    assert defaults.objective("500", None, Band.BATCH, None) == Objective(500, None)
    assert defaults.objective(None, "40", Band.DEFAULT, None) == Objective(None, 40)
    for bad in ("soon", "-1", "0", "1e12"):
        with pytest.raises(SloError, match="x-laswrr-ttft-slo-ms"):
            defaults.objective(bad, None, Band.DEFAULT, None)
    for spec in ("fast=1/2", "interactive", "interactive=x/"):
        with pytest.raises(SloError, match="--slo-defaults"):
            SloDefaults.parse([spec])


def test_serve_late_picks_as_without_an_objective() -> None:
    router, _ = _router(serve_late=True)
    result = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=RequestSize(16000),
                                                objective=Objective(ttft_ms=1000)))
    assert isinstance(result, Admission)


def test_a_queue_that_could_drain_in_time_is_held_not_refused() -> None:
    router, model = _router()
    size = RequestSize(4000)
    router.table.load.bind("fast", 8000)  # fill both nodes' prefill queues
    router.table.load.bind("slow", 8000)
    refusal = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=Objective(ttft_ms=1000)))
    assert isinstance(refusal, Refusal) and refusal.cause is RefusalCause.SLO_UNMEETABLE and refusal.saturated


def test_observed_teaches_the_node_the_admission_was_bound_to() -> None:
    model = LatencyModel()
    router = Router("la-swrr", 7, scorer=None, latency=model)
    router.table.offer(snap(node("a")), 0.0)
    admission = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=RequestSize(3000)))
    assert isinstance(admission, Admission) and admission.estimate == Estimate("a", 0, 3000, 1, 0, 0, 8)
    assert admission.estimate.ahead == 3000 and admission.predicted is None  # no targets: no prediction made
    router.admitter.observed(admission, 500.0, 0.0, 2500.0, 101)  # recorded figures: ms from the arrival
    assert model.learned("a") == 1
    assert abs(model.prefill_rate("a") - 6000.0) < 1e-6
    assert abs(model.tpot("a", 1) - 0.02) < 1e-9


def test_pool_signals_for_autoscalers() -> None:
    model = LatencyModel()
    simulate(model, "c", rate=8000.0, tpot=0.02, requests=20)
    simulate(model, "b", rate=4000.0, tpot=0.02, requests=20)
    signals = pool_signals([("c", 10), ("b", 10)], {"c": 10, "b": 5}, {"c": 24000, "b": 0}, model)
    assert signals.saturation == 0.75
    assert abs(signals.backlog_s - 2.0) < 0.01  # 24 000 tokens at 12 000 tokens/s
    assert abs(signals.predicted_ttft_s - 0.0) < 0.01  # b is idle
    assert pool_signals([("x", 4)], {}, {}, None) == PoolSignals(0.0, None, None)
    _served(model, "s", 4, 2, 0.25)  # 4 000 tokens/s, a slot held about 2.25 s
    free, full = (pool_signals([("s", 4)], {"s": busy}, {}, model).predicted_ttft_s for busy in (3, 7))
    behind_one = model.predict("s", 0, 5, 0, 0, 4).ttft_s
    assert free is not None and full is not None and behind_one is not None and behind_one - free > 0.5
    assert abs(full - free - 4 * (behind_one - free)) < 1e-9  # in flight 7 of 4 slots: 4 must end first


@pytest.mark.parametrize("affinity", ["prefix", "none"])
def test_without_objectives_the_picks_are_todays(affinity: str) -> None:
    """The estimate only ever removes nodes for a request with an objective: without one, a router
    with the estimate picks exactly as one without it."""
    from laswrr.scheduler.routing.router import scorer_for
    routers = [Router("la-swrr", 11, scorer=scorer_for(affinity), latency=latency)
               for latency in (None, LatencyModel())]
    picks: list[list[str]] = [[], []]
    for router, seen in zip(routers, picks):
        router.table.offer(snap(node("a", 2.0), node("b", 1.0), node("c", 1.0)), 0.0)
        live: list[Admission] = []
        for i in range(200):
            result = router.admitter.admit(AdmitRequest(DEFAULT_POOL, prompt=f"p{i % 7} ".encode() * (50 + i % 30),
                                                        size=RequestSize(100 + i % 500, 64)))
            assert isinstance(result, Admission)
            seen.append(result.node)
            live.append(result)
            if i % 3 == 0:
                router.admitter.prefilled(live[0])
            if len(live) > 6:
                done = live.pop(0)
                router.admitter.release(done)
                router.admitter.observed(done, 200 + i % 5 * 100, 0.0, 2000.0, 64)
    assert picks[0] == picks[1]
