"""The exact cache view (scheduler/routing/kvindex.py) fed the changes the real engine's events make
(tests/fixtures/kv_events through collectors.kv_events), and its trust rules."""

from __future__ import annotations

import json
from pathlib import Path

from laswrr.collectors.kv_events import NodeCache, Stored, decode_frames
from laswrr.scheduler.routing.kvindex import KvIndex
from laswrr.schemas.kvcache import CacheChanged, pack_block_keys

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events" / "vllm-0.32.0-cpu_named_tiny-llama.jsonl"


def test_the_view_follows_the_engine_and_counts_its_blocks() -> None:
    cache, index = NodeCache(), KvIndex()
    stored: list[Stored] = []
    for line in FIXTURE.read_text().splitlines():
        batch = decode_frames([bytes.fromhex(f) for f in json.loads(line)["frames"]])
        assert batch is not None
        stored += [e for e in batch.events if isinstance(e, Stored) and e.parent is None]
        change = cache.fold(batch)
        if change is not None:
            assert index.apply("a", change)
    assert index.exact("a") and not index.exact("b")
    held = {k for k in cache.keys.values() if k is not None}
    assert index.nodes["a"].keys == held
    last = stored[-1]  # the last prompt stored is whole in the cache
    assert index.depths(last.token_ids, ["a", "b"]) == {"a": len(last.hashes)}
    assert index.cached_tokens(last.token_ids + (1, 2, 3), "a") == 128 * len(last.hashes)
    assert index.cached_tokens(last.token_ids, "b") is None
    assert index.depths((999,) * 128 + last.token_ids, ["a"]) == {"a": 0}  # another prefix: nothing


def change(n: int, stored: list[int] = (), removed: list[int] = (), cleared: bool = False) -> CacheChanged:  # type: ignore[assignment]
    return CacheChanged(n=n, seq=n, block_size=2, stored=pack_block_keys(list(stored)),
                        removed=pack_block_keys(list(removed)), cleared=cleared, reason="cleared" if cleared else "")


def test_a_lost_change_makes_the_node_stale_until_cleared() -> None:
    index = KvIndex()
    assert index.apply("a", change(1, [1, 2]))
    assert index.apply("a", change(2, [3], [1]))
    assert index.nodes["a"].keys == {2, 3}
    assert not index.apply("a", change(4, [5]))  # 3 was lost
    assert not index.exact("a") and not index.nodes["a"].keys
    assert not index.apply("a", change(5, [6]))
    assert index.apply("a", change(6, [7], cleared=True)) and index.exact("a") and index.nodes["a"].keys == {7}
    assert not index.apply("late", change(9, [1]))  # joined mid-stream: not exact before a cleared one
    index.drop("a")
    assert not index.exact("a")


def test_an_ejected_node_is_held_empty_until_its_engine_tells_more() -> None:
    from laswrr.scheduler.routing.table import RoutingTable
    from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot

    load = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)

    def snapshot(seq: int, phase: str) -> WeightSnapshot:
        nodes = [NodeView(node=name, url=f"http://{name}:8000", phase=p, routable=p != "ejected", capacity=4,
                          target_weight=4.0, effective_weight=4.0, inflight=0, chip="cpu", health=1.0, load=load)
                 for name, p in (("a", phase), ("b", "active"))]
        return WeightSnapshot(pool="default", as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=nodes)

    table = RoutingTable("la-swrr", seed=1)
    table.offer(snapshot(1, "active"), 0.0)
    assert table.kv.apply("a", change(1, [1, 2])) and table.kv.apply("b", change(1, [1, 2]))
    table.offer(snapshot(2, "ejected"), 1.0)  # a's engine may be restarting: nothing known to be in its cache
    assert table.kv.exact("a") and not table.kv.nodes["a"].keys
    assert table.kv.nodes["b"].keys == {1, 2}  # the others keep their view
    table.offer(snapshot(3, "recovering"), 2.0)
    assert table.kv.apply("a", change(2, [3]))  # its next change is taken: the counter was kept
    assert table.kv.nodes["a"].keys == {3}


def test_a_pick_s_blocks_count_as_held_until_its_attempt_ends() -> None:
    from laswrr.schemas.kvcache import chain_keys

    prompt = tuple(range(10))  # 5 whole blocks of 2
    keys = chain_keys(prompt, 2)
    index = KvIndex(in_flight=True)  # --kv-in-flight
    assert index.apply("a", change(1, keys[:1], cleared=True)) and index.apply("b", change(1, cleared=True))
    assert index.depths(prompt, ["a", "b"]) == {"a": 1, "b": 0}
    first, second = index.expect("b", prompt), index.expect("b", prompt[:6])  # two picks in flight on b
    assert first is not None and second is not None
    assert index.depths(prompt, ["a", "b"]) == {"a": 1, "b": 5}  # b will have stored them when it takes the next
    assert index.cached(prompt, ["b"]) == {"b": 8}  # never the prompt's last token
    KvIndex.settle(first)
    KvIndex.settle(first)  # a second settle changes nothing
    assert index.depths(prompt, ["b"]) == {"b": 3}  # the second pick's three blocks still in flight
    assert index.apply("b", change(2, keys[:2]))  # the engine stored two of them
    KvIndex.settle(second)
    assert index.depths(prompt, ["b"]) == {"b": 2} and not index.nodes["b"].pending
    assert KvIndex().expect("b", prompt) is None  # the default: not counted
    assert index.expect("c", prompt) is None  # no exact view of c: nothing counted
    dropped = index.expect("a", prompt)
    index.drop("a")  # the node left while the pick was in flight: its settle touches nothing left
    assert dropped is not None
    KvIndex.settle(dropped)
    assert index.apply("a", change(1, cleared=True)) and index.depths(prompt, ["a"]) == {"a": 0}
