"""Hypothesis fuzzing of the KV event decoder and fold (collectors/kv_events.py): bytes in, a batch
or ``ParseError`` out (the service's counted rejection), nothing else; and the fold of whatever
decodes never raises. Seeds: the batches captured from a real vLLM (tests/fixtures/kv_events),
in both encodings, and SGLang's (both of its layouts, built there by make_sglang.py), cut, spliced
with junk, or with a field replaced by a random MessagePack value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laswrr.collectors.errors import ParseError
from laswrr.collectors.kv_events import NodeCache, decode_frames

_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
_SEEDS = [[bytes.fromhex(f) for f in json.loads(line)["frames"]]
          for path in sorted(_FIXTURES.glob("*.jsonl")) for line in path.read_text().splitlines()]
_PAYLOADS = [msgspec.msgpack.decode(frames[2]) for frames in _SEEDS]

VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=12),
                               st.binary(max_size=12),
                               st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"])),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner,
                                                                                            max_size=4)),
                     max_leaves=10)


def _replace(value: Any, path: list[int], new: Any) -> Any:
    """``value`` with the item at a pseudo-random ``path`` (indexes taken modulo) replaced by ``new``."""
    if not path or not isinstance(value, (list, dict)) or not value:
        return new
    if isinstance(value, list):
        i = path[0] % len(value)
        return [_replace(v, path[1:], new) if k == i else v for k, v in enumerate(value)]
    key = list(value)[path[0] % len(value)]
    return {k: _replace(v, path[1:], new) if k == key else v for k, v in value.items()}


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    k = draw(st.integers(0, len(_SEEDS) - 1))
    topic, seq, payload = _SEEDS[k]
    how = draw(st.sampled_from(["field", "cut", "junk", "raw", "frames", "seq"]))
    if how == "field":
        payload = msgspec.msgpack.encode(_replace(_PAYLOADS[k], draw(st.lists(st.integers(0, 2000), max_size=5)),
                                                  draw(VALUE)))
    elif how == "cut":
        payload = payload[: draw(st.integers(0, len(payload)))]
    elif how == "junk":
        at = draw(st.integers(0, len(payload)))
        payload = payload[:at] + draw(st.binary(max_size=16)) + payload[at + draw(st.integers(0, 16)):]
    elif how == "raw":
        payload = draw(st.one_of(st.binary(max_size=200), VALUE.map(msgspec.msgpack.encode)))
    elif how == "seq":
        seq = draw(st.binary(max_size=10))
    else:
        return draw(st.lists(st.binary(max_size=20), max_size=5))
    return [topic, seq, payload]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(frames(), min_size=1, max_size=6))
def test_the_decoder_raises_only_parse_error_and_the_fold_never_raises(messages: list[list[bytes]]) -> None:
    cache = NodeCache()
    for message in messages:
        try:
            batch = decode_frames(message)
        except ParseError as exc:
            assert str(exc)  # a reason to count and log
            continue
        if batch is not None:
            cache.fold(batch)
