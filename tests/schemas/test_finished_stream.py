"""``lb.req.finished``'s ``stream`` (the client's answer is an SSE stream): absent in a log written
before the field, so an old event decodes and encodes to its own bytes; ``first_token_ms`` is the
one rule for a time to first token (none for a whole answer)."""

from __future__ import annotations

import msgspec
import pytest

from laswrr.schemas.codec import decode_event, encode
from laswrr.schemas import subjects as sj
from laswrr.schemas.events import RequestFinished

OLD = (b'{"request_id":"p-b-1","proxy":"p","outcome":"completed","pool":"default","ttft_ms":812.5,'
       b'"duration_ms":812.9,"prompt_tokens":40,"completion_tokens":9,"status":200,"error":null,"ts_ns":null,'
       b'"next_attempt":null,"boot_id":null}')


def test_an_old_event_decodes_to_its_own_bytes_and_keeps_its_ttft() -> None:
    _, event = decode_event(sj.req_finished("n1"), OLD)  # the bus's decoder, as the core reads it
    assert isinstance(event, RequestFinished)
    assert encode(event) == OLD
    assert event.first_token_ms == 812.5  # unknown: as recorded


@pytest.mark.parametrize(("stream", "first_token_ms"), [(True, 812.5), (False, None)])
def test_the_flag_goes_last_and_decides_the_first_token(stream: bool, first_token_ms: float | None) -> None:
    event = msgspec.json.decode(OLD, type=RequestFinished)
    new = encode(msgspec.structs.replace(event, stream=stream))
    assert new == OLD[:-1] + b',"stream":' + (b"true" if stream else b"false") + b"}"
    decoded = msgspec.json.decode(new, type=RequestFinished)
    assert (decoded.stream, decoded.ttft_ms, decoded.first_token_ms) == (stream, 812.5, first_token_ms)


def test_a_flag_that_is_not_a_boolean_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match="stream"):
        msgspec.json.decode(OLD[:-1] + b',"stream":"yes"}', type=RequestFinished)
