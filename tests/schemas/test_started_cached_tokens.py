"""``lb.req.started``'s ``cached_tokens`` (the router's predicted cache hit on the node picked):
absent when unknown, so an event without it keeps its bytes, and an old log decodes."""

from __future__ import annotations

import msgspec

from laswrr.schemas.events import RequestStarted


def test_cached_tokens_is_absent_when_unknown_and_last_when_known() -> None:
    old = (b'{"request_id":"p-b-1","proxy":"p","pool":"default","snapshot_seq":3,"ts_ns":null,"boot_id":null,'
           b'"prompt_tokens":40,"max_tokens":null,"key_name":null}')
    event = msgspec.json.decode(old, type=RequestStarted)
    assert msgspec.json.encode(event) == old  # an old event decodes and encodes to its own bytes
    new = msgspec.json.encode(msgspec.structs.replace(event, cached_tokens=256))
    assert new == old[:-1] + b',"cached_tokens":256}'
    assert msgspec.json.decode(new, type=RequestStarted).cached_tokens == 256
