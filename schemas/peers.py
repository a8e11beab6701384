"""The channel between proxies (docs/design.md, "The channel between proxies"): ``PeerState``.

Plain core NATS on ``lb.peer.<pool>.<proxy>`` (``schemas.subjects.peer``): no stream captures
it, nothing in it is stored, replayed or applied by the scheduler. Each message carries one
proxy's *absolute* view of one pool, never deltas, so a lost message costs nothing: its own
live in-flight per node, its prefill backlog per node (tokens), its held requests per band
(flow control) and, as hints, the prefix-index records it added since its last message
(``[node, keys]``, capped per message): the block keys at the grid positions of the blocks the
node did not hold yet (``scheduler.policies.affinity``, "Sparse records"), packed as 32-bit
little-endian integers.

Encoded as MessagePack arrays (``array_like``, trailing defaults left out): no field names on the
wire (docs/design.md, "The channel between proxies", bandwidth). A field is only ever added at the
end, with a default.
"""

from __future__ import annotations

import struct

import msgspec


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


class PeerState(msgspec.Struct, kw_only=True, frozen=True, array_like=True, omit_defaults=True):
    proxy: str
    pool: str
    boot_id: str  # a new one replaces the peer's entry (a restarted proxy counts from zero)
    seq: int  # message counter within one boot_id: an older one arriving late is ignored
    ts_ns: int  # the sender's wall clock: compared with the snapshot's ts_ns (newer than its view)
    inflight: dict[str, int] = {}  # node -> the sender's own live requests on it (> 0 only)
    backlog: dict[str, int] = {}  # node -> the sender's prefill backlog on it, tokens (> 0 only)
    held: dict[str, int] = {}  # band -> requests the sender's flow control holds (> 0 only)
    held_oldest_ms: dict[str, int] = {}  # band -> age of the oldest held one
    prefixes: list[PrefixRecord] = []


PEER_ENCODER = msgspec.msgpack.Encoder()
PEER_DECODER = msgspec.msgpack.Decoder(PeerState)
