"""A batch (``lb.req.batch.<proxy>``) is applied as its events one by one at the batch's seq.

The contract (docs/wire.md, "Batched request events"): applying a batch leaves the core in
byte for byte the state that applying each of its events alone, in order, at the same seq and
time, leaves; its phase changes and rejections are those events' own, in order (a bad event's
rejection names the batch and the index); and it emits one snapshot per pool that any of its
events touched, after the whole batch, equal to the snapshot of the final state. Every output
of a batch has its own ``Nats-Msg-Id``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_feed import MS, Feed, warm_pool
from laswrr.scheduler.core import Scheduler, apply_guarded
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, batch_item, batch_payload, encode
from laswrr.schemas.outputs import Rejected

PROXY = "p1"


def _base() -> Feed:
    """Two pools, a node draining with requests open, open requests of two proxies and boots."""
    feed = warm_pool("n1", "n2", "n3")
    feed.send(sj.admin_node("m1"), {"url": "http://m1:8000", "pool": "other", "capacity": 4})
    for i in range(6):
        feed.start(f"n{i % 3 + 1}", proxy=PROXY, request_id=f"o{i}", boot="b1")
    feed.start("m1", proxy="p2", request_id="q1", boot="c1")
    feed.drain("n3")  # o2 and o5 keep it draining
    feed.tick()
    return feed


BASE = _base()
BASE_STATE = BASE.checkpoint()

request_ids = st.sampled_from(["o0", "o1", "o2", "o5", "q1", "r1", "r2", "r3"])
nodes = st.sampled_from(["n1", "n2", "n3", "m1", "ghost"])
boots = st.sampled_from(["b1", "b2", None])
outcomes = st.sampled_from(["completed", "completed", "upstream_error", "continued", "client_cancelled"])


@st.composite
def event(draw: Any) -> tuple[str, str | None, bytes]:
    """One batch item ``(kind, key, payload)``; some are bad (unknown node or request, wrong field)."""
    kind = draw(st.sampled_from(["req.started", "req.finished", "req.finished", "proxy.heartbeat", "proxy.stopped",
                                 "bad"]))
    boot = draw(boots)
    if kind == "req.started":
        payload: dict[str, Any] = {"request_id": draw(request_ids), "proxy": draw(st.sampled_from([PROXY, "p2"])),
                                   "pool": "default", "snapshot_seq": 3, "boot_id": boot,
                                   "prompt_tokens": draw(st.none() | st.integers(0, 2000)), "max_tokens": 64}
        return kind, draw(nodes), json.dumps(payload).encode()
    if kind == "req.finished":
        payload = {"request_id": draw(request_ids), "proxy": draw(st.sampled_from([PROXY, "p2"])),
                   "outcome": draw(outcomes), "ttft_ms": draw(st.none() | st.floats(0, 500)), "boot_id": boot}
        return kind, draw(nodes), json.dumps(payload).encode()
    if kind == "proxy.heartbeat":
        return kind, None, json.dumps({"inflight": draw(st.integers(0, 4)), "boot_id": boot}).encode()
    if kind == "proxy.stopped":
        return kind, None, json.dumps({"boot_id": boot}).encode()
    return "req.started", draw(nodes), b'{"request_id": 7}'


def _alone_subject(kind: str, key: str | None) -> str:
    return {"req.started": sj.req_started, "req.finished": sj.req_finished,
            "proxy.heartbeat": sj.proxy_heartbeat, "proxy.stopped": sj.proxy_stopped}[kind](key or PROXY)


def _one_by_one(items: list[tuple[str, str | None, bytes]], seq: int, ts_ns: int) -> tuple[Scheduler, list[Any]]:
    """Each event alone at ``seq``: the expected non-snapshot outputs, with each rejection in the
    form a batch gives it, and the pools whose snapshots were emitted."""
    alone = Scheduler.restore(BASE_STATE)
    expected: list[Any] = []
    pools: set[str] = set()
    batch_subject = sj.req_batch(PROXY)
    for index, (kind, key, data) in enumerate(items):
        subject = _alone_subject(kind, key)
        for output in alone.apply(Envelope(seq, ts_ns, subject, data)):
            if output.subject == sj.OUT_REJECTED:
                alone_rejection = json.loads(output.data)
                rejection = Rejected(as_of_seq=seq, subject=batch_subject, cause=alone_rejection["cause"],
                                     reason=f"event {index} ({subject}): {alone_rejection['reason']}",
                                     event_index=index)
                expected.append((sj.OUT_REJECTED, encode(rejection)))
            elif output.subject.startswith(sj.OUT_SNAPSHOT + "."):
                pools.add(output.subject.rsplit(".", 1)[1])
            else:
                expected.append((output.subject, output.data))
    for pool in sorted(pools):
        expected.append((sj.out_snapshot(pool), encode(alone.snapshot(pool))))
    return alone, expected


def _apply_batch(items: list[tuple[str, str | None, bytes]], seq: int, ts_ns: int) -> tuple[Scheduler, list[Output]]:
    batched = Scheduler.restore(BASE_STATE)
    payload = batch_payload("b1", 1, [batch_item(kind, key, data) for kind, key, data in items])
    outputs, fault = apply_guarded(batched, Envelope(seq, ts_ns, sj.req_batch(PROXY), payload))
    assert fault is None
    return batched, outputs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event(), min_size=1, max_size=25), st.integers(0, 40_000))
def test_a_batch_is_its_events_one_by_one(items: list[tuple[str, str | None, bytes]], later_ms: int) -> None:
    seq, ts_ns = BASE.seq + 1, BASE.ts_ns + later_ms * MS
    alone, expected = _one_by_one(items, seq, ts_ns)
    batched, outputs = _apply_batch(items, seq, ts_ns)
    assert batched.checkpoint() == alone.checkpoint()
    assert [(o.subject, o.data) for o in outputs] == expected
    assert all(o.as_of_seq == seq for o in outputs)
    assert len({o.msg_id for o in outputs}) == len(outputs)


def test_a_batch_that_drains_a_node_emits_its_phase_changes_and_one_snapshot() -> None:
    items = [("req.finished", "n3", json.dumps({"request_id": rid, "proxy": PROXY, "outcome": "completed",
                                                 "boot_id": "b1"}).encode()) for rid in ("o2", "o5")]
    items.append(("proxy.heartbeat", None, b'{"inflight": 4, "boot_id": "b1"}'))
    _, outputs = _apply_batch(items, BASE.seq + 1, BASE.ts_ns)
    assert [(o.subject, o.msg_id) for o in outputs] == [
        (sj.out_phase("n3"), f"{BASE.seq + 1}:lb.out.phase.n3"),
        (sj.out_snapshot("default"), f"{BASE.seq + 1}:lb.out.snapshot.default")]
    assert json.loads(outputs[0].data)["to"] == "drained"
    snapshot = json.loads(outputs[1].data)
    assert snapshot["as_of_seq"] == BASE.seq + 1
    assert {n["node"]: n["inflight"] for n in snapshot["nodes"]} == {"n1": 2, "n2": 2, "n3": 0}


def test_bad_events_are_rejected_alone_and_the_rest_applies() -> None:
    items = [("req.started", "n1", b'{"request_id": "r1", "proxy": "p1", "boot_id": "b1"}'),
             ("req.finished", "n1", b'{"request_id": "nope", "proxy": "p1", "outcome": "completed"}'),
             ("req.started", "n2", b'{"request_id": "r2", "proxy": "p1", "boot_id": "b1"}'),
             ("req.started", "n2", b'{"request_id": "r2", "proxy": "p1", "boot_id": "b1"}')]
    batched, outputs = _apply_batch(items, BASE.seq + 1, BASE.ts_ns)
    rejections = [msgspec.json.decode(o.data) for o in outputs if o.subject == sj.OUT_REJECTED]
    assert rejections == [
        {"subject": "lb.req.batch.p1", "as_of_seq": BASE.seq + 1, "event_index": 1, "cause": "unknown_request",
         "reason": "event 1 (lb.req.finished.n1): unknown request_id 'nope': never started, already finished, or "
                   "expired"},
        {"subject": "lb.req.batch.p1", "as_of_seq": BASE.seq + 1, "event_index": 3, "cause": "duplicate_request",
         "reason": "event 3 (lb.req.started.n2): duplicate request_id 'r2': already in flight"}]
    assert [o.msg_id for o in outputs] == [f"{BASE.seq + 1}:lb.out.rejected", f"{BASE.seq + 1}:lb.out.rejected:1"]
    assert {"r1", "r2"} <= set(batched.state.open_requests)


def test_a_batch_that_does_not_decode_is_one_rejection_and_changes_nothing() -> None:
    scheduler = Scheduler.restore(BASE_STATE)
    [output] = scheduler.apply(Envelope(BASE.seq + 1, BASE.ts_ns, sj.req_batch(PROXY), b'{"events": []}'))
    assert msgspec.json.decode(output.data) == {
        "subject": "lb.req.batch.p1", "as_of_seq": BASE.seq + 1, "cause": "invalid_payload",
        "reason": "invalid lb.req.batch payload: Expected `array` of length >= 1 - at `$.events`"}
    assert scheduler.state.open_requests == Scheduler.restore(BASE_STATE).state.open_requests


def test_a_broken_invariant_rejects_only_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Scheduler._on_finished

    def explode_on_r9(self: Scheduler, key: str, event: Any) -> None:
        if event.request_id == "o1":
            raise KeyError("boom")
        original(self, key, event)

    monkeypatch.setattr(Scheduler, "_on_finished", explode_on_r9)
    items = [("req.finished", "n2", b'{"request_id": "o1", "proxy": "p1", "outcome": "completed"}'),
             ("req.finished", "n1", b'{"request_id": "o0", "proxy": "p1", "outcome": "completed"}')]
    scheduler = Scheduler.restore(BASE_STATE)
    payload = batch_payload(None, None, [batch_item(*item) for item in items])
    outputs, fault = apply_guarded(scheduler, Envelope(BASE.seq + 1, BASE.ts_ns, sj.req_batch(PROXY), payload))
    assert isinstance(fault, KeyError)
    [rejection] = [msgspec.json.decode(o.data) for o in outputs if o.subject == sj.OUT_REJECTED]
    assert rejection["event_index"] == 0
    assert rejection["reason"] == "event 0 (lb.req.finished.n2): internal error while applying: KeyError: 'boom'"
    assert "o0" not in scheduler.state.open_requests and "o1" in scheduler.state.open_requests
