"""``Scheduler.tick_changes``: a log without the ticks that change nothing folds to the same state.

Two logs carry the same non-tick events at the same times. The dense one has a tick every 100 ms
(what the scheduler service published before); the sparse one only the ticks ``tick_changes``
asks for, plus a keep-alive every 5 s (what it publishes now). At every period boundary the two
states must be equal but for the clock (tick, time, log position, sample ages): every timer, every
easing step and every ageing signal happens at the same boundary in both. And the sparse log must
really be sparse while the pool is idle. The scheduler service's ``TickGate`` (trials skipped while
``Scheduler.quiet_until`` says nothing can change) must publish exactly the sparse log's ticks.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from laswrr.scheduler.core import Scheduler
from laswrr.scheduler.state import CoreState
from laswrr.services.scheduler_service import TickGate
from tests.scheduler.sched_feed import MS, T0, Feed

PERIOD_MS = 100
KEEPALIVE_MS = 5_000


def without_clock(state: CoreState) -> bytes:
    nodes = {key: msgspec.structs.replace(
        node, drain_seq=0, load=None if node.load is None else msgspec.structs.replace(node.load, sample_age_ms=None))
        for key, node in state.nodes.items()}
    return msgspec.msgpack.encode(msgspec.structs.replace(state, nodes=nodes, now_ns=0, tick=0, last_seq=0))


def script() -> dict[int, Callable[[Feed], object]]:
    """Events by period index: an idle pool, a proxy that falls silent (expiry), an engine whose
    samples stop (ageing), an outlier ejection (ejection time, slow start, backoff decay), a drain
    with a request in flight (deadline), and idle stretches between them."""
    steps: dict[int, Callable[[Feed], object]] = {}

    def at(step: int, action: Callable[[Feed], object]) -> None:
        previous = steps.get(step)
        steps[step] = action if previous is None else (lambda f, p=previous, a=action: (p(f), a(f)))

    at(0, lambda f: [f.register(n, 8) for n in ("n1", "n2", "n3")])
    for second in range(0, 400, 10):  # the collector's keep-alive samples (10 s, standing 11 s); n3's stop at 60 s
        for node in ("n1", "n2") + (("n3",) if second < 60 else ()):
            at(second * 10 + 1, lambda f, n=node: f.send(f"lb.metrics.engine.{n}", {
                "running": 0, "waiting": 0, "kv_cache_usage": 0.0, "max_age_ms": 11_000}))
    at(20, lambda f: f.heartbeat("p1", inflight=1, boot="b1"))
    at(21, lambda f: f.start("n1", proxy="p1", request_id="held", boot="b1"))
    # p1 falls silent: its request is voided after proxy_timeout_ms (15 s)
    at(300, lambda f: [f.finish("n2", f.start("n2", proxy="p2", boot="c1"), "upstream_error", proxy="p2", boot="c1")
                       for _ in range(5)])  # n2 ejected for 30 s, then slow start, then backoff decay
    at(1500, lambda f: f.start("n1", proxy="p3", request_id="long", boot="d1"))
    for second in range(150, 400, 5):
        at(second * 10 + 2, lambda f: f.heartbeat("p3", inflight=1, boot="d1"))
    at(1600, lambda f: f.drain("n1"))  # drained at its deadline (60 s) with "long" in flight
    return steps


def run(sparse: bool, steps: int = 4000) -> tuple[list[bytes], int]:
    feed = Feed()
    actions = script()
    states, ticks, last_tick_ns = [], 0, 0
    for step in range(steps):
        feed.ts_ns = T0 + step * PERIOD_MS * MS
        if step in actions:
            actions[step](feed)
        due = not sparse or feed.ts_ns - last_tick_ns >= KEEPALIVE_MS * MS or feed.scheduler.tick_changes(feed.ts_ns)
        if due:
            feed.tick(period_ms=0)
            ticks, last_tick_ns = ticks + 1, feed.ts_ns
        states.append(without_clock(feed.scheduler.state))
    return states, ticks


def quiet_script() -> dict[int, Callable[[Feed], object]]:
    """A pool left alone: one sample each, 11 to 18 s later stale; a proxy's heartbeat after
    that, 15 s later expired; no other input to make the gate ask again."""
    return {0: lambda f: [f.register(n, 8) for n in ("n1", "n2")],
            10: lambda f: [f.send(f"lb.metrics.engine.{n}", {"running": 1, "waiting": 0, "kv_cache_usage": 0.2,
                                                             "max_age_ms": 11_000}) for n in ("n1", "n2")],
            250: lambda f: f.heartbeat("p1", inflight=0, boot="b1")}


def tick_steps(gated: bool, steps: int = 4000,
               make: Callable[[], dict[int, Callable[[Feed], object]]] = script) -> tuple[list[int], int]:
    """The periods the sparse log ticks at, asking ``tick_changes`` at every period as ``run``
    does, or as the service's loop does with its ``TickGate``: it checks at a period only when
    an input came since its last check or ``next_due_ns`` has come. And how many trials it made."""
    feed = Feed()
    actions = make()
    trials = 0
    tick_changes = feed.scheduler.tick_changes

    def counted(now_ns: int) -> bool:
        nonlocal trials
        trials += 1
        return tick_changes(now_ns)

    feed.scheduler.tick_changes = counted  # type: ignore[method-assign]
    gate = TickGate(KEEPALIVE_MS * MS)
    ticked, wake, last_tick_ns = [], 0, 0
    for step in range(steps):
        feed.ts_ns = T0 + step * PERIOD_MS * MS
        if step in actions:
            applied = len(feed.log)
            actions[step](feed)
            for envelope in feed.log[applied:]:
                gate.applied(envelope)
            wake = step  # an input wakes a resting loop: it checks at once
        if not gated:
            due = feed.ts_ns - last_tick_ns >= KEEPALIVE_MS * MS or feed.scheduler.tick_changes(feed.ts_ns)
        elif step < wake:
            continue
        else:
            due = gate.due(feed.scheduler, feed.ts_ns)
        if due:
            feed.tick(period_ms=0)
            gate.applied(feed.log[-1])
            ticked.append(step)
            last_tick_ns = feed.ts_ns
        wake = max(step + 1, -(-(gate.next_due_ns(feed.scheduler.state.last_seq) - T0) // (PERIOD_MS * MS)))
    return ticked, trials


def test_a_log_without_the_ticks_that_change_nothing_folds_the_same_at_every_period() -> None:
    dense, dense_ticks = run(sparse=False)
    sparse, sparse_ticks = run(sparse=True)
    assert dense_ticks == 4000
    differing = [step for step, (a, b) in enumerate(zip(dense, sparse)) if a != b]
    assert differing == []
    # the scenario's timers really fired (else the comparison proves little)
    final = msgspec.msgpack.decode(dense[-1], type=CoreState)
    assert final.nodes["n1"].phase == "drained" and "p1" not in final.proxies and final.nodes["n2"].ejections == 0
    assert final.nodes["n3"].load is not None and final.nodes["n3"].load.stale
    assert sparse_ticks < dense_ticks // 4, sparse_ticks


def test_the_service_gate_ticks_at_the_same_periods_with_far_fewer_trials() -> None:
    every, every_trials = tick_steps(gated=False)
    gated, gated_trials = tick_steps(gated=True)
    assert gated == every
    assert every_trials > 3500  # one a period but at the keep-alives
    assert gated_trials < every_trials // 4, (gated_trials, every_trials)
    quiet, quiet_trials = tick_steps(gated=True, steps=600, make=quiet_script)
    assert quiet == tick_steps(gated=False, steps=600, make=quiet_script)[0]
    assert quiet_trials < 150, quiet_trials  # the ageing samples are asked about at each period, the rest not


def test_quiet_until_names_the_next_timer_of_an_idle_pool() -> None:
    feed = Feed()
    feed.register("n1", 8)
    feed.tick(30)
    assert feed.scheduler.quiet_until(feed.ts_ns) is None  # nothing sampled, no proxy: only an input can change it
    feed.heartbeat("p1", boot="b1")
    seen_ns = feed.ts_ns
    feed.send("lb.metrics.engine.n1", {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "max_age_ms": 11_000})
    feed.tick(30)
    assert not feed.scheduler.tick_changes(feed.ts_ns)
    # the sample leaves its fresh age 11 s after it, before p1's silence reaches 15 s
    assert feed.scheduler.quiet_until(feed.ts_ns) == seen_ns + 11_000 * MS + 1
    assert feed.scheduler.tick_changes(seen_ns + 11_100 * MS)  # ageing
    ageing_ns = seen_ns + 12_000 * MS  # between fresh and fully stale: every tick may change the signals
    assert feed.scheduler.quiet_until(ageing_ns) == ageing_ns
    assert feed.scheduler.quiet_until(seen_ns + 19_000 * MS) == seen_ns + 15_000 * MS + 1  # fully stale; p1 expires
    feed.capacity("n1", 4)  # the effective weight eases toward the new target at the next ticks
    assert feed.scheduler.quiet_until(feed.ts_ns + 5 * MS) == feed.ts_ns + 5 * MS


def test_an_idle_pool_needs_no_tick_but_a_due_timer_does() -> None:
    feed = Feed()
    feed.register("n1", 8)
    assert feed.scheduler.tick_changes(feed.ts_ns)  # effective weight still easing toward its target
    for _ in range(30):
        feed.tick()
    assert not feed.scheduler.tick_changes(feed.ts_ns + 1000 * MS)
    feed.heartbeat("p1", boot="b1")
    assert not feed.scheduler.tick_changes(feed.ts_ns + 1000 * MS)
    assert feed.scheduler.tick_changes(feed.ts_ns + 15_001 * MS)  # proxy_timeout_ms passed: p1 expires
    before = feed.checkpoint()
    feed.scheduler.tick_changes(feed.ts_ns + 15_001 * MS)
    assert feed.checkpoint() == before  # the trial never touches the state


def test_an_engine_sample_standing_for_longer_does_not_age_before_its_max_age() -> None:
    feed = Feed()
    feed.register("n1", 8)
    feed.tick(30)
    feed.send("lb.metrics.engine.n1", {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "max_age_ms": 11_000})
    sampled_ns = feed.ts_ns
    feed.tick(30)  # eased to the sample's weights (ticks 100 ms apart)
    assert not feed.scheduler.tick_changes(sampled_ns + 10_900 * MS)
    assert feed.scheduler.tick_changes(sampled_ns + 11_100 * MS)  # ageing starts
    restored = Scheduler.restore(feed.checkpoint())
    assert restored.state.nodes["n1"].engine_max_age_ms == 11_000
