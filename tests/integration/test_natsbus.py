from __future__ import annotations

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
