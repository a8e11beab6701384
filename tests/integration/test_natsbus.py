from __future__ import annotations

import logging
from dataclasses import replace

from laswrr.services.natsbus import connect, ensure_streams
from laswrr.schemas import subjects as sj


async def test_streams_and_bucket_are_created_idempotently(nats_url: str) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    await ensure_streams(js)  # second start-up changes nothing
    ack = await js.publish("lb.admin.capacity.n1", b'{"capacity": 1}')
    assert ack.stream == sj.EVENTS_STREAM
    ack = await js.publish("lb.out.rejected", b"{}")
    assert ack.stream == sj.OUT_STREAM
    kv = await js.key_value(sj.WEIGHTS_BUCKET)
    await kv.put("default", b"{}")
    assert (await kv.get("default")).value == b"{}"
    await nc.close()


async def test_an_operators_limits_are_never_changed_only_warned_about(nats_url: str, caplog) -> None:  # type: ignore[no-untyped-def]
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    with caplog.at_level(logging.WARNING, logger="laswrr.natsbus"):
        await ensure_streams(js)
        await ensure_streams(js)
    assert caplog.records == []  # our own defaults compare equal: no false alarm
    info = await js.stream_info(sj.EVENTS_STREAM)
    await js.update_stream(replace(info.config, max_age=3600.0, subjects=["lb.admin.>"]))  # an operator's edit
    with caplog.at_level(logging.WARNING, logger="laswrr.natsbus"):
        await ensure_streams(js)  # a service starting afterwards
    after = (await js.stream_info(sj.EVENTS_STREAM)).config
    assert after.max_age == 3600.0  # kept
    assert set(sj.EVENTS_SUBJECTS) <= set(after.subjects or [])  # the missing subjects are back
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "max_age = 3600.0" in messages and "left as it is" in messages and "lacks subjects" in messages
    await nc.close()
