"""The wire contract: subjects, input decoding with one typed error, stable output bytes.

A bad payload of any kind raises ``SchemaError`` whose message is the rejection reason an
operator reads on ``lb.out.rejected``: it names the event kind and the offending field.
"""

from __future__ import annotations

import inspect

import msgspec
import pytest

from laswrr.schemas import events as ev
from laswrr.schemas import outputs as out
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import MAX_PAYLOAD_BYTES, Envelope, Output, SchemaError, decode_event, encode, event_type
from laswrr.schemas.words import Phase, PhaseCause, RejectCause, RequestOutcome


def _reason(subject: str, data: bytes) -> str:
    with pytest.raises(SchemaError) as info:
        decode_event(subject, data)
    return str(info.value)


def test_not_json() -> None:
    assert _reason("lb.admin.capacity.n1", b"capacity=3").startswith("payload is not valid JSON")
    assert _reason("lb.admin.capacity.n1", b"\xff\xfe").startswith("payload is not valid JSON")


def test_wrong_type() -> None:
    assert _reason("lb.admin.capacity.n1", b'{"capacity": "3"}') == \
        "invalid lb.admin.capacity payload: Expected `int`, got `str` - at `$.capacity`"
    assert "got `bool`" in _reason("lb.admin.capacity.n1", b'{"capacity": true}')
    assert "got `float`" in _reason("lb.admin.capacity.n1", b'{"capacity": 1.5}')
    assert "Expected `object`, got `array`" in _reason("lb.admin.capacity.n1", b"[1]")


def test_negative_capacity() -> None:
    assert _reason("lb.admin.capacity.n1", b'{"capacity": -1}') == \
        "invalid lb.admin.capacity payload: Expected `int` >= 0 - at `$.capacity`"
    # registering needs a positive capacity (0 would mean "drain", which needs a node first)
    assert "Expected `int` >= 1" in _reason("lb.admin.node.n1", b'{"url": "http://x", "capacity": 0}')


def test_out_of_range_values() -> None:
    assert "<= 1.0 - at `$.kv_cache_usage`" in _reason(
        "lb.metrics.engine.n1", b'{"running": 1, "waiting": 0, "kv_cache_usage": 1.5}')
    assert "at `$.capacity`" in _reason("lb.admin.capacity.n1", b'{"capacity": 99999999999999999999999}')
    assert "at `$.chips[0].aicore_util`" in _reason(
        "lb.metrics.npu.n1", b'{"chips": [{"npu_id": 0, "chip_id": 0, "aicore_util": 7}]}')


def test_missing_field() -> None:
    assert _reason("lb.admin.node.n1", b'{"capacity": 3}') == \
        "invalid lb.admin.node payload: Object missing required field `url`"
    assert "missing required field `tick`" in _reason("lb.clock.tick", b"")  # empty body = {}


def test_unknown_subject_and_bad_tokens() -> None:
    assert _reason("lb.admin.frobnicate.n1", b"{}") == \
        "unknown subject 'lb.admin.frobnicate.n1': no event kind is published there"
    assert "unknown subject" in _reason("lb.out.snapshot.default", b"{}")  # outputs are not inputs
    assert "unknown subject" in _reason("lb.admin.node.a.b", b"{}")
    assert _reason("lb.admin.node.", b"{}") == "invalid node id '': use 1-128 letters, digits, '-' or '_'"


def test_an_unknown_outcome_is_rejected_and_a_known_one_decodes_to_its_word() -> None:
    finished = b'{"request_id": "r1", "proxy": "p1", "outcome": "%s"}'
    assert _reason("lb.req.finished.n1", finished % b"teleported") == \
        "invalid lb.req.finished payload: Invalid enum value 'teleported' - at `$.outcome`"
    for outcome in RequestOutcome:
        _, event = decode_event("lb.req.finished.n1", finished % outcome.value.encode())
        assert isinstance(event, ev.RequestFinished) and event.outcome is outcome
        assert encode(event).count(b'"outcome":"%s"' % outcome.value.encode()) == 1


def test_oversized_payload() -> None:
    data = b'{"capacity": 1, "pad": "' + b"x" * MAX_PAYLOAD_BYTES + b'"}'
    assert _reason("lb.admin.capacity.n1", data).startswith(f"payload of {len(data)} bytes exceeds the")


def test_unknown_extra_fields_are_ignored() -> None:
    key, event = decode_event("lb.admin.capacity.n7", b'{"capacity": 4, "by": "ops", "ticket": [1, 2]}')
    assert (key, event) == ("n7", ev.CapacitySet(capacity=4))
    _, chip_event = decode_event("lb.metrics.npu.n7", b'{"chips": [{"npu_id": 1, "chip_id": 0, "vendor": "x"}], "host": "h"}')
    assert chip_event == ev.NpuSampled(chips=[ev.NpuChip(npu_id=1, chip_id=0)])


def test_defaults_fill_optional_fields() -> None:
    _, event = decode_event("lb.admin.node.n1", b'{"url": "http://10.0.0.1:8000", "capacity": 8}')
    assert event == ev.NodeRegistered(url="http://10.0.0.1:8000", capacity=8, pool="default", chip="unknown")
    assert decode_event("lb.admin.drain.n1", b"") == ("n1", ev.DrainRequested())
    assert decode_event("lb.clock.tick", b'{"tick": 3}') == (None, ev.ClockTicked(tick=3))


def _event_structs() -> list[type[ev.Event]]:
    return [cls for _, cls in inspect.getmembers(ev, inspect.isclass)
            if issubclass(cls, ev.Event) and cls is not ev.Event]


def test_every_event_struct_has_a_unique_stable_kind_and_a_subject() -> None:
    structs = _event_structs()
    kinds = [cls.KIND for cls in structs]
    assert len(kinds) == len(set(kinds)), kinds
    assert all("." in kind and kind != "event" for kind in kinds)
    # the kinds are part of the contract: renaming one breaks recorded logs
    assert sorted(kinds) == sorted([
        "admin.node_registered", "admin.node_remove_requested", "admin.capacity_set", "admin.drain_requested",
        "admin.undrain_requested", "admin.config_changed", "metrics.engine_sampled", "metrics.npu_sampled",
        "health.probed", "req.started", "req.finished", "req.batch", "proxy.heartbeat", "proxy.stopped",
        "clock.ticked", "metrics.models_listed", "req.refused", "req.queued"])
    subjects = {
        ev.NodeRegistered: sj.admin_node("x"), ev.NodeRemoveRequested: sj.admin_remove("x"),
        ev.CapacitySet: sj.admin_capacity("x"), ev.DrainRequested: sj.admin_drain("x"),
        ev.UndrainRequested: sj.admin_undrain("x"), ev.ConfigChanged: sj.ADMIN_CONFIG,
        ev.EngineSampled: sj.metrics_engine("x"), ev.NpuSampled: sj.metrics_npu("x"), ev.HealthProbed: sj.health("x"),
        ev.ModelsListed: sj.metrics_models("x"), ev.RequestRefused: sj.req_refused("x"),
        ev.RequestQueued: sj.req_queued("x"),
        ev.RequestStarted: sj.req_started("x"), ev.RequestFinished: sj.req_finished("x"), ev.RequestBatch: sj.req_batch("x"),
        ev.ProxyHeartbeat: sj.proxy_heartbeat("x"), ev.ProxyStopped: sj.proxy_stopped("x"), ev.ClockTicked: sj.CLOCK_TICK,
    }
    assert set(subjects) == set(structs)
    for cls, subject in subjects.items():
        assert event_type(subject)[0] is cls
        assert subject.split(".")[0] == "lb" and not subject.startswith("lb.out.")


def test_output_kinds_are_unique() -> None:
    kinds = [out.WeightSnapshot.KIND, out.Rejected.KIND, out.PhaseChanged.KIND]
    assert len(set(kinds)) == 3


def test_subject_builders_check_tokens() -> None:
    assert sj.admin_capacity("n-1_a") == "lb.admin.capacity.n-1_a"
    assert sj.out_snapshot("gpu") == "lb.out.snapshot.gpu"
    for bad in ("", "a.b", "a b", "*", ">", "x" * 129):
        with pytest.raises(sj.SubjectError):
            sj.admin_node(bad)
    assert sj.split("lb.admin.capacity.n1") == ("lb.admin.capacity", "n1")
    assert sj.split("lb.clock.tick") == ("lb.clock.tick", None)


GOLDEN_SNAPSHOT = (
    b'{"pool":"default","as_of_seq":42,"tick":7,"ts_ns":1700000000700000000,"panic":false,"nodes":['
    b'{"node":"n1","url":"http://10.0.0.1:8000","phase":"active","routable":true,"capacity":10,'
    b'"target_weight":6.4,"effective_weight":6.4,"inflight":3,"chip":"910B","health":1.0,'
    b'"load":{"queue":0.0,"running":0.3,"kv":0.25,"npu":0.5,"latency":0.0,"load":0.185,"sample_age_ms":120,'
    b'"stale":false},"phase_reason":"registered","phase_cause":"registered","concurrency_limit":10},'
    b'{"node":"n2","url":"http://10.0.0.2:8000","phase":"draining","routable":false,"capacity":0,'
    b'"target_weight":0.0,"effective_weight":0.0,"inflight":1,"chip":"910B","health":0.7,'
    b'"load":{"queue":0.5,"running":0.5,"kv":0.5,"npu":0.5,"latency":0.0,"load":0.4,"sample_age_ms":null,'
    b'"stale":true},"phase_reason":"capacity set to 0","phase_cause":"capacity_zero","concurrency_limit":0}]}'
)


def _golden() -> out.WeightSnapshot:
    return out.WeightSnapshot(pool="default", as_of_seq=42, tick=7, ts_ns=1_700_000_000_700_000_000, panic=False, nodes=[
        out.NodeView(node="n1", url="http://10.0.0.1:8000", phase="active", routable=True, capacity=10,
                     target_weight=6.4, effective_weight=6.4, inflight=3, chip="910B", health=1.0,
                     load=out.LoadView(queue=0.0, running=0.3, kv=0.25, npu=0.5, latency=0.0, load=0.185,
                                       sample_age_ms=120, stale=False), phase_reason="registered",
                     concurrency_limit=10),
        out.NodeView(node="n2", url="http://10.0.0.2:8000", phase="draining", routable=False, capacity=0,
                     target_weight=0.0, effective_weight=0.0, inflight=1, chip="910B", health=0.7,
                     load=out.LoadView(queue=0.5, running=0.5, kv=0.5, npu=0.5, latency=0.0, load=0.4,
                                       sample_age_ms=None, stale=True), phase_reason="capacity set to 0",
                     phase_cause=PhaseCause.CAPACITY_ZERO),
    ])


def test_snapshot_encoding_is_byte_stable() -> None:
    assert encode(_golden()) == GOLDEN_SNAPSHOT
    assert msgspec.json.decode(GOLDEN_SNAPSHOT, type=out.WeightSnapshot) == _golden()


def test_phase_and_rejected_encoding() -> None:
    assert encode(out.PhaseChanged(node="n2", from_=Phase.ACTIVE, to=Phase.DRAINING, as_of_seq=41,
                                   cause=PhaseCause.CAPACITY_ZERO, reason="capacity set to 0")) \
        == (b'{"node":"n2","from":"active","to":"draining","as_of_seq":41,"cause":"capacity_zero",'
            b'"reason":"capacity set to 0","pool":"default"}')
    rejected = encode(out.Rejected(as_of_seq=5, subject="lb.admin.capacity.n9", cause=RejectCause.UNKNOWN_NODE,
                                   reason="unknown node 'n9'"))
    assert rejected == (b'{"as_of_seq":5,"subject":"lb.admin.capacity.n9","cause":"unknown_node",'
                        b'"reason":"unknown node \'n9\'"}')
    assert msgspec.json.decode(rejected, type=out.Rejected).cause is RejectCause.UNKNOWN_NODE


def test_output_msg_id_names_its_cause() -> None:
    assert Output(subject="lb.out.snapshot.default", data=b"{}", as_of_seq=17).msg_id == "17:lb.out.snapshot.default"
    assert Envelope(1, 2, "lb.clock.tick", b"{}").subject == "lb.clock.tick"
