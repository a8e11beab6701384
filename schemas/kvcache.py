"""A node's KV cache changes, as ``laswrr kv-events`` publishes them: ``CacheChanged``.

Plain core NATS on ``lb.kv.<node>`` (``schemas.subjects.kv``): like the channel between proxies,
no stream captures it (the event log does not grow by every block an engine stores or evicts);
the node is read from the subject. One message per engine batch that changed what a router
sees (``collectors.kv_events``, "The fold").

A block's **key** is computed from tokens alone, so a router holding a request's token ids
computes the same keys without knowing the engine's hash algorithm or seed: the key of a
prompt's block i is ``chain_key(key of block i-1, token ids of block i)``, block -1's key being
0; the first 8 bytes (little-endian) of BLAKE2b over the parent key (8 bytes, little-endian)
and the block's token ids (4 bytes each, little-endian). Equal keys mean an equal prefix of
whole blocks, as the engine's own chained hashes do.

Encoded as a MessagePack array (``array_like``, trailing defaults left out); the keys packed as
8-byte little-endian integers (``pack_block_keys``). A field is only ever added at the end, with
a default.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence

import msgspec

KEY_BYTES = 8


class ClearReason(enum.StrEnum):
    """Why a router must drop a node's whole index before applying the message."""

    CLEARED = "cleared"  # AllBlocksCleared (a cache reset; vLLM's /reset_prefix_cache)
    RESTART = "restart"  # the engine's sequence numbers went back: a new engine, an empty cache
    GAP = "gap"  # batches were lost and could not be replayed: the index is void from here


def chain_key(parent: int, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<Q{len(token_ids)}I", parent, *token_ids), digest_size=KEY_BYTES)
    return int.from_bytes(digest.digest(), "little")


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The keys of the whole blocks of ``token_ids`` (a trailing partial block has none)."""
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


def pack_block_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}Q", *keys)


def unpack_block_keys(data: bytes) -> list[int]:
    if len(data) % KEY_BYTES:
        raise ValueError(f"block keys are {KEY_BYTES} bytes each")
    return list(struct.unpack(f"<{len(data) // KEY_BYTES}Q", data))


class CacheChanged(msgspec.Struct, kw_only=True, frozen=True, array_like=True, omit_defaults=True):
    """What changed in one node's KV cache: apply ``cleared`` first (drop the node's index),
    then add ``stored`` and take out ``removed`` (no key is in both)."""

    n: int  # the publisher's message counter for the node, from 1: a receiver that sees n jump lost one
    seq: int  # the engine's batch sequence number folded last (its publisher's, from 0 at its start)
    block_size: int  # tokens per block of the node's engine (the proxy cuts a prompt's tokens so)
    stored: bytes = b""  # keys the node holds now (pack_block_keys)
    removed: bytes = b""  # keys it no longer holds
    cleared: bool = False  # the node's index is void: drop it first
    reason: str = ""  # ClearReason's value when cleared

    @property
    def stored_keys(self) -> list[int]:
        return unpack_block_keys(self.stored)

    @property
    def removed_keys(self) -> list[int]:
        return unpack_block_keys(self.removed)


CACHE_ENCODER = msgspec.msgpack.Encoder()
CACHE_DECODER = msgspec.msgpack.Decoder(CacheChanged)
