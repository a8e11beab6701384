"""The channel between proxies on real processes around them (a real nats-server, real echo
engines, two proxies): a prompt admitted through proxy A makes proxy B prefer the same node for
the same prefix; with the channel off B does not know it; a peer gone silent is dropped after
``--peer-stale-ms`` and B routes on the snapshot's counts again, today's rule."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from proxy_support import CoreDriver, StartProxy, wait_for, wait_seq
from laswrr.scheduler.routing.prompt import prompt_text
from laswrr.scheduler.routing.router import others_inflight

CHAT = "/v1/chat/completions"
NODES = ("a", "b", "c", "d")


def conversation(k: int) -> str:
    return (f"conversation {k}: the user pastes a long document. " * 200)[:6000]


async def ask(http: aiohttp.ClientSession, url: str, text: str, test: dict[str, Any] | None = None) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "test": test or {"chunks": 1}}
    async with http.post(url + CHAT, json=body) as response:
        assert response.status == 200
        await response.read()
        return response.headers["x-laswrr-node"]


async def two_proxies(engines: Any, core: CoreDriver, start_proxy: StartProxy, interval_ms: int,
                      stale_ms: int = 500) -> tuple[Any, Any]:
    for name in NODES:
        seq = await core.register(name, (await engines(name)).url)
    a = await start_proxy(proxy_id="proxy-a", peer_interval_ms=interval_ms, peer_stale_ms=stale_ms)
    b = await start_proxy(proxy_id="proxy-b", peer_interval_ms=interval_ms, peer_stale_ms=stale_ms)
    for proxy in (a, b):
        await wait_seq(proxy, "default", seq)
    return a, b


async def test_a_prompt_admitted_through_one_proxy_steers_the_other_to_the_same_node(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=20)
    await wait_for(lambda: "proxy-a" in b.state.router.table.route("default").peers, what="B hears A's heartbeat")
    kept = []
    for k in range(6):
        first = await ask(http, a.url, conversation(k))
        index = b.state.router.table.route("default").index
        assert index is not None
        keys = index.keys(prompt_text([{"role": "user", "content": conversation(k)}], None))
        await wait_for(lambda: first in index.depths(keys, [first]) and index.depths(keys, [first])[first] > 0,
                       what="B's index holds A's prefix")
        peers = b.state.router.table.route("default").peers
        await wait_for(lambda: not peers["proxy-a"].inflight and not peers["proxy-a"].backlog,
                       what="B hears A's request end (its backlog there would hold B off: the guard)")
        kept.append(await ask(http, b.url, conversation(k)) == first)
    assert kept == [True] * 6
    assert b.state.bus.peers.peer_received > 0 and a.state.bus.peers.peer_sent > 0


async def test_without_the_channel_the_other_proxy_goes_elsewhere(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=0)
    kept = [await ask(http, b.url, conversation(k)) == await ask(http, a.url, conversation(k)) for k in range(6)]
    assert not all(kept) and b.state.router.table.route("default").peers == {}


async def test_a_silent_peer_is_dropped_and_routing_falls_back_to_the_snapshot(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=20, stale_ms=300)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "test": {"chunks": 400, "delay": 0.05}}
    route = b.state.router.table.route("default")
    async with http.post(a.url + CHAT, json=body) as stream:
        node = stream.headers["x-laswrr-node"]
        await wait_for(lambda: route.others.get(node) == 1, what="B counts A's stream on its node")
        assert b.state.router.table.load.load.get(node) == 1  # the snapshot (no events consumed here) says 0
        assert a.state.bus.nc is not None
        await a.state.bus.nc.close()  # A falls silent on the bus (its stream goes on)
        await wait_for(lambda: "proxy-a" not in route.peers, timeout=5, what="B drops the silent peer")
        assert route.others == others_inflight(route.snapshot, "proxy-b")  # exactly the snapshot's rule
        assert b.state.router.table.load.load.get(node) is None
        assert b.state.router.table.load.peer_backlog == {}
        stream.close()


async def test_a_pick_reaches_the_peer_at_once_not_an_interval_later(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    # an interval and a heartbeat far beyond the test: only the message sent at the pick can tell B
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=60_000, stale_ms=600_000)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "test": {"chunks": 400, "delay": 0.05}}
    route = b.state.router.table.route("default")
    async with http.post(a.url + CHAT, json=body) as stream:
        node = stream.headers["x-laswrr-node"]
        await wait_for(lambda: route.others.get(node) == 1, timeout=5, what="B counts A's stream at its pick")
        assert a.state.bus.peers.peer_sent >= 1
        stream.close()


async def test_the_picks_of_a_window_reach_the_peer_in_one_message(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """``--peer-pick-ms``: A tells its picks that long after the first of them, all in one message.
    Six streams opened one after the other through A, each admitted in its own turn of the event
    loop (with the window at 0 each is a message of its own), reach B as one message (a window of
    1 s here, so that a loaded machine still admits all six within it), and B counts all six."""
    for name in NODES:
        seq = await core.register(name, (await engines(name)).url)
    # A's interval far beyond the test: only a message sent for the picks can tell B
    a = await start_proxy(proxy_id="proxy-a", peer_interval_ms=60_000, peer_stale_ms=600_000, peer_pick_ms=1000)
    b = await start_proxy(proxy_id="proxy-b", peer_interval_ms=20, peer_stale_ms=600_000)
    for proxy in (a, b):
        await wait_seq(proxy, "default", seq)
    await wait_for(lambda: "proxy-b" in a.state.router.table.route("default").peers, what="A hears B")
    sent = a.state.bus.peers.peer_sent
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "test": {"chunks": 400, "delay": 0.05}}
    streams = []
    try:
        for _ in range(6):
            streams.append(await http.post(a.url + CHAT, json=body))
        assert sum(a.state.router.table.load.own.values()) == 6
        peers = b.state.router.table.route("default").peers
        await wait_for(lambda: "proxy-a" in peers and sum(peers["proxy-a"].inflight.values()) == 6, timeout=5,
                       what="B counts A's six streams")
        assert a.state.bus.peers.peer_sent - sent == 1
    finally:
        for stream in streams:
            stream.close()


IN_FLIGHT = 5  # B's messages that may be on their way to A when the counts are read


async def test_a_proxy_is_not_sent_back_its_own_peer_messages(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """Every pick is published within --peer-pick-ms on lb.peer.<pool>.<proxy>; the proxy's
    connection is ``no_echo``, so NATS never delivers those back to it to decode and drop (one wasted delivery
    and decode per request before). The other proxy hears each of them."""
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=20)
    await wait_for(lambda: "proxy-a" in b.state.router.table.route("default").peers, what="B hears A")
    await wait_for(lambda: "proxy-b" in a.state.router.table.route("default").peers, what="A hears B")
    a_heard, b_heard, b_sent = a.state.bus.peers.peer_heard, b.state.bus.peers.peer_heard, b.state.bus.peers.peer_sent
    for k in range(20):
        await ask(http, a.url, conversation(k))
    await wait_for(lambda: b.state.bus.peers.peer_heard - b_heard >= 20, what="B hears A's 20 picks")
    assert a.state.bus.peers.peer_sent >= 20
    # A hears only what B sent (its heartbeats, a message every half --peer-stale-ms), none of its
    # own 20 picks, however long the asks took. B sends every 20 ms, so a few of its messages may be
    # on their way to A at either count (counted sent at the start and heard after it: a CI run saw 1):
    # a slack of IN_FLIGHT, well below the 20 an echo of A's own picks would add
    assert a.state.bus.peers.peer_heard - a_heard <= b.state.bus.peers.peer_sent - b_sent + IN_FLIGHT


async def test_the_peer_follows_the_counts_through_changes_only(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """After its first whole view, A tells B only what changed (schemas.peers ``PeerDelta``): B's
    count of A's requests follows A's own through picks, first bytes and releases, to zero."""
    a, b = await two_proxies(engines, core, start_proxy, interval_ms=20, stale_ms=600_000)
    await wait_for(lambda: "proxy-a" in b.state.router.table.route("default").peers, what="B hears A")
    await wait_for(lambda: "proxy-b" in a.state.router.table.route("default").peers, what="A hears B")
    # hearing B, A sent B its whole view again (B may have missed its first): wait until it went
    await wait_for(lambda: "default" not in a.state.router.channel.changed, what="A's whole view to B sent")
    whole = a.state.bus.peers.peer_sent_whole
    sent = a.state.bus.peers.peer_sent
    peer = b.state.router.table.route("default").peers

    def b_sees_a() -> bool:
        return peer["proxy-a"].inflight == a.state.router.table.load.own and \
            peer["proxy-a"].backlog == a.state.router.table.load.backlog

    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "test": {"chunks": 6, "delay": 0.05}}
    streams = [await http.post(a.url + CHAT, json=body) for _ in range(6)]
    assert sum(a.state.router.table.load.own.values()) == 6
    await wait_for(b_sees_a, timeout=5, what="B counts A's 6 streams")
    for stream in streams:
        await stream.read()
        stream.close()
    await wait_for(lambda: not a.state.router.table.load.own and b_sees_a() and not peer["proxy-a"].inflight,
                   timeout=5, what="B sees A idle")
    assert a.state.bus.peers.peer_sent - sent >= 2 and a.state.bus.peers.peer_sent_whole == whole  # changes only
    async with http.get(a.url + "/metrics") as resp:
        text = await resp.text()
    assert f'laswrr_proxy_peer_messages_total{{kind="whole"}} {float(whole)}' in text
    assert f'laswrr_proxy_peer_messages_total{{kind="changes"}} {float(a.state.bus.peers.peer_sent - whole)}' in text
    assert f"laswrr_proxy_peer_bytes_total {float(a.state.bus.peers.peer_sent_bytes)}" in text
    # B took A's messages: each one's age then is in B's laswrr_proxy_peer_lag_seconds (one clock
    # here, so the bus's delivery time), one observation a message, none of them negative
    lag = b.state.bus.peers.peer_lag
    assert lag.count >= a.state.bus.peers.peer_sent - sent and lag.total >= 0
    async with http.get(b.url + "/metrics") as resp:
        text = await resp.text()
    assert f"laswrr_proxy_peer_lag_seconds_count {float(lag.count)}" in text


async def test_a_proxy_alone_sends_only_its_heartbeat(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """Nobody listens to a single proxy: past its first whole view it sends a heartbeat a second,
    not a message per pick, first byte and release."""
    for name in NODES:
        seq = await core.register(name, (await engines(name)).url)
    alone = await start_proxy(proxy_id="proxy-a", peer_interval_ms=20, peer_stale_ms=2000)
    await wait_seq(alone, "default", seq)
    for k in range(20):
        await ask(http, alone.url, conversation(k))
    bus = alone.state.bus
    assert bus.peers.peer_sent <= 4 and bus.peers.peer_sent == bus.peers.peer_sent_whole, (bus.peers.peer_sent, bus.peers.peer_sent_whole)


async def test_a_proxy_alone_rests_its_peer_loop_until_a_peer_speaks(
        engines: Any, core: CoreDriver, start_proxy: StartProxy) -> None:
    """With no peer heard, the interval loop wakes for its heartbeat (1 s), not every 20 ms; a
    second proxy's first message wakes it, and the two hear each other."""
    for name in NODES:
        seq = await core.register(name, (await engines(name)).url)
    a = await start_proxy(proxy_id="proxy-a", peer_interval_ms=20, peer_stale_ms=2000)
    await wait_seq(a, "default", seq)
    channel = a.state.bus.peers.channel
    looks = 0
    expire = channel.expire

    def counted(now: float) -> int:
        nonlocal looks
        looks += 1
        return expire(now)

    channel.expire = counted  # type: ignore[method-assign]
    await asyncio.sleep(2.0)
    assert looks <= 4, looks  # 100 at one a 20 ms interval
    b = await start_proxy(proxy_id="proxy-b", peer_interval_ms=20, peer_stale_ms=2000)
    await wait_for(lambda: "proxy-b" in a.state.router.table.route("default").peers, what="A hears B")
    await wait_for(lambda: "proxy-a" in b.state.router.table.route("default").peers, what="B hears A")
    heard = looks  # a peer heard: every interval again (10 looks take 0.2 s; resting, 10 s)
    await wait_for(lambda: looks - heard >= 10, timeout=3.0, what="the loop wakes every interval again")


async def test_a_proxy_ranked_after_another_picks_after_hearing_its_pick(
        engines: Any, core: CoreDriver, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    """``--peer-stagger-ms``: before each pick a proxy waits its rank among the proxies it hears
    (by id) times it, so B picks a request that arrived with three at A after A's picks reached
    B: it sends it to the one node of four A left free (without the wait: one of its own turn).
    The turn is bounded by a tenth of the first-byte time (Router.stagger_s): B is told 30 s."""
    for name in NODES:
        seq = await core.register(name, (await engines(name)).url)
    a = await start_proxy(proxy_id="proxy-a", peer_interval_ms=20, peer_stale_ms=2000, peer_stagger_ms=400)
    b = await start_proxy(proxy_id="proxy-b", peer_interval_ms=20, peer_stale_ms=2000, peer_stagger_ms=400)
    for proxy in (a, b):
        await wait_seq(proxy, "default", seq)
    await wait_for(lambda: "proxy-a" in b.state.router.table.route("default").peers
                   and "proxy-b" in a.state.router.table.route("default").peers, what="A and B hear each other")
    assert (a.state.router.stagger_s("default"), b.state.router.stagger_s("default")) == (0.0, 0.4)
    b.state.router.first_byte(30.0)  # as if B's requests had taken 30 s to their first byte: the whole turn

    async def timed(url: str, text: str, test: dict[str, Any]) -> tuple[str, float]:
        began = time.monotonic()
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, "test": test}
        async with http.post(url + CHAT, json=body) as response:  # streamed: the echo engine's delay holds it
            assert response.status == 200
            await response.read()
            return response.headers["x-laswrr-node"], time.monotonic() - began

    for k in range(4):  # prompts of some work (the referee weighs it), no prefix in common
        *on_a, (on_b, b_took) = await asyncio.gather(
            *(timed(a.url, f"{k} A asks {j} " * 40, {"chunks": 2, "delay": 0.8}) for j in range(3)),
            timed(b.url, f"{k} B asks " * 40, {"chunks": 1}))
        assert len({node for node, _ in on_a}) == 3  # A spread its three
        assert on_b not in {node for node, _ in on_a} and b_took >= 0.4  # B took the node A left free
        await wait_for(lambda: not a.state.router.table.load.own and not b.state.router.table.route("default").others,
                       what="A's request ended, and B heard it")
