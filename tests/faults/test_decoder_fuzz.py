"""Hypothesis fuzzing of every input subject's decoder, and of the core behind it.

For each subject the scheduler reads (every prefix with a node or proxy key, and the two
whole-subject ones), random bytes, random JSON documents, and the subject's own fields filled
with random and boundary values (huge and negative numbers, NaN-like floats, long strings,
invalid UTF-8, NUL) must either decode or raise ``SchemaError`` (the typed error that becomes the
recorded rejection), nothing else; and ``Scheduler.apply`` on them never raises: the worst is one
``lb.out.rejected``, each reason within ``TEXT_MAX_CHARS``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laswrr.scheduler.core import Scheduler
from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, SchemaError, decode_event
from laswrr.schemas.outputs import TEXT_MAX_CHARS

KEYED = [sj.ADMIN_NODE, sj.ADMIN_REMOVE, sj.ADMIN_CAPACITY, sj.ADMIN_DRAIN, sj.ADMIN_UNDRAIN, sj.METRICS_ENGINE,
         sj.METRICS_NPU, sj.HEALTH, sj.REQ_STARTED, sj.REQ_FINISHED, sj.PROXY_HEARTBEAT, sj.PROXY_STOPPED]
SUBJECTS = [f"{prefix}.n1" for prefix in KEYED] + [sj.CLOCK_TICK, sj.ADMIN_CONFIG]
FIELDS = sorted({name for cls in (ev.NodeRegistered, ev.CapacitySet, ev.EngineSampled, ev.NpuSampled,
                                  ev.HealthProbed, ev.RequestStarted, ev.RequestFinished, ev.ProxyHeartbeat,
                                  ev.ProxyStopped, ev.ClockTicked, ev.ConfigChanged)
                 for name in (f.encode_name for f in msgspec.structs.fields(cls))})

BOUNDARY_NUMBERS = st.sampled_from([0, -1, 1, 2**53, 2**53 + 1, 2**63, -(2**63), 2**64, 10**30, 0.5, -0.0,
                                    1e308, -1e308, 5e-324, 1e400])
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 5000, "\x00", "é", "n1.n2", "\ud7ff"]))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TEXT,
                              BOUNDARY_NUMBERS),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.one_of(st.sampled_from(FIELDS), TEXT), inner,
                                                            max_size=5)),
                    max_leaves=12)
FIELDED = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(lambda d: json.dumps(d).encode())
RAW = st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()), FIELDED,
                FIELDED.map(lambda b: b.replace(b'"', b'"\xff', 1)),  # invalid UTF-8 inside a string
                FIELDED.map(lambda b: b[: len(b) // 2]))  # cut short


def decode_or_schema_error(subject: str, data: bytes) -> Any:
    try:
        return decode_event(subject, data)
    except SchemaError as exc:
        assert str(exc)  # a reason to record
        return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subject=st.sampled_from(SUBJECTS), data=RAW)
def test_every_decoder_raises_only_the_typed_schema_error(subject: str, data: bytes) -> None:
    decode_or_schema_error(subject, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=st.lists(st.tuples(st.sampled_from(SUBJECTS), RAW), min_size=1, max_size=12))
def test_the_core_never_raises_on_any_payload(inputs: list[tuple[str, bytes]]) -> None:
    scheduler = Scheduler()
    scheduler.apply(Envelope(1, 1, sj.admin_node("n1"), b'{"url": "http://n1", "capacity": 4}'))
    for seq, (subject, data) in enumerate(inputs, start=2):
        for output in scheduler.apply(Envelope(seq, seq * 1_000_000, subject, data)):
            if output.subject == sj.OUT_REJECTED:
                rejected = msgspec.json.decode(output.data)
                assert rejected["as_of_seq"] == seq and len(rejected["reason"]) <= TEXT_MAX_CHARS


@given(subject=st.sampled_from([f"{p}.{k}" for p in KEYED for k in ("", "a.b", "*", ">", "x" * 300, "é")]))
def test_bad_subject_keys_are_schema_errors(subject: str) -> None:
    assert decode_or_schema_error(subject, b"{}") is None


# -- the collector parsers: text in, a value or ParseError out, nothing else ------------------------

from pathlib import Path  # noqa: E402

from laswrr.collectors.errors import ParseError  # noqa: E402
from laswrr.collectors.faultcodes import fault_table  # noqa: E402
from laswrr.collectors.mindie import parse_metrics_json, parse_status  # noqa: E402
from laswrr.collectors.npu_exporter import chip_health, parse_exporter, to_npu_chip  # noqa: E402
from laswrr.collectors.npu_smi import parse_info  # noqa: E402
from laswrr.collectors.prometheus import parse_engine_metrics  # noqa: E402

_ROOT = Path(__file__).resolve().parents[2]
_ASCEND = _ROOT / "tests" / "fixtures" / "ascend"
_REAL = _ROOT / "tests" / "fixtures" / "real"
_TABLE = fault_table((_ROOT / "collectors" / "faultcodes.toml").read_text(encoding="utf-8"))


def _seeds(directory: Path, pattern: str) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(directory.glob(pattern))]


def _mutated(seeds: list[str]) -> st.SearchStrategy[str]:
    """A seed cut at a random point, with a random slice replaced by random text or numbers."""
    def mutate(seed: str, cut: int, at: int, size: int, junk: str) -> str:
        text = seed[: cut % (len(seed) + 1)]
        start = at % (len(text) + 1)
        return text[:start] + junk + text[start + size:]
    junk = st.one_of(st.text(max_size=12), st.sampled_from(['"', "{", "}", "NaN", "-1", "1e999", "\n", " 0 ", "[[", "null",
                                                             "4294967295", 'id="x"', "\x00"]))
    return st.builds(mutate, st.sampled_from(seeds), st.integers(0, 10**6), st.integers(0, 10**6),
                     st.integers(0, 40), junk)


_PARSERS = {
    "npu-exporter": (lambda t: [to_npu_chip(c, _TABLE, 2) for c in parse_exporter(t, 1764680003.0, 15.0).chips]
                     + [chip_health(c, _TABLE) for c in parse_exporter(t).chips],
                     _seeds(_ASCEND, "npu-exporter_*.txt")),
    "mindie-status": (parse_status, _seeds(_ASCEND, "mindie-status-*.json")),
    "mindie-metrics-json": (parse_metrics_json, _seeds(_ASCEND, "mindie-metrics-json.json")),
    "engine-metrics": (parse_engine_metrics, _seeds(_REAL, "*-metrics_*.txt")),
    "npu-smi-info": (parse_info, _seeds(_REAL, "npu-smi-info_*.txt")),
    "fault-table": (fault_table, [(_ROOT / "collectors" / "faultcodes.toml").read_text(encoding="utf-8")[:4000]]),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.sampled_from(sorted(_PARSERS)))
def test_every_parser_raises_only_parse_error(data: st.DataObject, which: str) -> None:
    parse, seeds = _PARSERS[which]
    text = data.draw(st.one_of(_mutated(seeds), st.text(max_size=300), JSON.map(json.dumps)))
    try:
        parse(text)
    except ParseError as exc:
        assert str(exc)
