"""vLLM's KV cache events, decoded, and folded into one node's compact cache changes. Pure.

**The wire** (vLLM's ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): every batch is a
ZMQ multipart message ``[topic, seq, payload]`` on the engine's PUB socket (``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ...}'``):
``seq`` is an 8-byte big-endian counter of the publisher (from 0 at every engine start), and
``payload`` MessagePack of ``KVEventBatch``, an array ``[ts, events, data_parallel_rank]``. The
replay socket (ROUTER, ``replay_endpoint``) answers an 8-byte start sequence with the buffered
batches from there, each ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.

**SGLang** (``--kv-events-config``, its ``sglang/srt/disaggregation/kv_events.py``) mirrors
vLLM's publisher and structs: the same PUB frames and positional encoding, with ``[ts, events,
attn_dp_rank]`` batches (the rank left out when unset), one ``BlockStored`` per page of its radix
tree (``block_size`` = its ``--page-size``, 1 by default; the parent is the previous page's
hash, None for a prompt's first), int64 hashes (negative too), ``medium`` GPU or CPU (its host
cache; the strings are taken in any case), a cache salt in ``extra_keys`` and trailing fields of its own
(ignored). Its replay answers leave the topic out (``decode_replay`` takes both); the engine
need not be named.

An event is one of ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``extra_keys``, ...), ``BlockRemoved``
(``block_hashes``, ``medium``, ...) and ``AllBlocksCleared``, in one of two encodings, both
decoded here:

* **named fields** (vLLM 0.11 and later, the 0.32 CPU build here): a map with the tag in
  ``"type"``: ``{"type": "BlockStored", "block_hashes": [...], ...}``;
* **positional** (earlier vLLM, SGLang's mirror of the same structs): an array whose first item
  is the tag: ``["BlockStored", [...hashes], parent, [...token ids], block_size, lora_id, medium]``,
  trailing fields left out when at their defaults.

A block hash (``ExternalBlockHash``) is an integer or bytes, depending on the engine's hash
algorithm. Unknown extra fields are ignored (both encodings), so a newer engine's additions
decode; anything else (not MessagePack, a wrong shape, a negative token id, a block whose
token ids do not fill it) raises ``ParseError`` with one line saying what: the service counts it
as a rejection and goes on.

**The fold** (``NodeCache``): the engine names a block by its own hash, which depends on its hash
algorithm and seed (a random ``PYTHONHASHSEED`` by default), so a router cannot compute it. The
fold gives each stored block a *key* a router can compute from the tokens alone:
``chain_key(parent_key, block_token_ids)`` (``schemas.kvcache``), the parent being the key of
the block the engine names as its parent (0 for the first block of a prompt). It keeps the
engine hash -> key map of the blocks the node holds, so a ``BlockRemoved`` (hashes only) becomes
the keys to drop. A ``BlockStored`` whose parent it does not know (it missed that event) cannot
be keyed: its blocks count as orphans, and so do their children. A block with ``extra_keys``,
a ``lora_name`` or a medium other than the GPU's (``None`` or ``"GPU"``) is not keyed either: a
plain text request never matches it, and an offloaded copy is not in the node's KV room (nor does
such a copy, stored under the same hash as the GPU's block, unkey that block). Nor is a block of
another size than the node's (the first block stored since the engine started sets it): the
partial last page of an SGLang radix node, or an earlier SGLang's one block per radix node; a
router cuts a prompt in blocks of one size.

``NodeCache.fold(seq, batch)`` returns the ``CacheChanged`` to publish (or None when nothing a
router sees changed), and says ``cleared`` with the reason when the router must drop the node's
index: ``AllBlocksCleared``, a sequence number that went back (the engine restarted: its
publisher counts from 0 again), or a gap (batches lost; the service asks the replay endpoint
first, ``services/kv_events.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from laswrr.collectors.errors import ParseError
from laswrr.schemas.kvcache import CacheChanged, ClearReason, chain_keys, pack_block_keys

TokenId = Annotated[int, Meta(ge=0, lt=2**32)]
BlockHash = int | bytes
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
MAX_TOPIC_BYTES = 256
SEQ_BYTES = 8
END_SEQ = -1  # the replay socket's end marker


def _gpu(medium: str | None) -> bool:
    """The device's KV room: vLLM's ``None`` or ``"GPU"``; SGLang's ``StorageMedium.GPU`` (whose
    string the stored sources do not show: any case is taken)."""
    return medium is None or medium.upper() == "GPU"


# --------------------------------------------------------------------------- named fields


class NamedStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    token_ids: list[TokenId]
    block_size: BlockSize
    parent_block_hash: BlockHash | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class NamedRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class NamedCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True):
    pass


class NamedBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[NamedStored | NamedRemoved | NamedCleared]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------- positional


class ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, frozen=True):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[ArrayStored | ArrayRemoved | ArrayCleared]
    data_parallel_rank: int | None = None


_NAMED = msgspec.msgpack.Decoder(NamedBatch)
_ARRAY = msgspec.msgpack.Decoder(ArrayBatch)


# --------------------------------------------------------------------------- decoded


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    plain: bool  # no lora, no extra keys, in the GPU's KV room: a text request can match it


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[BlockHash, ...]
    plain: bool  # from the GPU's KV room (another medium's removal does not change it)


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    encoding: str = "named"  # or "positional"


def _stored(e: NamedStored | ArrayStored) -> Stored:
    if not e.block_hashes:
        raise ParseError("BlockStored with no block_hashes")
    if len(e.token_ids) != len(e.block_hashes) * e.block_size:
        raise ParseError(f"BlockStored: {len(e.token_ids)} token ids for {len(e.block_hashes)} blocks of "
                         f"{e.block_size}")
    plain = e.lora_name is None and e.lora_id is None and not any(e.extra_keys or ()) \
        and _gpu(e.medium) and e.group_idx in (None, 0)
    return Stored(tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size, plain)


def _event(e: Any) -> KvEvent:
    if isinstance(e, (NamedStored, ArrayStored)):
        return _stored(e)
    if isinstance(e, (NamedRemoved, ArrayRemoved)):
        return Removed(tuple(e.block_hashes), _gpu(e.medium) and e.group_idx in (None, 0))
    return Cleared()


def decode_payload(payload: bytes, seq: int = 0) -> KvBatch:
    """One ``KVEventBatch`` (either encoding) -> ``KvBatch``; ``ParseError`` on anything else."""
    try:
        batch: NamedBatch | ArrayBatch = _NAMED.decode(payload)
        encoding = "named"
    except (msgspec.DecodeError, msgspec.ValidationError) as named:
        try:
            batch = _ARRAY.decode(payload)
            encoding = "positional"
        except (msgspec.DecodeError, msgspec.ValidationError) as positional:
            raise ParseError(f"not a KV event batch: {_short(named)} (named fields); {_short(positional)} "
                             "(positional)") from None
    except RecursionError:
        raise ParseError("not a KV event batch: nested too deep") from None
    return KvBatch(seq, batch.ts, tuple(_event(e) for e in batch.events), batch.data_parallel_rank, encoding)


def decode_frames(frames: Sequence[bytes]) -> KvBatch | None:
    """A PUB message ``[topic, seq, payload]`` (or a replay answer's, the empty delimiter taken
    off) -> ``KvBatch``; None for the replay's end marker; ``ParseError`` on anything else."""
    if len(frames) != 3:
        raise ParseError(f"a KV event message has 3 frames (topic, seq, payload), not {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(topic) > MAX_TOPIC_BYTES:
        raise ParseError(f"topic of {len(topic)} bytes (at most {MAX_TOPIC_BYTES})")
    if len(seq_bytes) != SEQ_BYTES:
        raise ParseError(f"sequence frame of {len(seq_bytes)} bytes, not {SEQ_BYTES}")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if seq == END_SEQ and not payload:
        return None
    if seq < 0:
        raise ParseError(f"negative sequence number {seq}")
    return decode_payload(payload, seq)


def decode_replay(frames: Sequence[bytes]) -> KvBatch | None:
    """One answer of a replay endpoint (a DEALER's frames, the empty delimiter first) -> ``KvBatch``;
    None for the end marker; ``ParseError`` on anything else. The two publishers differ here, by
    frame count: vLLM's answer keeps the topic (``[b"", topic, seq, payload]``, end ``[b"", b"", -1,
    b""]``), SGLang's leaves it out (``[b"", seq, payload]``, end ``[b"", -1, b""]``)."""
    if not frames or frames[0] != b"":
        raise ParseError("a replay answer starts with an empty delimiter frame")
    if len(frames) == 3:  # SGLang's: no topic
        return decode_frames([b"", *frames[1:]])
    return decode_frames(frames[1:])


def _short(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


# --------------------------------------------------------------------------- fold


@dataclass
class NodeCache:
    """One node's blocks as its events tell them (module doc, "The fold")."""

    keys: dict[BlockHash, int | None] = field(default_factory=dict)  # engine hash -> key (None: orphan)
    last_seq: int | None = None
    count: int = 0  # CacheChanged messages made (their ``n``)
    orphans: int = 0  # stored blocks not keyed (parent unknown)
    block_size: int = 0

    def reset(self) -> None:
        self.keys.clear()

    def gap(self, seq: int) -> bool:
        """``seq`` does not follow the last batch folded (a batch in between was lost)."""
        return self.last_seq is not None and seq > self.last_seq + 1

    def fold(self, batch: KvBatch) -> CacheChanged | None:
        """Fold one batch; the change a router applies (None: nothing it sees changed)."""
        reason: ClearReason | None = None
        if self.last_seq is not None and batch.seq <= self.last_seq:
            reason = ClearReason.RESTART  # the publisher counts from 0 again: a new engine
        elif self.gap(batch.seq):  # batches in between were lost: the index is void
            reason = ClearReason.GAP
        if reason is not None:
            self.reset()
        if reason == ClearReason.RESTART:
            self.block_size = 0  # a new engine: its blocks may be of another size
        self.last_seq = batch.seq
        net: dict[int, bool] = {}  # key -> held after the batch (the last event of a key wins)
        for event in batch.events:
            if isinstance(event, Cleared):
                self.reset()
                net.clear()
                reason = ClearReason.CLEARED
            elif isinstance(event, Stored):
                self.block_size = self.block_size or event.block_size
                for key in self._store(event):
                    net[key] = True
            elif event.plain:
                for block in event.hashes:
                    key = self.keys.pop(block, None)
                    if key is not None:
                        net[key] = False
        if reason is None and not net:
            return None
        self.count += 1
        return CacheChanged(n=self.count, seq=batch.seq, block_size=self.block_size,
                            stored=pack_block_keys([k for k, held in net.items() if held]),
                            removed=pack_block_keys([k for k, held in net.items() if not held]),
                            cleared=reason is not None, reason=reason.value if reason is not None else "")

    def _store(self, event: Stored) -> list[int]:
        unknown = event.parent is not None and event.parent not in self.keys
        parent = 0 if event.parent is None else self.keys.get(event.parent)  # None: unknown or not keyed
        if parent is None or not event.plain or event.block_size != self.block_size:
            for block in event.hashes:
                self.keys.setdefault(block, None)  # never unkeys the GPU's block of the same hash
            self.orphans += len(event.hashes) if unknown else 0
            return []
        keys = chain_keys(event.token_ids, event.block_size, parent)
        for block, key in zip(event.hashes, keys, strict=True):
            self.keys[block] = key
        return keys
