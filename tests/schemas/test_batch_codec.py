"""The batch wire form (``lb.req.batch.<proxy>``): encoding, strict decoding, one error per bad event.

A batch holds each event in its own wire form (``encode(event)``, byte for byte), so unpacking
must give back exactly what ``decode_event`` gives for that payload on its own subject, and a
bad event must be reported alone, naming its index, while the others still decode.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import (CORE_STRUCTS, MAX_PAYLOAD_BYTES, SchemaError, batch_item, batch_payload, decode_batch,
                                  decode_event, encode, unbatch)

STARTED = ev.RequestStarted(request_id="r1", proxy="p1", snapshot_seq=7, ts_ns=5, boot_id="b1", prompt_tokens=3)
FINISHED = ev.RequestFinished(request_id="r1", proxy="p1", outcome="completed", ttft_ms=1.5, boot_id="b1")
HEARTBEAT = ev.ProxyHeartbeat(inflight=2, ts_ns=9, boot_id="b1")


def _as_kind(event: ev.Event | None) -> tuple[type, tuple[object, ...]] | None:
    """An event of the core's path as its kind's struct and its fields' values."""
    return None if event is None else (CORE_STRUCTS.get(type(event), type(event)), msgspec.structs.astuple(event))


def _decode(payload: bytes, proxy: str = "p1") -> list[tuple[str | None, str | None, object]]:
    """The ways of unpacking a batch (event by event, ``decode_batch``'s one pass, and the core's,
    whose events are instances of a subclass with the same values), which must agree, error
    messages included."""
    key, batch = decode_event(sj.req_batch(proxy), payload)
    assert key == proxy and isinstance(batch, ev.RequestBatch)
    slow = [(u.index, u.subject, u.key, u.event, None if u.error is None else str(u.error))
            for u in unbatch(proxy, batch)]
    fast = [(u.index, u.subject, u.key, u.event, None if u.error is None else str(u.error))
            for u in decode_batch(sj.req_batch(proxy), payload)[1]]
    assert fast == slow
    core = [(u.index, u.subject, u.key, _as_kind(u.event), None if u.error is None else str(u.error))
            for u in decode_batch(sj.req_batch(proxy), payload, core=True)[1]]
    assert core == [(index, subject, key, _as_kind(event), error) for index, subject, key, event, error in slow]
    return [(subject, key, event if error is None else error) for _, subject, key, event, error in slow]


def test_the_wire_form_is_the_struct_encoded_with_each_event_unchanged() -> None:
    items = [batch_item("req.started", "n1", encode(STARTED)), batch_item("proxy.heartbeat", None, encode(HEARTBEAT))]
    payload = batch_payload("b1", 4, items)
    assert payload == encode(ev.RequestBatch(boot_id="b1", batch=4, events=[msgspec.Raw(i) for i in items]))
    as_json = json.loads(payload)
    assert as_json == {"boot_id": "b1", "batch": 4, "events": [
        ["req.started", "n1", json.loads(encode(STARTED))], ["proxy.heartbeat", None, json.loads(encode(HEARTBEAT))]]}
    assert _decode(payload) == [("lb.req.started.n1", "n1", STARTED), ("lb.proxy.heartbeat.p1", "p1", HEARTBEAT)]


def test_every_event_decodes_as_it_would_alone() -> None:
    events = [("req.started", "n1", STARTED), ("req.finished", "n2", FINISHED), ("proxy.heartbeat", None, HEARTBEAT),
              ("proxy.stopped", None, ev.ProxyStopped(boot_id="b1")),
              ("req.refused", None, ev.RequestRefused(request_id="p1-b1-9", proxy="p1", status=404,
                                                      cause="unknown_model", model="nope", boot_id="b1"))]
    payload = batch_payload(None, None, [batch_item(kind, key, encode(event)) for kind, key, event in events])
    for (subject, key, event), (kind, _, original) in zip(_decode(payload), events):
        assert (key, event) == decode_event(subject, encode(original))
        assert event == original


def test_one_bad_event_is_reported_alone_with_its_index() -> None:
    good = batch_item("req.finished", "n1", encode(FINISHED))
    bad_items = [
        (b'"not an array"', "event 1: not a [kind, key, event] array: Expected `array`, got `str`"),
        (b'["req.started", "n1"]', "event 1: not a [kind, key, event] array: Expected `array` of at least length 3, got 2"),
        (batch_item("admin.capacity_set", "n1", b'{"capacity": 1}'),
         "event 1: kind 'admin.capacity_set' cannot be batched (one of req.started, req.finished, proxy.heartbeat, "
         "proxy.stopped, req.refused, req.queued)"),
        (batch_item("req.started", None, encode(STARTED)), "event 1 (req.started): a req.started event needs its node"),
        (batch_item("req.started", "bad.node", encode(STARTED)), "event 1 (req.started): invalid node id 'bad.node'"),
        (batch_item("proxy.heartbeat", "p2", encode(HEARTBEAT)),
         "event 1 (proxy.heartbeat): a proxy.heartbeat event names no key (its proxy is the batch's), got 'p2'"),
        (batch_item("req.finished", "n1", b'{"request_id": "r2", "proxy": "p1", "outcome": "exploded"}'),
         "event 1 (lb.req.finished.n1): invalid lb.req.finished payload: Invalid enum value 'exploded' - at `$.outcome`"),
        (batch_item("req.started", "n1", b'{"request_id": ""}'),
         "event 1 (lb.req.started.n1): invalid lb.req.started payload: Expected `str` of length >= 1"),
    ]
    for bad, reason in bad_items:
        decoded = _decode(batch_payload("b1", 1, [good, bad, good]))
        assert decoded[0] == decoded[2] == ("lb.req.finished.n1", "n1", FINISHED)
        assert isinstance(decoded[1][2], str) and decoded[1][2].startswith(reason), decoded[1]


@pytest.mark.parametrize("payload, reason", [
    (b'{"events": []}', "invalid lb.req.batch payload: Expected `array` of length >= 1 - at `$.events`"),
    (b'{"boot_id": "b1"}', "invalid lb.req.batch payload: Object missing required field `events`"),
    (b'{"events": [1], "batch": -1}', "invalid lb.req.batch payload: Expected `int` >= 0 - at `$.batch`"),
    (b'{"events": [', "payload is not valid JSON"),
])
def test_a_batch_that_does_not_decode_is_one_error(payload: bytes, reason: str) -> None:
    for decode in (decode_event, decode_batch):
        with pytest.raises(SchemaError) as info:
            decode(sj.req_batch("p1"), payload)
        assert str(info.value).startswith(reason)
    with pytest.raises(SchemaError, match="not a batch subject"):
        decode_batch(sj.req_started("n1"), payload)


def test_a_batch_is_bounded_by_the_payload_limit_and_its_event_count() -> None:
    item = batch_item("proxy.heartbeat", None, b"{}")
    with pytest.raises(SchemaError, match="exceeds"):
        decode_event(sj.req_batch("p1"), batch_payload(None, None, [item] * (MAX_PAYLOAD_BYTES // len(item) + 1)))
    with pytest.raises(SchemaError, match="length <= 10000"):
        decode_event(sj.req_batch("p1"), batch_payload(None, None, [item] * (ev.MAX_BATCH_EVENTS + 1)))


names = st.text(alphabet="abcn123-_", min_size=1, max_size=8)


@given(st.lists(st.tuples(st.sampled_from(["req.started", "req.finished", "proxy.heartbeat"]), names,
                          st.integers(0, 50)), min_size=1, max_size=30))
def test_round_trip(spec: list[tuple[str, str, int]]) -> None:
    events: list[tuple[str, str | None, ev.Event]] = []
    for kind, name, n in spec:
        if kind == "req.started":
            events.append((kind, name, ev.RequestStarted(request_id=f"r{n}", proxy="p1", snapshot_seq=n)))
        elif kind == "req.finished":
            events.append((kind, name, ev.RequestFinished(request_id=f"r{n}", proxy="p1", outcome="completed",
                                                          duration_ms=float(n))))
        else:
            events.append((kind, None, ev.ProxyHeartbeat(inflight=n)))
    payload = batch_payload("b1", len(spec), [batch_item(kind, key, encode(event)) for kind, key, event in events])
    assert [event for _, _, event in _decode(payload)] == [event for _, _, event in events]


@given(st.lists(st.tuples(st.sampled_from(["req.started", "req.finished", "proxy.heartbeat", "req.queued"]),
                          st.one_of(st.text(max_size=6), names, st.sampled_from(["p1\n", "p 1", "é", "x" * 129])),
                          st.one_of(st.none(), st.text(max_size=4), names)), min_size=1, max_size=6))
def test_the_core_checks_names_as_the_structs_do(spec: list[tuple[str, str, str | None]]) -> None:
    """The core's path checks each distinct name once instead of in every event: any name, good
    or bad (a trailing newline matches the pattern, as msgspec's ``re.search`` finds it), decodes
    or fails as the kind's own struct decides."""
    items = []
    for kind, name, boot in spec:
        key = None if kind in ("proxy.heartbeat", "req.queued") else "n1"
        if kind == "proxy.heartbeat":
            payload = msgspec.json.encode({"inflight": 1, "boot_id": boot})
        else:
            extra = {"outcome": "completed"} if kind == "req.finished" else {}
            payload = msgspec.json.encode({"request_id": "r1", "proxy": name, "pool": name, "boot_id": boot, **extra})
        items.append(batch_item(kind, key, payload))
        subject = f"lb.{kind}.{key or 'p1'}"  # the event alone, on its own subject
        assert _alone(subject, payload, core=True) == _alone(subject, payload)
    _decode(batch_payload(None, None, items))


def _alone(subject: str, payload: bytes, core: bool = False) -> object:
    try:
        key, event = decode_event(subject, payload, core=core)
    except SchemaError as exc:
        return str(exc)
    return key, _as_kind(event)
