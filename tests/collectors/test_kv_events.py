"""The KV event decoder and fold (collectors/kv_events.py) on batches captured from a real vLLM.

``tests/fixtures/kv_events/vllm-0.32.0-cpu_named_tiny-llama.jsonl``: the first 9 ZMQ messages
(``[topic, seq, payload]``, hex) one engine of the real-engine tier published (vLLM 0.32.0 CPU,
the tiny model, 40 blocks of 128 tokens, ``--kv-events-config`` with topic ``kv``) while chat
requests over shared ~1,050-token system prompts reached it: a cache reset
(``AllBlocksCleared``), prompts stored, a prompt's blocks evicted. The ``positional-transcoded``
file holds the same batches in the positional encoding of earlier vLLM (each event an array, its
tag first, trailing defaults left out), transcoded from the named one (no engine here publishes
it).

``sglang-*.jsonl``: batches in the two layouts SGLang has published, built by ``make_sglang.py``
there with structs declared as SGLang declares its own (no SGLang engine runs here), filled as its
radix cache emits them: one event per page, a node split, a host copy and an eviction to the
host, a salted request, a cache flush."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from laswrr.collectors.errors import ParseError
from laswrr.collectors.kv_events import (
    Cleared,
    KvBatch,
    NodeCache,
    Removed,
    Stored,
    decode_frames,
    decode_payload,
    decode_replay,
)
from laswrr.schemas.kvcache import CACHE_DECODER, CACHE_ENCODER, ClearReason, chain_keys

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"


def frames_of(name: str) -> list[list[bytes]]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [[bytes.fromhex(f) for f in json.loads(line)["frames"]] for line in lines]


NAMED = frames_of("vllm-0.32.0-cpu_named_tiny-llama.jsonl")
POSITIONAL = frames_of("vllm-0.32.0-cpu_positional-transcoded_tiny-llama.jsonl")
END = (-1).to_bytes(8, "big", signed=True)


def held_after_each(frames: list[list[bytes]]) -> list[set[int]]:
    """The keys a router holds after each message, folded from the first."""
    cache, held, out = NodeCache(), set(), []
    for f in frames:
        batch = decode_frames(f)
        assert batch is not None and batch.encoding == "positional"
        change = cache.fold(batch)
        if change is not None:
            held = (set() if change.cleared else held) | set(change.stored_keys)
            held -= set(change.removed_keys)
        out.append(set(held))
    return out


def test_sglang_s_pages_key_as_a_router_cuts_the_prompt() -> None:
    a = [100 + i for i in range(48)]
    b = a[:32] + [300 + i for i in range(32)]
    ka, kb = set(chain_keys(a, 16)), set(chain_keys(b, 16))
    assert held_after_each(frames_of("sglang-pages16_current-layout.jsonl")) == [
        ka,  # a prompt's three pages, one event each
        ka | kb,  # b split a's node: a's pages removed and stored again, then b's own
        ka | kb,  # a host copy of b's leaf: not in the KV room, and it leaves the GPU pages keyed
        ka,  # b's leaf evicted to the host
        ka,  # a salted request's page: a plain request never matches it
        set(),  # flush_cache
        set(chain_keys(b[:16], 16)),
    ]


def test_sglang_s_early_layout_one_block_a_token() -> None:
    a, branch = [7, 8, 9, 10, 11], [7, 8, 9, 20, 21]
    ka, kb = set(chain_keys(a, 1)), set(chain_keys(branch, 1))
    assert held_after_each(frames_of("sglang-pages1_early-layout.jsonl")) == [ka, ka | kb, ka, set()]


def test_a_block_of_another_size_than_the_node_s_is_not_keyed() -> None:
    cache = NodeCache()
    first = cache.fold(KvBatch(0, 1.0, (Stored((1,), None, (1,) * 4, 4, True), Stored((2,), 1, (2,) * 3, 3, True))))
    assert first is not None and first.stored_keys == chain_keys((1,) * 4, 4) and first.block_size == 4
    assert cache.fold(KvBatch(1, 1.0, (Stored((3,), 2, (3,) * 4, 4, True),))) is None  # under the odd one: an orphan
    restarted = cache.fold(KvBatch(0, 2.0, (Stored((4,), None, (4,) * 8, 8, True),)))  # a new engine, new blocks
    assert restarted is not None and restarted.block_size == 8 and restarted.stored_keys == chain_keys((4,) * 8, 8)


def test_replay_answers_of_vllm_and_of_sglang() -> None:
    topic, seq, payload = NAMED[1]
    vllm = decode_replay([b"", topic, seq, payload])
    sglang = decode_replay([b"", seq, payload])  # SGLang's replay leaves the topic out
    assert vllm is not None and vllm == sglang == decode_frames(NAMED[1])
    assert decode_replay([b"", b"", END, b""]) is None and decode_replay([b"", END, b""]) is None
    for frames, says in (([topic, seq, payload], "empty delimiter"), ([], "empty delimiter"),
                         ([b"", payload], "3 frames"), ([b"", b"", b"", seq, payload], "3 frames")):
        with pytest.raises(ParseError, match=says):
            decode_replay(frames)


def test_both_encodings_decode_to_the_same_events() -> None:
    named = [decode_frames(f) for f in NAMED]
    positional = [decode_frames(f) for f in POSITIONAL]
    assert all(b is not None and b.encoding == "named" for b in named)
    assert all(b is not None and b.encoding == "positional" for b in positional)
    assert [b.events for b in named if b] == [b.events for b in positional if b]
    assert [b.seq for b in named if b] == list(range(len(NAMED)))
    first = named[0]
    assert first is not None and isinstance(first.events[0], Cleared)
    stored = first.events[1]
    assert isinstance(stored, Stored) and stored.parent is None and stored.block_size == 128 and stored.plain
    assert len(stored.token_ids) == 128 * len(stored.hashes)
    assert any(isinstance(e, Removed) for b in named if b for e in b.events)


def test_the_fold_keys_blocks_by_their_tokens_and_follows_the_engine() -> None:
    cache = NodeCache()
    changes = [cache.fold(b) for f in NAMED if (b := decode_frames(f)) is not None]
    first = changes[0]
    assert first is not None and first.cleared and first.reason == ClearReason.CLEARED
    stored = decode_frames(NAMED[0]).events[1]  # type: ignore[union-attr]
    assert isinstance(stored, Stored)
    assert first.stored_keys == chain_keys(stored.token_ids, 128)  # a router computes the same keys
    held: set[int] = set()
    for change in changes:
        if change is None:
            continue
        if change.cleared:
            held.clear()
        assert not set(change.stored_keys) & set(change.removed_keys)
        held |= set(change.stored_keys)
        assert set(change.removed_keys) <= held  # only what the node held is removed
        held -= set(change.removed_keys)
    assert held == {k for k in cache.keys.values() if k is not None}
    assert 0 < len(held) <= 40  # the engine's 40 blocks
    assert cache.orphans == 0 and not any(c.cleared for c in changes[1:] if c)


def test_a_child_block_chains_on_its_parents_key() -> None:
    cache = NodeCache()
    tokens = list(range(256))
    root = KvBatch(0, 1.0, (Stored((11,), None, tuple(tokens[:128]), 128, True),))
    child = KvBatch(1, 1.0, (Stored((12,), 11, tuple(tokens[128:]), 128, True),))
    keys = [k for b in (root, child) for k in (cache.fold(b) or pytest.fail("no change")).stored_keys]
    assert keys == chain_keys(tokens, 128)


def test_restart_gap_and_orphans() -> None:
    cache = NodeCache()
    cache.fold(KvBatch(5, 1.0, (Stored((1,), None, (1,) * 4, 4, True),)))
    change = cache.fold(KvBatch(0, 2.0, (Stored((2,), None, (2,) * 4, 4, True),)))  # counts from 0 again
    assert change is not None and change.cleared and change.reason == "restart" and len(change.stored_keys) == 1
    change = cache.fold(KvBatch(3, 3.0, ()))  # 1 and 2 lost
    assert change is not None and change.cleared and change.reason == "gap" and not cache.keys
    orphan = cache.fold(KvBatch(4, 4.0, (Stored((3,), 2, (3,) * 4, 4, True),)))  # its parent went with the gap
    assert orphan is None and cache.orphans == 1
    assert cache.fold(KvBatch(5, 4.0, (Stored((4,), 3, (4,) * 4, 4, True),))) is None  # its child too
    assert cache.fold(KvBatch(6, 5.0, (Removed((3, 4), True),))) is None and not cache.keys


def test_lora_extra_keys_and_other_media_are_not_keyed() -> None:
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": "adapter"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt"]]},
        {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": None, "lora_name": None, "extra_keys": [None],
         "a_field_of_a_newer_vllm": 1},
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4, "token_ids": [3, 4],
         "block_size": 2, "lora_id": None, "medium": "gpu"},  # the device's, in any case
    ], 0])
    batch = decode_payload(payload)
    assert [e.plain for e in batch.events if isinstance(e, Stored)] == [False, False, False, True, True]
    change = NodeCache().fold(batch)
    assert change is not None and change.stored_keys == chain_keys([1, 2, 3, 4], 2)


def test_the_replay_end_marker_and_bad_frames() -> None:
    assert decode_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    for frames, says in (([b"kv", b"\x00" * 8], "3 frames"), ([b"kv", b"\x00" * 4, b""], "sequence frame"),
                         ([b"kv", (-5).to_bytes(8, "big", signed=True), b"x"], "negative"),
                         ([b"kv", b"\x00" * 8, b"\xc1"], "not a KV event batch"),
                         ([b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "BlockStored",
                          "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 2}]])],
                          "token ids for 1 blocks"),
                         ([b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1], 1]]])],
                          "not a KV event batch")):
        with pytest.raises(ParseError, match=says):
            decode_frames(frames)


def test_cache_changed_round_trips() -> None:
    cache = NodeCache()
    for f in NAMED:
        batch = decode_frames(f)
        change = cache.fold(batch) if batch is not None else None
        if change is not None:
            assert CACHE_DECODER.decode(CACHE_ENCODER.encode(change)) == change


def test_nodes_toml_validates_and_registers_the_kv_event_endpoints() -> None:
    from laswrr.collectors.nodes import NodesConfigError, parse_nodes
    from laswrr.schemas.codec import decode_event, encode
    from laswrr.schemas.events import NodeRegistered

    table = {"id": "n1", "url": "http://10.0.0.5:8000", "capacity": 4, "kv_events": "tcp://10.0.0.5:5557",
             "kv_events_replay": "tcp://10.0.0.5:5558"}
    nodes, _ = parse_nodes({"node": [table]}, registration=True)
    body = nodes[0].registration()
    assert body.kv_events == "tcp://10.0.0.5:5557" and body.kv_events_replay == "tcp://10.0.0.5:5558"
    _, event = decode_event("lb.admin.node.n1", encode(body))
    assert isinstance(event, NodeRegistered) and event == body
    for bad in ("tcp://*:5557", "http://10.0.0.5:5557", "tcp://10.0.0.5", 5557):
        with pytest.raises(NodesConfigError, match="kv_events"):
            parse_nodes({"node": [{**table, "kv_events": bad}]})
