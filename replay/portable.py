"""The portable log form (docs/wire.md): one ``{"seq", "ts_ns", "subject", "data"}`` JSON object
per line, for inputs and outputs alike. ``data`` is the payload as JSON when the payload is a
JSON value other than a string, with no surrounding whitespace; any other payload (not valid JSON,
a bare JSON string, padded with whitespace) is carried as a JSON string of its raw text. A JSON
string in ``data`` therefore always means raw text. A payload that is not UTF-8 (no JSON string
can carry it) has its exact bytes in an extra key ``raw`` (base64), which a reader prefers to
``data`` (then the text with U+FFFD for the bad bytes, for people); every payload reads back
byte for byte.

``input_line`` / ``output_line`` write the form. ``read_events`` yields envelopes, or a
``LineError`` for a line that cannot become one (it is reported with its line number and
becomes a rejection; reading goes on). ``replay_lines`` runs the lines through a fresh core and
yields output lines, byte-identical for identical input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec

from laswrr.replay.store import split_payload
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, encode
from laswrr.schemas.outputs import Rejected
from laswrr.schemas.words import RejectCause


class LogLine(msgspec.Struct, frozen=True, omit_defaults=True):
    seq: int
    ts_ns: int
    subject: str
    data: msgspec.Raw
    raw: bytes | None = None  # base64 in JSON; only for a payload that is not UTF-8


@dataclass(frozen=True)
class LineError:
    line_no: int
    seq: int
    reason: str


_LINE = msgspec.json.Decoder(LogLine)
_STRING = msgspec.json.Decoder(str)


def payload_bytes(raw: bytes) -> bytes:
    """A JSON string carries a payload's raw text; anything else is the payload itself."""
    if raw.startswith(b'"'):
        return _STRING.decode(raw).encode()
    return raw


def read_events(lines: Iterable[bytes]) -> Iterator[Envelope | LineError]:
    last_seq = 0
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = _LINE.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            yield LineError(line_no, last_seq + 1, f"line {line_no}: not a log entry: {exc}")
            last_seq += 1
            continue
        last_seq = entry.seq
        payload = entry.raw if entry.raw is not None else payload_bytes(bytes(entry.data))
        yield Envelope(entry.seq, entry.ts_ns, entry.subject, payload)


def input_line(seq: int, ts_ns: int, subject: str, payload: bytes) -> bytes:
    """One recorded input (its exact payload bytes) as a log line; ``read_events`` reads it back."""
    text, raw = split_payload(payload)
    data = text.encode() if raw is None else b""
    if raw is not None or text[:1] == '"' or text != text.strip() or not _is_json(data):
        data = encode(text)  # carried as a JSON string of its text (module header)
    return encode(LogLine(seq, ts_ns, subject, msgspec.Raw(data), raw)) + b"\n"


def _is_json(data: bytes) -> bool:
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    return True


def output_line(output: Output, ts_ns: int) -> bytes:
    return encode(LogLine(output.as_of_seq, ts_ns, output.subject, msgspec.Raw(output.data))) + b"\n"


def replay_lines(lines: Iterable[bytes], config: SchedulerConfig | None = None,
                 errors: list[LineError] | None = None) -> Iterator[bytes]:
    fold = Fold(config=config)
    scheduler = fold.scheduler
    for item in read_events(lines):
        if isinstance(item, LineError):
            if errors is not None:
                errors.append(item)
            rejected = Rejected(as_of_seq=item.seq, subject="", cause=RejectCause.INVALID_PAYLOAD, reason=item.reason)
            yield output_line(Output(sj.OUT_REJECTED, encode(rejected), item.seq, cause=rejected.cause),
                              scheduler.state.now_ns)
            continue
        for output in fold.apply(item):  # a core exception: the service's rejection
            yield output_line(output, scheduler.state.now_ns)
