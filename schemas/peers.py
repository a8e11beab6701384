"""The channel between proxies (docs/proxy.md, "The channel between proxies"): ``PeerState``
and ``PeerDelta``.

Plain core NATS on ``lb.peer.<pool>.<proxy>`` (``schemas.subjects.peer``): no stream captures
it, nothing in it is stored, replayed or applied by the scheduler; the pool and the sender are
read from the subject (``schemas.subjects.peer_of``), not repeated in the message. A
``PeerState`` carries one proxy's *whole* view of one pool: its own live in-flight per node,
its prefill backlog per node (tokens), its held requests per band (flow control). A
``PeerDelta`` carries the changes of the in-flight and backlog counts since the sender's
previous message of the pool; a receiver takes it only when it holds that previous message
(``seq`` one less), so a lost message costs at most until the next ``PeerState`` (at the
latest the heartbeat). Both carry, as hints, the prefix-index records the sender added since its
last message (``[node, keys]``, capped per message): the block keys at the grid positions of the
blocks the node did not hold yet (``scheduler.policies.affinity``, "Sparse records"), packed as
32-bit little-endian integers.

Encoded as MessagePack arrays (``array_like``, trailing defaults left out), the first item the
kind (1: state, 2: delta): no field names on the wire (docs/proxy.md, "The channel between
proxies", bandwidth). A field is only ever added at the end, with a default.
"""

from __future__ import annotations

import struct

import msgspec

from laswrr.schemas.words import Band


def pack_keys(keys: list[int]) -> bytes:
    return struct.pack(f"<{len(keys)}I", *keys)


def unpack_keys(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError("prefix keys are 4 bytes each")
    return list(struct.unpack(f"<{len(data) // 4}I", data))


class PrefixRecord(msgspec.Struct, array_like=True, frozen=True):
    """A prompt sent to ``node``: prefix-chain keys of its blocks (PrefixIndex.keys), packed (``pack_keys``)."""

    node: str
    keys: bytes

    @property
    def count(self) -> int:
        return len(self.keys) // 4


class PeerState(msgspec.Struct, kw_only=True, frozen=True, array_like=True, omit_defaults=True, tag=1):
    """The sender's whole view of the pool: replaces what a receiver held of it."""

    boot_id: str  # a new one replaces the peer's entry (a restarted proxy counts from zero)
    seq: int  # message counter of the pool within one boot_id: an older one arriving late is ignored
    ts_ns: int  # the sender's wall clock: compared with the snapshot's ts_ns (newer than its view)
    inflight: dict[str, int] = {}  # node -> the sender's own live requests on it (> 0 only)
    backlog: dict[str, int] = {}  # node -> the sender's prefill backlog on it, tokens (> 0 only)
    held: dict[Band, int] = {}  # band -> requests the sender's flow control holds (> 0 only)
    held_oldest_ms: dict[Band, int] = {}  # band -> age of the oldest held one
    prefixes: list[PrefixRecord] = []


class PeerDelta(msgspec.Struct, kw_only=True, frozen=True, array_like=True, omit_defaults=True, tag=2):
    """What changed since the sender's message ``seq - 1`` of the pool: taken only right after
    it (a receiver that missed one waits for the next ``PeerState``)."""

    seq: int
    ts_ns: int
    inflight: dict[str, int] = {}  # node -> change of the sender's live requests on it (!= 0 only)
    backlog: dict[str, int] = {}  # node -> change of its prefill backlog there, tokens (!= 0 only)
    prefixes: list[PrefixRecord] = []


PeerMessage = PeerState | PeerDelta


PEER_ENCODER = msgspec.msgpack.Encoder()
PEER_DECODER = msgspec.msgpack.Decoder(PeerMessage)
