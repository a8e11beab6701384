"""services/jsreader.py against a real nats-server: both ways to read, a deleted consumer
noticed by both, a recreated durable consumer restarting where it is told."""

from __future__ import annotations

import pytest

from laswrr.schemas import subjects as sj
from laswrr.services.jsreader import ConsumerGone, PullReader, ack_all_consumer, envelope_of
from laswrr.services.natsbus import connect, ensure_streams


async def test_next_batch_and_fetch_read_in_order_and_notice_a_deleted_consumer(nats_url: str) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    for capacity in range(1, 6):
        await js.publish(sj.admin_capacity("n1"), b'{"capacity": %d}' % capacity)

    streaming = PullReader(nc, js, sj.EVENTS_STREAM, batch=2)
    await streaming.open(ack_all_consumer(2, name="streaming"))
    seqs: list[int] = []
    while len(seqs) < 4:
        seqs += [envelope_of(msg).seq for msg in await streaming.next_batch(max_wait_s=1.0, expires_s=0.5)]
    assert seqs == [2, 3, 4, 5]
    await js.delete_consumer(sj.EVENTS_STREAM, "streaming")
    with pytest.raises(ConsumerGone):  # at the latest once the request in flight expired
        for _ in range(30):
            await streaming.next_batch(max_wait_s=0.1, expires_s=0.5)
    await streaming.close(delete_consumer=True)

    batches = PullReader(nc, js, sj.EVENTS_STREAM, batch=3)
    await batches.open(ack_all_consumer(1, durable_name="batches"))
    assert [envelope_of(m).seq for m in await batches.fetch(wait_s=1.0)] == [1, 2, 3]  # full batch
    assert [envelope_of(m).seq for m in await batches.fetch(wait_s=0.2)] == [4, 5]  # flush time
    await js.delete_consumer(sj.EVENTS_STREAM, "batches")
    assert await batches.fetch(wait_s=0.2) == [] and batches.gone is not None
    await batches.open(ack_all_consumer(4, durable_name="batches"))  # recreated where we say
    assert batches.gone is None
    assert [envelope_of(m).seq for m in await batches.fetch(wait_s=0.2)] == [4, 5]
    await nc.close()
