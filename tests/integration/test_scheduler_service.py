"""The scheduler service against a real nats-server: round trip, raw `nats pub`-style input,
rejections, restart, active-active replicas. Plus the pure ack-subject parser.

The services run in-process (``SchedulerService`` on the test's loop) with ``tick_ms=0`` where the
test drives time itself by publishing ticks, so outputs are exactly predictable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope
from laswrr.services.natsbus import connect
from laswrr.services.jsreader import envelope_of, parse_ack_subject
from laswrr.services.output_writer import as_of_seq_of
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService, config_changes, tick_number
from laswrr.scheduler.config import SchedulerConfig

# -- the ack subject (pure) -------------------------------------------------------------------------


def test_parse_v1_ack_subject_keeps_integer_nanoseconds() -> None:
    info = parse_ack_subject("$JS.ACK.LB_EVENTS.sched-1.3.42.40.1795975179400989846.7")
    assert (info.stream, info.consumer, info.delivered) == ("LB_EVENTS", "sched-1", 3)
    assert (info.stream_seq, info.consumer_seq, info.pending) == (42, 40, 7)
    assert info.ts_ns == 1795975179400989846  # a float datetime would round the last digits
    assert info.domain is None


@pytest.mark.parametrize("reply", [
    "$JS.ACK.hub.ACCHASH.LB_EVENTS.c.1.42.40.1795975179400989846.0.a1b2c3",  # v2, 12 tokens
    "$JS.ACK.hub.ACCHASH.LB_EVENTS.c.1.42.40.1795975179400989846.0",  # v2 without the random token
])
def test_parse_v2_ack_subject_with_domain(reply: str) -> None:
    info = parse_ack_subject(reply)
    assert (info.domain, info.stream, info.consumer) == ("hub", "LB_EVENTS", "c")
    assert (info.stream_seq, info.consumer_seq, info.ts_ns, info.pending) == (42, 40, 1795975179400989846, 0)


def test_parse_v2_ack_subject_without_domain() -> None:
    assert parse_ack_subject("$JS.ACK._.H.S.c.1.5.5.99.0.x").domain is None


@pytest.mark.parametrize("reply", [
    "", "_INBOX.abc", "$JS.ACK.S.c.1.2.3.4", "$JS.ACK.S.c.1.x.3.4.0", "$JS.NAK.S.c.1.2.3.4.0",
    "$JS.ACK.d.h.S.c.1.2.3.4",  # 10 tokens: neither v1 nor v2
])
def test_parse_rejects_non_ack_subjects(reply: str) -> None:
    with pytest.raises(ValueError):
        parse_ack_subject(reply)


def test_small_helpers() -> None:
    assert as_of_seq_of("17:lb.out.snapshot.default", None) == 17
    assert as_of_seq_of(None, b'{"as_of_seq": 5, "subject": "x", "cause": "unknown_node", "reason": "r"}') == 5
    assert as_of_seq_of(None, b"garbage") == 0
    assert tick_number(1_000_250_000_000, 100_000_000) == 10_002
    wanted = SchedulerConfig(ease_alpha=0.25)
    assert config_changes(SchedulerConfig(), wanted) == {"ease_alpha": 0.25}
    assert config_changes(wanted, wanted) == {}


# -- harness ----------------------------------------------------------------------------------------

RunService = Callable[..., Awaitable[SchedulerService]]


@pytest.fixture
async def run_service(nats_url: str) -> AsyncIterator[Callable[..., Awaitable[tuple[SchedulerService, Callable[[], Awaitable[None]]]]]]:
    """Start a SchedulerService in-process; returns (service, stop coroutine)."""
    running: list[tuple[asyncio.Event, asyncio.Task[None], Client]] = []

    async def start(**options: object) -> tuple[SchedulerService, Callable[[], Awaitable[None]]]:
        nc = await connect(nats_url, "scheduler-under-test")
        opts = SchedulerOptions(**{"tick_ms": 0, "fetch_timeout_s": 0.1, **options})  # type: ignore[arg-type]
        service = SchedulerService(nc, opts)
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        entry = (stop, task, nc)
        running.append(entry)
        await asyncio.wait_for(service.ready.wait(), 10)

        async def halt() -> None:
            stop.set()
            await asyncio.wait_for(task, 10)
            await nc.close()
            running.remove(entry)

        return service, halt

    yield start
    for stop, task, nc in list(running):
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await nc.close()


async def read_stream(js: JetStreamContext, stream: str) -> list[tuple[Envelope, dict[str, str]]]:
    """Every message of a stream, in order, as envelopes (ts from the ack subject) with headers."""
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return []
    sub = await js.pull_subscribe("", stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    found: list[tuple[Envelope, dict[str, str]]] = []
    while len(found) < info.state.messages:
        for msg in await sub.fetch(1000, timeout=2):
            found.append((envelope_of(msg), dict(msg.headers or {})))
    await sub.unsubscribe()
    return found


async def wait_for(predicate: Callable[[], Awaitable[object]], timeout: float = 5.0) -> object:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await predicate()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def outputs_for(js: JetStreamContext, seq: int, subject_prefix: str = "lb.out.") -> list[tuple[str, bytes]]:
    return [(env.subject, env.data) for env, headers in await read_stream(js, sj.OUT_STREAM)
            if headers.get("Nats-Msg-Id", "").startswith(f"{seq}:") and env.subject.startswith(subject_prefix)]


async def kv_snapshot(js: JetStreamContext, pool: str = "default") -> dict[str, object]:
    kv = await js.key_value(sj.WEIGHTS_BUCKET)
    return msgspec.json.decode((await kv.get(pool)).value)  # type: ignore[no-any-return]


def node_view(snapshot: dict[str, object], node: str) -> dict[str, object]:
    return next(n for n in snapshot["nodes"] if n["node"] == node)  # type: ignore[union-attr,index]


async def raw_pub(url: str, subject: str, payload: bytes) -> None:
    """Exactly what `nats pub SUBJECT PAYLOAD` sends: core NATS protocol, no headers."""
    host, port = url.removeprefix("nats://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readline()  # INFO {...}
    writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
    writer.write(b"PUB %s %d\r\n%s\r\nPING\r\n" % (subject.encode(), len(payload), payload))
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), 5)) == b"PONG\r\n"
    writer.close()
    await writer.wait_closed()


REGISTER = b'{"url": "http://127.0.0.1:9001", "pool": "default", "chip": "910B", "capacity": 10}'

# -- round trip -------------------------------------------------------------------------------------


async def test_event_to_snapshot_round_trip(js: JetStreamContext, run_service: RunService) -> None:
    service, _ = await run_service()
    ack = await js.publish("lb.admin.node.n1", REGISTER)
    snapshot = await wait_for(lambda: _kv_at_least(js, ack.seq))
    assert node_view(snapshot, "n1")["capacity"] == 10  # type: ignore[arg-type]
    out = await outputs_for(js, ack.seq)
    assert [s for s, _ in out] == ["lb.out.phase.n1", "lb.out.snapshot.default"]
    kv = await js.key_value(sj.WEIGHTS_BUCKET)
    assert out[1][1] == (await kv.get("default")).value  # the KV holds the published bytes
    tick = await js.publish(sj.CLOCK_TICK, b'{"tick": 1}')
    await wait_for(lambda: _kv_at_least(js, tick.seq))
    assert service.applied_seq == tick.seq


async def _kv_at_least(js: JetStreamContext, seq: int, pool: str = "default") -> dict[str, object] | None:
    with contextlib.suppress(Exception):
        snapshot = await kv_snapshot(js, pool)
        if snapshot["as_of_seq"] >= seq:  # type: ignore[operator]
            return snapshot
    return None


async def test_raw_socket_publish_is_handled_like_a_nats_py_publish(
        js: JetStreamContext, run_service: RunService, nats_url: str) -> None:
    await run_service()
    await js.publish("lb.admin.node.n1", REGISTER)
    await js.publish("lb.admin.node.n2", REGISTER)
    await raw_pub(nats_url, "lb.admin.capacity.n1", b'{"capacity": 1}')
    ack = await js.publish("lb.admin.capacity.n2", b'{"capacity": 1}')
    snapshot = await wait_for(lambda: _kv_at_least(js, ack.seq))
    assert node_view(snapshot, "n1")["capacity"] == 1  # type: ignore[arg-type]
    assert node_view(snapshot, "n2")["capacity"] == 1  # type: ignore[arg-type]
    events = await read_stream(js, sj.EVENTS_STREAM)
    raw, py = events[2], events[3]
    assert raw[0].data == py[0].data == b'{"capacity": 1}' and raw[1] == py[1] == {}
    # Both produced the same kind of output (phase unchanged: just the pool's snapshot).
    assert [s for s, _ in await outputs_for(js, raw[0].seq)] == ["lb.out.snapshot.default"]


BAD_ADMIN = [
    ("lb.admin.capacity.n1", b'{capacity: 1', "not valid JSON"),
    ("lb.admin.capacity.n1", b'{"capacity": -1}', ">= 0"),
    ("lb.admin.capacity.n1", b'{"capacity": 1.5}', "Expected `int`"),
    ("lb.admin.capacity.n1", b'{"capacity": "1"}', "Expected `int`"),
    ("lb.admin.capacity.n1", b"{}", "missing required field `capacity`"),
    ("lb.admin.capacity.ghost", b'{"capacity": 1}', "unknown node 'ghost'"),
    ("lb.admin.drain.ghost", b"", "unknown node 'ghost'"),
    ("lb.admin.node.n2", b'{"capacity": 4}', "missing required field `url`"),
    ("lb.admin.node.n2", b'{"url": "http://x", "capacity": 0}', ">= 1"),
    ("lb.admin.config", b'{"set": {"no_such_key": 1}}', "unknown configuration key"),
]


async def test_each_bad_admin_input_is_rejected_with_a_reason(
        js: JetStreamContext, run_service: RunService, nats_url: str) -> None:
    service, _ = await run_service()
    await js.publish("lb.admin.node.n1", REGISTER)
    for subject, payload, _ in BAD_ADMIN:
        await raw_pub(nats_url, subject, payload)  # what an operator's `nats pub` sends
    good = await js.publish("lb.admin.capacity.n1", b'{"capacity": 3}')
    snapshot = await wait_for(lambda: _kv_at_least(js, good.seq))
    assert node_view(snapshot, "n1")["capacity"] == 3  # type: ignore[arg-type]  # still running
    rejected = [msgspec.json.decode(env.data) for env, _ in await read_stream(js, sj.OUT_STREAM)
                if env.subject == sj.OUT_REJECTED]
    assert [r["as_of_seq"] for r in rejected] == list(range(2, 2 + len(BAD_ADMIN)))
    for record, (subject, _, reason) in zip(rejected, BAD_ADMIN):
        assert record["subject"] == subject
        assert reason in record["reason"], record
    assert service.fold.faults == 0


async def test_a_core_exception_is_rejected_and_acked_not_fatal(
        js: JetStreamContext, run_service: RunService, monkeypatch: pytest.MonkeyPatch) -> None:
    service, _ = await run_service()
    original = Scheduler.apply

    def explode_on_drain(self: Scheduler, envelope: Envelope) -> list[object]:
        if envelope.subject.startswith("lb.admin.drain."):
            raise KeyError("broken invariant")
        return original(self, envelope)  # type: ignore[return-value]

    monkeypatch.setattr(Scheduler, "apply", explode_on_drain)
    await js.publish("lb.admin.node.n1", REGISTER)
    bad = await js.publish("lb.admin.drain.n1", b"{}")
    after = await js.publish("lb.admin.capacity.n1", b'{"capacity": 2}')
    await wait_for(lambda: _kv_at_least(js, after.seq))
    [(subject, data)] = await outputs_for(js, bad.seq)
    assert subject == sj.OUT_REJECTED and b"internal error" in data and b"broken invariant" in data
    assert service.fold.faults == 1


# -- restart and replicas ---------------------------------------------------------------------------


def fold(events: list[tuple[Envelope, dict[str, str]]]) -> tuple[Scheduler, list[tuple[str, bytes, str]]]:
    """A fresh in-process core fed the stream; its outputs as (subject, bytes, msg id)."""
    core = Scheduler()
    outputs = [(o.subject, o.data, o.msg_id) for env, _ in events for o in core.apply(env)]
    return core, outputs


async def publish_workload(js: JetStreamContext, tick0: int) -> int:
    for node, cap in (("a", 10), ("b", 6), ("c", 4)):
        await js.publish(f"lb.admin.node.{node}",
                         b'{"url": "http://%s", "chip": "910B", "capacity": %d}' % (node.encode(), cap))
    await js.publish("lb.req.started.a", b'{"request_id": "r1", "proxy": "p1"}')
    await js.publish("lb.metrics.engine.b", b'{"running": 3, "waiting": 2, "kv_cache_usage": 0.4, "ttft_ms": 80}')
    await js.publish("lb.admin.capacity.c", b'{"capacity": 1}')
    await js.publish("lb.admin.drain.a", b"{}")
    await js.publish("lb.admin.capacity.zz", b'{"capacity": 1}')  # rejected
    last = 0
    for tick in range(tick0, tick0 + 3):
        last = (await js.publish(sj.CLOCK_TICK, b'{"tick": %d}' % tick)).seq
    return last


@pytest.mark.parametrize("use_checkpoint", [True, False])
async def test_restart_rebuilds_identical_state(
        js: JetStreamContext, run_service: RunService, use_checkpoint: bool) -> None:
    first, halt = await run_service(checkpoint_every=4, use_checkpoint=use_checkpoint)
    last = await publish_workload(js, 1)
    await wait_for(lambda: _kv_at_least(js, last))
    await halt()
    while_down = await publish_workload(js, 10)  # the replica was down for these
    second, _ = await run_service(checkpoint_every=4, use_checkpoint=use_checkpoint)
    assert second.publish_floor == last  # outputs up to here were already published
    assert second.applied_seq == while_down  # rebuilt before going live
    tick = await js.publish(sj.CLOCK_TICK, b'{"tick": 20}')
    await wait_for(lambda: _kv_at_least(js, tick.seq))

    events = await read_stream(js, sj.EVENTS_STREAM)
    core, expected = fold(events)
    assert second.scheduler.checkpoint() == core.checkpoint()
    published = [(env.subject, env.data, h["Nats-Msg-Id"]) for env, h in await read_stream(js, sj.OUT_STREAM)]
    assert published == expected  # each output exactly once, byte for byte, including the new tick's
    assert (await kv_snapshot(js))["as_of_seq"] == tick.seq


async def test_configuration_file_is_published_once_as_an_event(
        js: JetStreamContext, run_service: RunService, tmp_path: object) -> None:
    from pathlib import Path

    config = Path(str(tmp_path)) / "scheduler.toml"
    config.write_text("[scheduler]\nease_alpha = 0.25\ndrain_deadline_ms = 5000\n")
    service, halt = await run_service(config_file=str(config))
    events = await wait_for(lambda: _config_events(js))
    assert msgspec.json.decode(events[0].data) == {"set": {"ease_alpha": 0.25, "drain_deadline_ms": 5000}}
    await wait_for(lambda: _applied(service, events[0].seq))
    assert service.scheduler.config.ease_alpha == 0.25
    await halt()
    await run_service(config_file=str(config))  # already in force: not published again
    # ready is set after the start's configuration check (and the ack of what it publishes)
    assert len(await _config_events(js)) == 1


async def _config_events(js: JetStreamContext) -> list[Envelope]:
    return [env for env, _ in await read_stream(js, sj.EVENTS_STREAM) if env.subject == sj.ADMIN_CONFIG]


async def _applied(service: SchedulerService, seq: int) -> bool:
    return service.applied_seq >= seq


async def test_two_replicas_yield_one_output_stream_and_one_tick_per_period(
        js: JetStreamContext, run_service: RunService) -> None:
    a, halt_a = await run_service(tick_ms=50, replica_id="a", tick_keepalive_ms=0)  # every tick, idle or not
    b, halt_b = await run_service(tick_ms=50, replica_id="b", tick_keepalive_ms=0)
    for node in ("a", "b"):
        await js.publish(f"lb.admin.node.{node}", b'{"url": "http://%s", "capacity": 8}' % node.encode())
    await js.publish("lb.admin.capacity.a", b'{"capacity": 2}')
    await js.publish("lb.admin.capacity.a", b'{"capacity": -2}')
    await wait_for(lambda: _ticks_stored(js, 12), timeout=30)  # some 0.6 s of 50 ms periods
    mark = (await js.stream_info(sj.EVENTS_STREAM)).state.last_seq
    await wait_for(lambda: _both_applied(a, b, mark))
    await halt_a()
    await halt_b()

    events = await read_stream(js, sj.EVENTS_STREAM)
    ticks = [msgspec.json.decode(env.data)["tick"] for env, _ in events if env.subject == sj.CLOCK_TICK]
    assert len(ticks) == len(set(ticks)) >= 10  # one tick per 50 ms period, not two
    assert ticks == sorted(ticks) and ticks[-1] - ticks[0] + 1 - len(ticks) <= 3  # few periods missed
    for replica in (a, b):  # each replica's state is the fold of the log up to where it stopped
        assert replica.scheduler.checkpoint() == fold(events[:replica.applied_seq])[0].checkpoint()

    out = [(env.subject, env.data, h["Nats-Msg-Id"]) for env, h in await read_stream(js, sj.OUT_STREAM)]
    per_id = collections.Counter(msg_id for _, _, msg_id in out)
    assert max(per_id.values()) == 1  # de-duplicated: one copy per output
    assert out == fold(events[:max(a.applied_seq, b.applied_seq)])[1]


async def _ticks_stored(js: JetStreamContext, count: int) -> bool:
    return sum(1 for env, _ in await read_stream(js, sj.EVENTS_STREAM) if env.subject == sj.CLOCK_TICK) >= count


async def _both_applied(a: SchedulerService, b: SchedulerService, seq: int) -> bool:
    return a.applied_seq >= seq and b.applied_seq >= seq


async def test_an_idle_scheduler_tries_no_tick_until_an_input_then_ticks_again(
        js: JetStreamContext, run_service: RunService) -> None:
    service, halt = await run_service(tick_ms=50, tick_keepalive_ms=60_000)
    trials: list[int] = []
    try_tick = service.scheduler.tick_changes
    service.scheduler.tick_changes = lambda now_ns: trials.append(now_ns) or try_tick(now_ns)  # type: ignore[method-assign]
    await js.publish("lb.admin.node.a", b'{"url": "http://a", "capacity": 8}')

    async def quiet() -> bool:  # eased to its target: a trial said no tick changes anything until an input
        gate = service._gate  # (during the slow start a trial may say "nothing now", but "ask again next period")
        return gate.quiet is not None and gate.quiet[0] == service.applied_seq and gate.quiet[2] is None

    await wait_for(quiet)
    tried = len(trials)
    await asyncio.sleep(1.0)  # 20 periods, no input, no timer running (no sample, no proxy)
    assert len(trials) == tried  # one trial a period before TickGate
    ack = await js.publish("lb.admin.capacity.a", b'{"capacity": 2}')

    async def ticked_after() -> bool:  # the input wakes the loop: a tick, easing toward the new target
        return any(env.subject == sj.CLOCK_TICK and env.seq > ack.seq for env, _ in await read_stream(js, sj.EVENTS_STREAM))

    await wait_for(ticked_after)  # not the keep-alive's 60 s
    await halt()


async def test_holes_in_a_delivery_are_fetched_with_their_exact_time(js: JetStreamContext, nats_url: str) -> None:
    from nats.aio.msg import Msg

    for capacity in (1, 2, 3):
        await js.publish("lb.admin.capacity.n1", b'{"capacity": %d}' % capacity)
    stored = [env for env, _ in await read_stream(js, sj.EVENTS_STREAM)]
    nc = await connect(nats_url, "scheduler")
    service = SchedulerService(nc, SchedulerOptions(tick_ms=0))

    def delivered(env: Envelope) -> Msg:  # as the server would deliver it (v1 ack subject)
        return Msg(nc, subject=env.subject, data=env.data,
                   reply=f"$JS.ACK.LB_EVENTS.c.1.{env.seq}.{env.seq}.{env.ts_ns}.0")

    got = await service._in_order([delivered(stored[0]), delivered(stored[0]), delivered(stored[2])])
    assert got == stored  # the redelivery dropped, seq 2 fetched directly with the same ts_ns
    await nc.close()


async def test_an_unreadable_checkpoint_means_a_rebuild_from_the_log(
        js: JetStreamContext, run_service: RunService) -> None:
    from laswrr.services.natsbus import ensure_checkpoint_bucket

    await js.publish("lb.admin.node.n1", REGISTER)
    await (await ensure_checkpoint_bucket(js)).put("scheduler", b"\x00garbage")
    service, _ = await run_service()
    assert service.applied_seq == 1 and list(service.scheduler.state.nodes) == ["n1"]
