"""The channel between proxies in virtual time (``bench/virtual.py``, ``bench/virtual_timeline.py``).

Each replica's message goes through the encoder and decoder the bus uses and is taken by every
other replica ``delay_s`` later (``schedule`` runs the delivery then; 0: at once); a pick is told
``PeerChannel.pick_s`` later, with the others of that window, while some peer is heard, as the
bus does (it drains ``PeerChannel.picks``); what each message carries (whole or changes) is the
channel's (``PeerChannel.speak``), as ``services/proxy/bus.py`` sends it. ``traffic`` counts what
the bus would carry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from laswrr.scheduler.routing.router import DEFAULT_POOL, Router
from laswrr.schemas import subjects as sj
from laswrr.schemas.peers import PEER_DECODER, PEER_ENCODER, PeerMessage

# The bus's delivery time of a message between proxies, modelled: a replica takes a peer's message
# this long after it was sent. Measured on the real stack (`laswrr bench --scenario trace-mooncake
# --proxies 4`, laswrr_proxy_peer_lag_seconds): 0.8-1.8 ms on average, P99 at most 5-25 ms.
# Requests that reach several replicas within it are routed by each without the others' picks: on
# trace-mooncake (its arrivals come in bursts that share one stamp) every delay from 0.5 to 5 ms
# gives the same figures when the replicas do not pick in turn (seed 1), and with it the virtual run agrees with the real stack where at 0 it did
# not (docs/evidence/replicas.md, "Several proxies on the real stack").
PEER_DELAY_MS = 2.0


class VirtualChannel:
    def __init__(self, routers: Sequence[Router], on_message: Callable[[PeerMessage, int], None] | None = None,
                 ts_ns: Callable[[float], int] = lambda now: int(now * 1e9), delay_s: float = 0.0,
                 schedule: Callable[[float, Callable[[float], None]], None] | None = None) -> None:
        if delay_s > 0 and schedule is None:
            raise ValueError("a channel with a delay needs a schedule to deliver on")
        self.channels = [router.channel for router in routers if router.channel is not None]
        self.delay_s = delay_s
        self.schedule = schedule
        self.on_message = on_message  # (message, its bytes with the subject) for each message sent
        self.ts_ns = ts_ns
        self.waiting = [False] * len(self.channels)  # a pick message of the replica waits for its window (pick_s)

    def start(self, now: float) -> None:
        """The replicas' first heartbeats, before any request (live proxies run before the load
        comes): each hears the others, so a pick is told within the window from the first one."""
        for k in range(len(self.channels)):
            self.speak(k, now)

    def picked(self, k: int, now: float) -> None:
        """Replica k admitted a request: if it hears a peer, its message goes ``pick_s`` later
        with every pick of that window, as the bus sends it (at once with ``pick_s`` 0 or without
        a schedule)."""
        channel = self.channels[k]
        if not channel.picked or self.waiting[k]:
            return
        if channel.pick_s <= 0 or self.schedule is None:
            channel.picks()
            self.speak(k, now)
            return
        self.waiting[k] = True

        def tell(at: float) -> None:
            self.waiting[k] = False
            if DEFAULT_POOL in channel.picks():  # else an interval's message told the window's picks already
                self.speak(k, at)

        self.schedule(now + channel.pick_s, tell)

    def due(self, k: int, now: float) -> bool:
        """Replica k's interval message is due (``PeerChannel.due``)."""
        return self.channels[k].due(DEFAULT_POOL, now)

    def speak(self, k: int, now: float) -> None:
        """Replica k's message of the pool to the others."""
        channel = self.channels[k]
        message = channel.speak(DEFAULT_POOL, now, self.ts_ns(now), "virtual")
        if message is None:
            return
        channel.sent(DEFAULT_POOL, message, now)
        data = PEER_ENCODER.encode(message)
        if self.on_message is not None:
            self.on_message(message, len(data) + len(sj.peer(DEFAULT_POOL, channel.proxy_id)))
        taken = PEER_DECODER.decode(data)

        def deliver(at: float) -> None:
            for j, other in enumerate(self.channels):
                if j != k:
                    other.receive(channel.proxy_id, DEFAULT_POOL, taken, at)

        if self.delay_s > 0:
            assert self.schedule is not None
            self.schedule(now + self.delay_s, deliver)
        else:
            deliver(now)
