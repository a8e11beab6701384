"""The portable log form carries every recorded payload back byte for byte, whatever it is.

A payload that is a JSON value (not a string) travels as JSON; anything else (malformed text, a
bare JSON string, a payload padded with whitespace, an empty one) travels as a JSON string of its
raw text. A JSON string in ``data`` always means raw text, so ``"hello"`` (a JSON string someone
published) and ``hello`` (garbage) stay distinct, and their rejections replay identically.
"""

from __future__ import annotations

import pytest

from laswrr.replay.portable import input_line, read_events, replay_lines
from laswrr.schemas import subjects as sj


@pytest.mark.parametrize("payload", [
    '{"capacity": 1}', '"hello"', "hello", '  {"capacity": 1}', '{"capacity": 1}\n', "", "42", "null",
    "[1, 2]", '"unterminated', '"\\u00e9"', "{\"a\": \"é\"}",
])
def test_every_payload_reads_back_byte_for_byte(payload: str) -> None:
    (envelope,) = read_events([input_line(7, 1_000, "lb.admin.capacity.n1", payload)])
    assert (envelope.seq, envelope.ts_ns, envelope.subject) == (7, 1_000, "lb.admin.capacity.n1")
    assert envelope.data == payload.encode()


def test_a_json_string_and_the_same_text_unquoted_are_different_inputs() -> None:
    quoted = input_line(1, 1, "lb.admin.capacity.n1", '"hello"')
    bare = input_line(1, 1, "lb.admin.capacity.n1", "hello")
    assert quoted != bare
    rejections = [list(replay_lines([line])) for line in (quoted, bare)]
    assert all(sj.OUT_REJECTED.encode() in out[0] for out in rejections)
    assert rejections[0] != rejections[1]  # each rejection quotes what was really published
