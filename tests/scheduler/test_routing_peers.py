"""The channel between proxies, pure (scheduler/routing/peers.py;
docs/proxy.md): a peer's message replaces the snapshot's view of that peer while fresh and newer,
its prefix records steer this proxy to the same node, and a stale or missing peer falls back to
the snapshot's counts, exactly the rule without the channel."""

from __future__ import annotations

import msgspec
import pytest

from laswrr.scheduler.routing.prompt import prompt_text, request_size
from tests.scheduler.routing_help import admit
from laswrr.scheduler.routing.router import DEFAULT_POOL, PEER_STAGGER_S, PEER_STALE_S, Router
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.scheduler.policies.affinity import grid_positions
from laswrr.schemas.peers import PEER_DECODER, PEER_ENCODER, PeerDelta, PeerState, PrefixRecord, pack_keys, unpack_keys
from laswrr.schemas import subjects as sj
from laswrr.schemas.words import Band

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
NODES = ("a", "b", "c", "d")


def view(name: str, inflight: int = 0) -> NodeView:
    return NodeView(node=name, url=f"http://{name}:8000", phase="active", routable=True, capacity=4,
                    target_weight=1000.0, effective_weight=1000.0, inflight=inflight, chip="910B", health=1.0,
                    load=LOAD)


def snap(seq: int, ts_ns: int = 0, inflight: dict[str, int] | None = None,
         proxy_inflight: dict[str, dict[str, int]] | None = None) -> WeightSnapshot:
    counts = inflight or {}
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=seq, tick=seq, ts_ns=ts_ns, panic=False,
                          nodes=[view(n, counts.get(n, 0)) for n in NODES], proxy_inflight=proxy_inflight or {})


def router(proxy: str, share: bool = True) -> Router:
    r = Router("la-swrr", 7 + ord(proxy[0]), proxy_id=proxy, share=share)  # seeded by its id, as proxies are
    r.table.offer(snap(1), now=0.0)
    return r


def ask(r: Router, text: str, done: bool = False) -> str:
    seen = prompt_text([{"role": "user", "content": text}], None)
    admission = admit(r, DEFAULT_POOL, prompt=seen, size=request_size(seen, 16, None))
    assert admission is not None
    if done:
        r.admitter.release(admission)
    return admission.node


def long_prompt(seed: str) -> str:
    return (seed * 4000)[:6000]


def test_a_prompt_admitted_by_a_peer_makes_this_proxy_prefer_the_same_node() -> None:
    a, b = router("A"), router("B")
    node = ask(a, long_prompt("conversation one "))
    state = a.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=10)
    assert state is not None and state.prefixes and state.prefixes[0].node == node
    assert state.inflight == {node: 1} and state.backlog[node] > 1000  # its whole prompt, not prefilled yet
    assert b.channel.receive("A", DEFAULT_POOL, PEER_DECODER.decode(PEER_ENCODER.encode(state)), now=0.01)
    assert b.table.route(DEFAULT_POOL).others == {node: 1} and b.table.load.load == {node: 1}  # A's request counted on B at once
    assert b.table.load.peer_backlog == state.backlog
    # A's request is still prefilling there: B's guard sends the same prompt elsewhere
    assert ask(b, long_prompt("conversation one "), done=True) != node
    # A's request finished: B now goes where A's prefix is
    c, d = router("A"), router("C")
    node = ask(c, long_prompt("conversation two "), done=True)
    state = c.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=10)
    assert state is not None and state.inflight == {} and state.backlog == {}
    d.channel.receive("A", DEFAULT_POOL, state, now=0.0)
    assert ask(d, long_prompt("conversation two ")) == node


def test_without_the_channel_the_other_proxy_does_not_know_the_prefix() -> None:
    picks = set()
    a, b = router("A", share=False), router("B", share=False)
    ask(a, long_prompt("another user "), done=True)  # A has served one request more than B
    for k in range(8):
        first = ask(a, long_prompt(f"conversation {k} "), done=True)
        picks.add(ask(b, long_prompt(f"conversation {k} "), done=True) == first)
    assert picks != {True}  # some conversation lands elsewhere: what the channel fixes
    a, b = router("A"), router("B")
    ask(a, long_prompt("another user "), done=True)
    for k in range(8):
        first = ask(a, long_prompt(f"conversation {k} "), done=True)
        state = a.channel.message(DEFAULT_POOL, "boot", k + 1, ts_ns=k + 1)
        assert state is not None
        b.channel.receive("A", DEFAULT_POOL, state, now=0.0)
        assert ask(b, long_prompt(f"conversation {k} "), done=True) == first


def test_a_stale_or_missing_peer_falls_back_to_the_snapshot_counts() -> None:
    b = router("B")
    b.table.offer(snap(2, ts_ns=5, inflight={"a": 3}, proxy_inflight={"A": {"a": 3}}), now=0.0)
    assert b.table.route(DEFAULT_POOL).others == {"a": 3}  # the snapshot's view of A
    state = PeerState(boot_id="x", seq=1, ts_ns=6, inflight={"c": 2},
                      backlog={"c": 900})
    assert b.channel.receive("A", DEFAULT_POOL, state, now=1.0)
    assert b.table.route(DEFAULT_POOL).others == {"c": 2}  # A's newer message replaces the snapshot's view of A
    assert b.table.load.load == {"c": 2} and b.table.load.peer_backlog == {"c": 900}
    assert b.channel.expire(now=1.0 + PEER_STALE_S / 2) == 0
    assert b.channel.expire(now=1.0 + PEER_STALE_S + 0.01) == 1
    assert b.table.route(DEFAULT_POOL).others == {"a": 3} and b.table.load.load == {"a": 3} and b.table.load.peer_backlog == {}
    # a message older than the snapshot's view of that peer is not used either
    assert b.channel.receive("A", DEFAULT_POOL, PeerState(boot_id="x", seq=2, ts_ns=4, inflight={"c": 2}),
                         now=2.0)
    assert b.table.route(DEFAULT_POOL).others == {"a": 3}


def test_an_older_message_is_ignored_and_a_new_boot_replaces_the_peer() -> None:
    b = router("B")
    assert b.channel.receive("A", DEFAULT_POOL, PeerState(boot_id="1", seq=5, ts_ns=1, inflight={"a": 1}), 0.0)
    assert not b.channel.receive("A", DEFAULT_POOL, PeerState(boot_id="1", seq=4, ts_ns=2,
                                       inflight={"a": 9}), 0.0)
    assert b.table.load.load == {"a": 1}
    assert b.channel.receive("A", DEFAULT_POOL, PeerState(boot_id="2", seq=1, ts_ns=3, inflight={"b": 1}), 0.0)
    assert b.table.load.load == {"b": 1}
    assert not b.channel.receive("B", DEFAULT_POOL, PeerState(boot_id="9", seq=1, ts_ns=3), 0.0)  # its own
    assert not b.channel.receive("A", "other", PeerState(boot_id="2", seq=2, ts_ns=3), 0.0)  # unknown pool


def test_prefix_records_are_capped_newest_first() -> None:
    a = Router("la-swrr", 7, proxy_id="A", share=True, peer_max_keys=20, peer_grid=0)  # every key told
    a.table.offer(snap(1), now=0.0)
    for k in range(4):
        ask(a, long_prompt(f"prompt {k} "))  # 11 keys each (6000 chars / 512)
    state = a.channel.message(DEFAULT_POOL, "b", 1, 1)
    assert state is not None
    assert [r.count for r in state.prefixes] == [9, 11]  # the newest whole, the one before cut to its lead
    again = a.channel.message(DEFAULT_POOL, "b", 2, 2)
    assert again is not None and again.prefixes == [] and not a.channel.changed


def test_one_proxy_without_the_channel_is_unchanged() -> None:
    texts = [long_prompt(f"c{k % 5} ") for k in range(40)]
    plain, shared = Router("la-swrr", 3, proxy_id="A"), Router("la-swrr", 3, proxy_id="A", share=True)
    for r in (plain, shared):
        r.table.offer(snap(1), now=0.0)
    assert [ask(plain, t) for t in texts] == [ask(shared, t) for t in texts]


def test_the_subject_and_the_record_encoding() -> None:
    assert sj.peer("default", "proxy-1") == "lb.peer.default.proxy-1"
    assert sj.peer_of("lb.peer.default.proxy-1") == ("default", "proxy-1")
    assert [sj.peer_of(x) for x in ("lb.peer.default", "lb.peer.a.b.c", "lb.req.a.b", "lb.peer..p")] == [None] * 4
    data = PEER_ENCODER.encode(PeerState(boot_id="b", seq=1, ts_ns=2, prefixes=[PrefixRecord("a", pack_keys([1, 2]))]))
    # MessagePack arrays led by the kind, no field names; the keys packed 4 bytes each
    assert msgspec.msgpack.decode(data) == [1, "b", 1, 2, {}, {}, {}, {}, [["a", b"\x01\x00\x00\x00\x02\x00\x00\x00"]]]
    assert len(PEER_ENCODER.encode(PeerState(boot_id="b", seq=1, ts_ns=2))) == 11  # 1 + 1 + 2 + 1 + 1 + 4 + 1
    assert unpack_keys(PEER_DECODER.decode(data).prefixes[0].keys) == [1, 2]  # type: ignore[union-attr]
    delta = PEER_ENCODER.encode(PeerDelta(seq=300, ts_ns=1_700_000_000_000_000_000, inflight={"n1": 1}))
    assert msgspec.msgpack.decode(delta) == [2, 300, 1_700_000_000_000_000_000, {"n1": 1}, {}, []]
    assert len(delta) == 21  # 1 + 1 + 3 + 9 + (1 + 3 + 1) + 1 + 1
    assert PEER_DECODER.decode(delta) == PeerDelta(seq=300, ts_ns=1_700_000_000_000_000_000, inflight={"n1": 1})


def test_changes_between_whole_views_give_the_peers_the_same_counts() -> None:
    """After the first message, A tells only what changed (picks, first bytes, releases); B,
    taking the changes, holds what C holds taking A's whole view each time. A missed change makes
    B ignore the next ones until the next whole view, which mends it."""
    a, b, c = router("A"), router("B"), router("C")
    texts = [long_prompt(f"talk {k % 3} ") for k in range(12)]
    live = []
    kinds = []
    for step, text in enumerate(texts):
        seen = prompt_text([{"role": "user", "content": text}], None)
        admission = admit(a, DEFAULT_POOL, prompt=seen, size=request_size(seen, 16, None))
        assert admission is not None
        live.append(admission)
        if step % 3 == 1:
            a.admitter.prefilled(live[0])
        if step % 4 == 3:
            a.admitter.release(live.pop(0))
        changes = a.channel.message(DEFAULT_POOL, "boot", step + 1, ts_ns=step + 1)
        assert changes is not None
        kinds.append(type(changes).__name__)
        whole = PeerState(boot_id="boot", seq=step + 1, ts_ns=step + 1, inflight=dict(a.table.load.own),
                          backlog=dict(a.table.load.backlog))
        assert b.channel.receive("A", DEFAULT_POOL, PEER_DECODER.decode(PEER_ENCODER.encode(changes)), now=0.0)
        assert c.channel.receive("A", DEFAULT_POOL, whole, now=0.0)
        assert b.table.load.load == c.table.load.load == a.table.load.load and b.table.load.peer_backlog == c.table.load.peer_backlog == a.table.load.backlog
        assert b.table.route(DEFAULT_POOL).others == c.table.route(DEFAULT_POOL).others
    assert kinds == ["PeerState"] + ["PeerDelta"] * 11
    ask(a, "x")
    missed = a.channel.message(DEFAULT_POOL, "boot", 13, ts_ns=13)  # never reaches B
    assert isinstance(missed, PeerDelta)
    ask(a, "y")
    later = a.channel.message(DEFAULT_POOL, "boot", 14, ts_ns=14)
    assert isinstance(later, PeerDelta) and not b.channel.receive("A", DEFAULT_POOL, later, now=0.0)
    assert b.table.load.load != a.table.load.load
    heartbeat = a.channel.message(DEFAULT_POOL, "boot", 15, ts_ns=15, full=True)
    assert isinstance(heartbeat, PeerState) and b.channel.receive("A", DEFAULT_POOL, heartbeat, now=0.0)
    assert b.table.load.load == a.table.load.load and b.table.load.peer_backlog == a.table.load.backlog
    assert b.channel.receive("A", DEFAULT_POOL, a.channel.message(DEFAULT_POOL, "boot", 16, ts_ns=16), now=0.0)  # type: ignore[arg-type]


def test_records_never_sent_stay_bounded() -> None:
    a = Router("la-swrr", 7, proxy_id="A", share=True, peer_max_keys=5)
    a.table.offer(snap(1), now=0.0)
    for k in range(40):  # NATS away: nobody calls peer_message
        ask(a, long_prompt(f"prompt {k} "), done=True)
    assert len(a.table.route(DEFAULT_POOL).outbox) == 5


def test_held_counts_travel_and_the_free_slots_are_the_pool_wide_ones() -> None:
    a, b = router("A"), router("B")
    limited = WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=2, tick=2, ts_ns=0, panic=False,
                             nodes=[msgspec.structs.replace(view(n), concurrency_limit=2) for n in NODES])
    a.table.offer(limited, now=0.0)
    b.table.offer(limited, now=0.0)
    assert b.admitter.free_slots(DEFAULT_POOL) == 8 and b.admitter.free_slots("nowhere") == 0
    wide = WeightSnapshot(pool="wide", as_of_seq=2, tick=2, ts_ns=0, panic=False,
                          nodes=[msgspec.structs.replace(view(n), concurrency_limit=10) for n in NODES])
    b.table.offer(wide, now=0.0)
    assert (b.admitter.free_slots("wide"), b.admitter.free_slots("wide", reserve=0.1)) == (40, 36)  # 9 of each 10 outside the reserve
    a.channel.changed.clear()
    a.channel.note_held(DEFAULT_POOL, {Band.INTERACTIVE: 2, Band.BATCH: 7}, {Band.INTERACTIVE: 40, Band.BATCH: 900})
    assert DEFAULT_POOL in a.channel.changed  # a changed count goes out within one interval
    for _ in range(3):
        ask(a, "x")
    state = a.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=10)
    assert state is not None and state.held == {"interactive": 2, "batch": 7}
    assert state.held_oldest_ms == {"interactive": 40, "batch": 900}
    a.channel.note_held(DEFAULT_POOL, {Band.INTERACTIVE: 2, Band.BATCH: 7}, {Band.INTERACTIVE: 60, Band.BATCH: 950})
    assert DEFAULT_POOL not in a.channel.changed  # only the ages moved: the next message or heartbeat carries them
    assert b.channel.receive("A", DEFAULT_POOL, PEER_DECODER.decode(PEER_ENCODER.encode(state)), now=0.01)
    assert b.channel.peer_held(DEFAULT_POOL) == {"interactive": 2, "batch": 7}
    assert all(type(band) is Band for band in b.channel.peer_held(DEFAULT_POOL))  # decoded as the enum
    unknown = PEER_ENCODER.encode(msgspec.structs.replace(state, held={"urgent": 1}))  # type: ignore[dict-item]
    with pytest.raises(msgspec.ValidationError):  # a band this proxy does not know: a bad message (skipped)
        PEER_DECODER.decode(unknown)
    assert b.admitter.free_slots(DEFAULT_POOL) == 5  # A's three requests, counted through its message
    a.channel.note_held(DEFAULT_POOL, {}, {})
    assert DEFAULT_POOL in a.channel.changed and a.channel.message(DEFAULT_POOL, "boot-a", 2, ts_ns=20).held == {}  # type: ignore[union-attr]
    b.channel.expire(now=0.01 + PEER_STALE_S + 0.1)
    assert b.channel.peer_held(DEFAULT_POOL) == {}  # a silent peer's held requests are forgotten with it
    unlimited = WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=3, tick=3, ts_ns=0, panic=False, nodes=[view("a")])
    b.table.offer(unlimited, now=0.02)
    assert b.admitter.free_slots(DEFAULT_POOL) is None  # a node without a slot limit: never saturated


def test_grid_positions() -> None:
    assert grid_positions(100, 16) == (0, 1, 3, 7, 15, 31, 47, 63, 79, 95)
    assert grid_positions(3, 16) == (0, 1)
    assert grid_positions(0, 16) == ()


def test_a_peer_tells_a_few_keys_of_a_long_prompt_and_its_continuation_follows_them() -> None:
    a, b = router("A"), router("B")
    first = (long_prompt("a long conversation ") * 6)[:30000]  # 58 blocks
    node = ask(a, first, done=True)
    state = a.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=10)
    assert state is not None and [r.count for r in state.prefixes] == [7]  # blocks 0, 1, 3, 7, 15, 31, 47
    assert b.channel.receive("A", DEFAULT_POOL, PEER_DECODER.decode(PEER_ENCODER.encode(state)), now=0.01)
    index = b.table.route(DEFAULT_POOL).index
    assert index is not None and index.grid == 16
    keys = index.keys(prompt_text([{"role": "user", "content": first + " and the next turn"}], None))
    preferred, depth, floor = index.match(keys, list(NODES))
    assert preferred == [node] and depth == {node: 48} and floor == 0  # the deepest grid key held: block 47
    assert ask(b, first + " and the next turn") == node
    # the same prompt again through A: the node holds it already, nothing more to tell
    ask(a, first, done=True)
    again = a.channel.message(DEFAULT_POOL, "boot-a", 2, ts_ns=11)
    assert again is not None and again.prefixes == []


def test_a_record_with_torn_keys_is_a_hint_lost() -> None:
    b = router("B")
    bad = PeerState(boot_id="x", seq=1, ts_ns=1, inflight={"a": 1},
                    prefixes=[PrefixRecord("a", b"\x01\x02\x03")])
    assert b.channel.receive("A", DEFAULT_POOL, bad, now=0.0) and b.table.load.load == {"a": 1}
    index = b.table.route(DEFAULT_POOL).index
    assert index is not None and index.entries() == 0


def test_a_peer_new_to_this_proxy_gets_its_whole_view_next() -> None:
    """A proxy that started (or restarted) after this one missed its last whole view: hearing
    its first one, this proxy's next message, due within one interval, is whole again."""
    a, b = router("A"), router("B")
    ask(b, "x")
    assert isinstance(b.channel.message(DEFAULT_POOL, "boot-b", 1, ts_ns=1), PeerState)
    ask(b, "y")
    assert isinstance(b.channel.message(DEFAULT_POOL, "boot-b", 2, ts_ns=2), PeerDelta)
    assert DEFAULT_POOL not in b.channel.changed
    first = a.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=3)
    assert isinstance(first, PeerState) and b.channel.receive("A", DEFAULT_POOL, first, now=0.0)
    assert DEFAULT_POOL in b.channel.changed and b.channel.due(DEFAULT_POOL, now=0.0)
    whole = b.channel.message(DEFAULT_POOL, "boot-b", 3, ts_ns=4)
    assert isinstance(whole, PeerState) and whole.inflight == b.table.load.own
    # its next message from the same boot is news, not a new peer
    ask(a, "z")
    assert b.channel.receive("A", DEFAULT_POOL, a.channel.message(DEFAULT_POOL, "boot-a", 2, ts_ns=5), now=0.0)  # type: ignore[arg-type]
    assert DEFAULT_POOL not in b.channel.changed
    # A restarts: a new boot
    restarted = router("A").channel.message(DEFAULT_POOL, "boot-a2", 1, ts_ns=6)
    assert isinstance(restarted, PeerState) and b.channel.receive("A", DEFAULT_POOL, restarted, now=0.0)
    assert isinstance(b.channel.message(DEFAULT_POOL, "boot-b", 4, ts_ns=7), PeerState)


def test_a_proxy_that_hears_no_peer_tells_nobody_but_its_heartbeat() -> None:
    """Alone, a proxy sends its first whole view and then only its heartbeat: no message per pick,
    first byte or release. Once it hears a peer, every pick is told at once again."""
    a = router("A")
    channel = a.channel
    assert channel is not None
    ask(a, "first", done=True)
    assert channel.picks() == [DEFAULT_POOL]  # its first whole view: a peer that starts later hears of it
    assert isinstance(channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=1), PeerState)
    channel.sent(DEFAULT_POOL, PeerState(boot_id="boot-a", seq=1, ts_ns=1), now=0.0)
    for k in range(5):
        ask(a, f"alone {k}", done=True)
    assert channel.picks() == [] and DEFAULT_POOL in channel.changed
    assert not channel.due(DEFAULT_POOL, now=0.1)  # changed, but nobody to tell
    assert channel.due(DEFAULT_POOL, now=PEER_STALE_S / 2)  # the heartbeat
    b = router("B")
    assert channel.receive("B", DEFAULT_POOL, b.channel.message(DEFAULT_POOL, "boot-b", 1, ts_ns=2), now=0.0)  # type: ignore[arg-type, union-attr]
    assert channel.due(DEFAULT_POOL, now=0.0)  # B is new: A's whole view within one interval
    ask(a, "heard", done=True)
    assert channel.picks() == [DEFAULT_POOL]


def test_a_proxy_alone_looks_again_at_its_heartbeat_and_every_interval_once_it_hears_a_peer() -> None:
    """PeerChannel.next_due: the shell's interval loop rests while nothing can be due."""
    a = router("A")
    channel = a.channel
    assert channel is not None
    assert channel.next_due(now=5.0, interval=0.02) == pytest.approx(5.02)  # its first whole view is due
    channel.sent(DEFAULT_POOL, PeerState(boot_id="boot-a", seq=1, ts_ns=1), now=5.0)
    ask(a, "alone", done=True)  # changed, but nobody to tell
    assert channel.next_due(now=5.1, interval=0.02) == 5.0 + PEER_STALE_S / 2  # the heartbeat
    assert channel.next_due(now=5.0 + PEER_STALE_S / 2, interval=0.02) == pytest.approx(5.02 + PEER_STALE_S / 2)
    b = router("B")
    assert channel.receive("B", DEFAULT_POOL, b.channel.message(DEFAULT_POOL, "boot-b", 1, ts_ns=2), now=5.2)  # type: ignore[arg-type, union-attr]
    assert channel.next_due(now=5.3, interval=0.02) == pytest.approx(5.32)  # a peer: every interval again
    assert channel.expire(now=5.3 + PEER_STALE_S) == 1  # B silent: alone again, its heartbeat overdue
    assert channel.next_due(now=5.3 + PEER_STALE_S, interval=0.02) == pytest.approx(5.32 + PEER_STALE_S)


def test_a_heartbeat_to_nobody_carries_no_prefix_records() -> None:
    a = router("A")
    ask(a, long_prompt("first "))
    first = a.channel.message(DEFAULT_POOL, "boot-a", 1, ts_ns=1)
    assert first is not None and first.prefixes  # the first whole view: a later peer may hear it
    ask(a, long_prompt("second "))
    beat = a.channel.message(DEFAULT_POOL, "boot-a", 2, ts_ns=2, full=True)
    assert isinstance(beat, PeerState) and beat.prefixes == [] and not a.table.route(DEFAULT_POOL).outbox


def test_a_proxy_waits_before_a_pick_by_its_rank_among_the_proxies_it_hears() -> None:
    """Router.stagger_s: replicas that take one burst between them pick in turn, by proxy id."""
    names = ("A", "B", "C", "D", "E")
    routers = [router(name) for name in names]
    assert routers[0].stagger_s(DEFAULT_POOL) == routers[1].stagger_s(DEFAULT_POOL) == 0.0  # alone: no wait
    for me in routers:
        for other in names:
            if other != me.table.proxy_id:
                assert me.channel.receive(other, DEFAULT_POOL, PeerState(boot_id=other, seq=1, ts_ns=1), now=0.0)
    step = PEER_STAGGER_S
    assert [r.stagger_s(DEFAULT_POOL) for r in routers] == [0.0, step, 2 * step, 3 * step, 3 * step]  # at most 3 turns
    c = routers[2]
    c.first_byte(0.15)  # requests answered in 150 ms: 3 turns at most a tenth of it, 5 ms each
    assert c.stagger_s(DEFAULT_POOL) == pytest.approx(2 * 0.005)
    for _ in range(200):
        c.first_byte(0.003)  # requests answered in 3 ms: a turn of 0.1 ms is none
    assert c.stagger_s(DEFAULT_POOL) == 0.0 and c.channel.first_byte_s is not None and c.channel.first_byte_s < 0.004
    c.channel.first_byte_s = None
    assert c.stagger_s("other pool") == 0.0
    assert c.channel.expire(now=PEER_STALE_S + 1) == 4 and c.stagger_s(DEFAULT_POOL) == 0.0  # its peers went silent
    off = Router("la-swrr", 1, proxy_id="C", share=True, peer_stagger_s=0.0)
    off.table.offer(snap(1), now=0.0)
    off.channel.receive("A", DEFAULT_POOL, PeerState(boot_id="A", seq=1, ts_ns=1), now=0.0)
    assert off.stagger_s(DEFAULT_POOL) == 0.0
    assert router("C", share=False).stagger_s(DEFAULT_POOL) == 0.0  # without the channel
