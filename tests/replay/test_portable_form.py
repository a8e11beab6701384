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
    b'{"capacity": 1}', b'"hello"', b"hello", b'  {"capacity": 1}', b'{"capacity": 1}\n', b"", b"42", b"null",
    b"[1, 2]", b'"unterminated', b'"\\u00e9"', "{\"a\": \"é\"}".encode(), b'{"a": "\x00"}',
    b'{"capacity": "\xff\xfe"}', b"\xc3", b"\xff" * 3 + b"\x00",
])
def test_every_payload_reads_back_byte_for_byte(payload: bytes) -> None:
    line = input_line(7, 1_000, "lb.admin.capacity.n1", payload)
    (envelope,) = read_events([line])
    assert (envelope.seq, envelope.ts_ns, envelope.subject) == (7, 1_000, "lb.admin.capacity.n1")
    assert envelope.data == payload
    line.decode("utf-8")  # the line itself is always UTF-8 JSON


def test_a_json_string_and_the_same_text_unquoted_are_different_inputs() -> None:
    quoted = input_line(1, 1, "lb.admin.capacity.n1", b'"hello"')
    bare = input_line(1, 1, "lb.admin.capacity.n1", b"hello")
    assert quoted != bare
    rejections = [list(replay_lines([line])) for line in (quoted, bare)]
    assert all(sj.OUT_REJECTED.encode() in out[0] for out in rejections)
    assert rejections[0] != rejections[1]  # each rejection quotes what was really published
