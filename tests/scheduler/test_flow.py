"""Flow control's pure rules (scheduler/routing/flow.py): bands, the starvation guard, DRR in
work units, bounds, TTL, Retry-After, per-key rate limits. Deterministic: time is passed in."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.schemas.words import RefusalCause
from laswrr.scheduler.routing.flow import (
    FlowConfig, FlowError, FlowQueue, KeyLimits, RateLimits, band_of,
    defer_to_peers, retry_after_header, ttl_s, work_of,
)
from laswrr.scheduler.weights import concurrency_limit
from laswrr.schemas.words import Band

INTERACTIVE, DEFAULT, BATCH = Band


def test_band_header_names_and_the_keys_maximum() -> None:
    assert band_of(None) == DEFAULT and band_of("") == DEFAULT
    assert band_of("interactive") == INTERACTIVE and band_of(" Batch ") == BATCH
    assert band_of("critical") == INTERACTIVE and band_of("sheddable") == BATCH and band_of("standard") == DEFAULT
    assert band_of("interactive", key_max=BATCH) == BATCH  # capped by the key
    assert band_of("batch", key_max=DEFAULT) == BATCH  # a lower band is always allowed
    assert band_of(None, key_max=BATCH) == BATCH
    with pytest.raises(FlowError, match="x-laswrr-priority"):
        band_of("urgent!")
    with pytest.raises(FlowError):
        band_of("1")  # numbers read opposite ways by the peers: names only


def test_ttl_header_default_and_maximum() -> None:
    assert ttl_s(None, 30, 600) == 30
    assert ttl_s("1500", 30, 600) == 1.5
    assert ttl_s("9999999", 30, 600) == 600
    assert ttl_s(None, 900, 600) == 600
    for bad in ("0", "-5", "1.5", "soon"):
        with pytest.raises(FlowError, match="x-laswrr-ttl-ms"):
            ttl_s(bad, 30, 600)


def test_work_and_the_slot_limit() -> None:
    assert work_of(100, 50, 256) == 150 and work_of(100, None, 256) == 356 and work_of(0, 0, 0) == 1
    assert concurrency_limit(10, 1.0) == 10
    assert concurrency_limit(10, 1.25) == 13
    assert concurrency_limit(7, 1.1) == 8  # 7.7 -> 8
    assert concurrency_limit(10, 1.1) == 11  # 11.000000000000002 is 11, not 12
    assert concurrency_limit(0.4, 1.0) == 1  # a node with any slot takes one
    assert concurrency_limit(10, 0) == 0 and concurrency_limit(0, 1.0) == 0  # no limit / no slots


def _queue(**kw: int) -> FlowQueue[str]:
    return FlowQueue(FlowConfig(**kw))


def _drain(queue: FlowQueue[str], pool: str = "p") -> list[str]:
    out = []
    while (held := queue.pop(pool)) is not None:
        out.append(held.ticket)
    return out


def test_strict_priority_between_bands() -> None:
    queue = _queue()
    for name, band in (("b1", BATCH), ("d1", DEFAULT), ("i1", INTERACTIVE), ("b2", BATCH), ("i2", INTERACTIVE)):
        queue.offer("p", band, "", 10, 0.0, 30, name)
    assert _drain(queue) == ["i1", "i2", "d1", "b1", "b2"]
    assert queue.size == 0 and queue.pop("p") is None and queue.pop("other") is None


def test_starvation_guard_serves_the_lowest_band_one_in_n() -> None:
    queue = _queue(batch_every=4)
    for i in range(12):
        queue.offer("p", INTERACTIVE, "", 10, 0.0, 30, f"i{i}")
    for i in range(3):
        queue.offer("p", BATCH, "", 10, 0.0, 30, f"b{i}")
    order = _drain(queue)
    assert order == ["i0", "i1", "i2", "b0", "i3", "i4", "i5", "b1", "i6", "i7", "i8", "b2", "i9", "i10", "i11"]


def test_the_guard_does_not_count_while_the_lowest_band_is_empty() -> None:
    queue = _queue(batch_every=3)
    for i in range(5):
        queue.offer("p", INTERACTIVE, "", 10, 0.0, 30, f"i{i}")
    assert [queue.pop("p").ticket for _ in range(3)] == ["i0", "i1", "i2"]  # type: ignore[union-attr]
    queue.offer("p", BATCH, "", 10, 0.0, 30, "b0")
    assert _drain(queue) == ["i3", "i4", "b0"]


def test_next_band_names_what_pop_takes_and_the_guards_turn() -> None:
    queue = _queue(batch_every=2)
    assert queue.next_band("p") is None
    queue.offer("p", BATCH, "", 10, 0.0, 30, "b0")
    queue.offer("p", DEFAULT, "", 10, 0.0, 30, "d0")
    queue.offer("p", DEFAULT, "", 10, 0.0, 30, "d1")
    assert queue.next_band("p") == (DEFAULT, False) and queue.next_band("p", upto=INTERACTIVE) is None
    assert queue.pop("p").ticket == "d0"  # type: ignore[union-attr]
    assert queue.next_band("p") == (BATCH, True)  # the guard's turn: one in two
    assert queue.next_band("p", upto=DEFAULT) == (DEFAULT, False)
    assert _drain(queue) == ["b0", "d1"]


def test_wide_depth_counts_the_requests_any_node_may_take() -> None:
    queue = _queue()
    queue.offer("p", DEFAULT, "", 10, 0.0, 30, "any")
    narrow = queue.offer("p", DEFAULT, "", 10, 0.0, 30, "one-model", wide=False)
    queue.offer("p", BATCH, "", 10, 0.0, 1, "short")
    assert (queue.depth("p", DEFAULT), queue.wide_depth("p", DEFAULT), queue.wide_depth("p", BATCH)) == (2, 1, 1)
    assert not isinstance(narrow, RefusalCause) and queue.remove(narrow)
    assert [h.ticket for h in queue.expire(5.0)] == ["short"]
    assert (queue.wide_depth("p", DEFAULT), queue.wide_depth("p", BATCH), queue.wide_depth("q", BATCH)) == (1, 0, 0)
    assert queue.pop("p") is not None and queue.wide_depth("p", DEFAULT) == 0


def test_a_band_defers_to_the_peers_more_urgent_held_requests() -> None:
    peers = {"interactive": 2, "batch": 5}
    assert defer_to_peers(BATCH, peers, 2) and defer_to_peers(DEFAULT, peers, 1)  # they need every free slot
    assert not defer_to_peers(BATCH, peers, 3)  # a slot is left over after theirs
    assert not defer_to_peers(INTERACTIVE, peers, 0)  # nothing is more urgent
    assert not defer_to_peers(BATCH, {"batch": 9}, 0)  # the same band: each proxy's own order
    assert defer_to_peers(BATCH, {"default": 1}, 1) and not defer_to_peers(DEFAULT, {"default": 1}, 1)
    assert not defer_to_peers(BATCH, peers, None) and not defer_to_peers(BATCH, {}, 0)  # unlimited; no peers
    # the interactive reserve: the peers' interactive requests go into its free slots first
    assert not defer_to_peers(DEFAULT, {"interactive": 2}, 1, reserved_free=2)
    assert defer_to_peers(DEFAULT, {"interactive": 3}, 1, reserved_free=2)  # one spills into the slot we would take
    assert defer_to_peers(BATCH, {"interactive": 1, "default": 1}, 1, reserved_free=4)  # the default one needs it


def test_drr_shares_work_not_requests() -> None:
    """A tenant of large requests and one of small ones get equal work, not equal counts."""
    queue = _queue(quantum=100)
    for i in range(50):
        queue.offer("p", DEFAULT, "big", 400, 0.0, 30, f"big{i}")
    for i in range(200):
        queue.offer("p", DEFAULT, "small", 100, 0.0, 30, f"small{i}")
    first = [queue.pop("p").ticket for _ in range(50)]  # type: ignore[union-attr]
    big = sum(t.startswith("big") for t in first)
    small = len(first) - big
    assert big == 10 and small == 40  # 4000 work units each
    # the sequence is DRR's: small sends one request a turn, big one every fourth turn
    assert first[:5] == ["small0", "small1", "small2", "big0", "small3"]


def test_drr_three_tenants_equal_work_whatever_they_offer() -> None:
    queue = _queue(quantum=64)
    offered = {"heavy": 300, "a": 30, "b": 30}
    for tenant, n in offered.items():
        for i in range(n):
            queue.offer("p", BATCH, tenant, 50, 0.0, 30, tenant)
    served = [queue.pop("p").ticket for _ in range(60)]  # type: ignore[union-attr]
    assert {t: served.count(t) for t in offered} == {"heavy": 20, "a": 20, "b": 20}
    rest = _drain(queue)  # a and b have 10 each left; then only heavy
    assert rest[:30].count("heavy") == 10 and rest[30:] == ["heavy"] * (len(rest) - 30)


def _naive_drr(requests: list[tuple[str, int]], quantum: int) -> list[int]:
    """Textbook DRR, one quantum per visit, for the property test."""
    fifos: dict[str, deque[tuple[int, int]]] = {}
    order: deque[str] = deque()
    for index, (tenant, work) in enumerate(requests):
        if tenant not in fifos:
            fifos[tenant] = deque()
            order.append(tenant)
        fifos[tenant].append((index, work))
    deficit = dict.fromkeys(fifos, 0)
    out = []
    while order:
        tenant = order[0]
        index, work = fifos[tenant][0]
        if deficit[tenant] >= work:
            deficit[tenant] -= work
            fifos[tenant].popleft()
            out.append(index)
            if not fifos[tenant]:
                order.popleft()
                deficit[tenant] = 0
        else:
            deficit[tenant] += quantum
            order.rotate(-1)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(1, 5000)), min_size=1, max_size=60),
       st.integers(1, 3000))
def test_drr_skips_rounds_exactly_as_textbook_drr(requests: list[tuple[str, int]], quantum: int) -> None:
    queue: FlowQueue[int] = FlowQueue(FlowConfig(quantum=quantum))
    for index, (tenant, work) in enumerate(requests):
        queue.offer("p", DEFAULT, tenant, work, 0.0, 30, index)
    got = []
    while (held := queue.pop("p")) is not None:
        got.append(held.ticket)
    assert got == _naive_drr(requests, quantum)


def test_bound_per_pool_and_band() -> None:
    queue = _queue(bound=2)
    assert not isinstance(queue.offer("p", BATCH, "", 1, 0.0, 30, "b1"), RefusalCause)
    assert not isinstance(queue.offer("p", BATCH, "", 1, 0.0, 30, "b2"), RefusalCause)
    assert queue.offer("p", BATCH, "", 1, 0.0, 30, "b3") is RefusalCause.QUEUE_FULL
    assert not isinstance(queue.offer("p", INTERACTIVE, "", 1, 0.0, 30, "i1"), RefusalCause)  # another band
    assert not isinstance(queue.offer("q", BATCH, "", 1, 0.0, 30, "qb"), RefusalCause)  # another pool
    assert queue.depth("p") == 3 and queue.depth("p", BATCH) == 2 and queue.depth("q") == 1


def test_ttl_expiry_and_removal() -> None:
    queue = _queue()
    a = queue.offer("p", DEFAULT, "x", 1, 0.0, 5.0, "a")
    b = queue.offer("p", DEFAULT, "y", 1, 1.0, 2.0, "b")
    c = queue.offer("p", BATCH, "x", 1, 2.0, 10.0, "c")
    assert not isinstance(b, RefusalCause) and not isinstance(a, RefusalCause) and not isinstance(c, RefusalCause)
    assert queue.next_deadline() == 3.0
    assert queue.expire(2.9) == []
    assert [h.ticket for h in queue.expire(5.0)] == ["b", "a"]  # oldest deadline first
    assert queue.remove(c) and not queue.remove(c)  # a client that left
    assert queue.size == 0 and queue.next_deadline() is None and queue.expire(100.0) == []
    assert queue.oldest_wait("p", DEFAULT, 9.0) == 0.0


def test_a_popped_request_never_expires_later() -> None:
    queue = _queue()
    queue.offer("p", DEFAULT, "", 1, 0.0, 1.0, "a")
    assert queue.pop("p").ticket == "a"  # type: ignore[union-attr]
    assert queue.expire(10.0) == []


def test_oldest_wait_and_depth_per_band() -> None:
    queue = _queue()
    queue.offer("p", BATCH, "x", 1, 1.0, 30, "a")
    queue.offer("p", BATCH, "y", 1, 3.0, 30, "b")
    assert queue.oldest_wait("p", BATCH, 4.0) == 3.0 and queue.oldest_wait("p", INTERACTIVE, 4.0) == 0.0


def test_retry_after_from_the_release_rate() -> None:
    queue = _queue(release_window=11, retry_after_cap_s=60)
    assert queue.retry_after("p", DEFAULT, 0.0) == 60  # no release seen: the cap
    for i in range(11):
        queue.released("p", i * 0.1)  # 10 releases a second
    assert queue.release_rate("p", 1.0) == pytest.approx(10.0)
    assert queue.retry_after("p", DEFAULT, 1.0) == 1  # 1 ahead: 0.1 s, still one second
    for i in range(20):
        queue.offer("p", INTERACTIVE if i % 2 else BATCH, "", 1, 1.0, 30, str(i))
    assert queue.retry_after("p", DEFAULT, 1.0) == 2  # 10 interactive ahead + itself: 1.1 s -> 2
    assert queue.retry_after("p", BATCH, 1.0) == 3  # 20 ahead + itself: 2.1 s
    assert queue.release_rate("p", 11.0) == pytest.approx(10 / 11)  # silence since counts: rate falls
    assert queue.retry_after("p", BATCH, 11.0) == 24  # 21 / (10/11) = 23.1
    assert queue.retry_after("p", BATCH, 1000.0) == 60  # capped
    assert retry_after_header(0.0) == retry_after_header(0.99) == retry_after_header(1.0) == 1
    assert retry_after_header(1.01) == 2


def test_rate_limits_requests_per_minute() -> None:
    rates = RateLimits()
    limits = KeyLimits(rpm=2)
    assert rates.charge("k", limits, 10, 0.0) is None
    assert rates.charge("k", limits, 10, 0.0) is None
    refused = rates.charge("k", limits, 10, 0.0)
    assert refused is not None and refused[0] is RefusalCause.RATE_LIMIT_REQUESTS and refused[1] == pytest.approx(30.0)
    assert rates.charge("other", limits, 10, 0.0) is None  # per key
    assert rates.charge("k", limits, 10, 29.0) is not None
    assert rates.charge("k", limits, 10, 30.0) is None  # one request refilled in 30 s


def test_rate_limits_tokens_charged_at_admission_and_settled() -> None:
    rates = RateLimits()
    limits = KeyLimits(tpm=1000)
    assert rates.charge("k", limits, 800, 0.0) is None  # the estimate: prompt + max_tokens
    refused = rates.charge("k", limits, 300, 0.0)
    assert refused is not None and refused[0] is RefusalCause.RATE_LIMIT_TOKENS and refused[1] == pytest.approx(6.0)
    rates.settle("k", limits, charged=800, used=200, now=0.0)  # it used 200: 600 given back
    assert rates.charge("k", limits, 300, 0.0) is None
    rates.settle("k", limits, charged=300, used=1500, now=0.0)  # it used more: the key owes it
    refused = rates.charge("k", limits, 1, 0.0)
    assert refused is not None and refused[0] is RefusalCause.RATE_LIMIT_TOKENS
    assert rates.charge("k", KeyLimits(), 10**9, 0.0) is None  # no limits: always allowed


def test_a_request_larger_than_the_minute_allowance_is_not_refused_forever() -> None:
    rates = RateLimits()
    assert rates.charge("k", KeyLimits(tpm=100), 5000, 0.0) is None  # charged the whole minute
    assert rates.charge("k", KeyLimits(tpm=100), 5000, 30.0) is not None
    assert rates.charge("k", KeyLimits(tpm=100), 5000, 60.0) is None


def test_a_request_larger_than_the_tpm_is_admitted_on_a_full_minute_and_its_excess_owed() -> None:
    """Issue 43 item 20, the documented rule (docs/proxy.md, "Flow control"): admitted only when the
    key's whole minute is available, charged that minute, and what it really used beyond is owed
    (the key waits for the bucket to refill)."""
    rates, limits = RateLimits(), KeyLimits(tpm=100)
    assert rates.charge("k", limits, 150, 0.0) is None  # the full minute: admitted (charged 100)
    refused = rates.charge("k", limits, 150, 0.0)
    assert refused is not None and refused[1] == pytest.approx(60.0)  # the next waits for a full minute again
    rates.settle("k", limits, charged=150, used=400, now=1.0)  # it used 400 tokens: 300 more than the minute
    refused = rates.charge("k", limits, 1, 1.0)
    assert refused is not None and refused[0] is RefusalCause.RATE_LIMIT_TOKENS and refused[1] == pytest.approx(179.6, abs=0.1)  # (1 + 298.3 owed) at 100 a minute


def test_config_is_checked() -> None:
    with pytest.raises(FlowError):
        FlowConfig(bound=0)
    with pytest.raises(FlowError):
        FlowConfig(retry_after_cap_s=0.5)


def test_the_interactive_reserve() -> None:
    from laswrr.scheduler.routing.flow import reserved_limit
    assert reserved_limit(10, 0.1) == 9 and reserved_limit(20, 0.1) == 18 and reserved_limit(10, 0.3) == 7
    assert reserved_limit(10, 0.0) == 10 and reserved_limit(1, 0.5) == 1 and reserved_limit(1, 0.1) == 1
    # 5..9-slot nodes keep a slot too (8 slots at 0.1 kept none: interactive TTFT P99 1.1 s at 2x load,
    # bench overload-small); below half a slot, none (a 2-slot node keeps both for every band)
    assert reserved_limit(9, 0.1) == 8 and reserved_limit(8, 0.1) == 7 and reserved_limit(5, 0.1) == 4
    assert reserved_limit(4, 0.1) == 4 and reserved_limit(2, 0.1) == 2 and reserved_limit(8, 0.0) == 8
    queue = _queue(batch_every=1)  # the guard would pick batch every time
    queue.offer("p", BATCH, "", 1, 0.0, 30, "b")
    queue.offer("p", DEFAULT, "", 1, 0.0, 30, "d")
    assert queue.pop("p", upto=INTERACTIVE) is None  # only an interactive request may use the reserve
    queue.offer("p", INTERACTIVE, "", 1, 0.0, 30, "i")
    assert queue.pop("p", upto=INTERACTIVE).ticket == "i"  # type: ignore[union-attr]
    assert queue.pop("p").ticket == "b"  # type: ignore[union-attr]  # the guard, outside the reserve
    with pytest.raises(FlowError):
        FlowConfig(interactive_reserve=1.0)
