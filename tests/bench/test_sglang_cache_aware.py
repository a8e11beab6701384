"""The model of sglang-router's cache_aware policy (bench/sglang_cache_aware.py): its three branches
(imbalanced -> least loaded; a prefix match above the threshold -> its worker; else a miss: least
loaded, or the smallest tree before 0.2.4), its tree's sizes and its eviction."""

from __future__ import annotations

from laswrr.bench.sglang_cache_aware import MISS_LOAD, MISS_TREE, CacheAware, Config, Tree

SYSTEM = "You are a careful assistant. Answer in one sentence. " * 4  # 212 characters every chat shares


def policy(miss: str = MISS_LOAD, **config: float) -> CacheAware:
    """Workers a, b, c; a has served a chat (its tree holds SYSTEM + a question), b a long unrelated
    text (the largest tree), c nothing (the smallest); every load back to 0."""
    p = CacheAware(["a", "b", "c"], Config(miss=miss, eviction_interval_s=0, **config))  # type: ignore[arg-type]
    p.load.update(a=0, b=1, c=2)
    assert p.pick(SYSTEM + "What is a radix tree?", 0.0) == "a"  # a miss: least loaded (no prefix yet)
    p.load.update(a=1, b=0, c=2)
    assert p.pick("x" * 5000, 0.0) == "b"
    p.load.update(a=0, b=0, c=0)
    assert p.tree.size == {"a": len(SYSTEM) + 21, "b": 5000, "c": 0}
    p.decisions.clear()
    return p


def test_a_matching_prefix_above_the_threshold_goes_to_its_worker_even_the_busiest() -> None:
    p = policy()
    p.load.update(a=60, b=0, c=0)  # 60 apart: not imbalanced (abs threshold 64)
    assert p.pick(SYSTEM + "What is a heap?", 1.0) == "a"
    assert p.decisions["hit"] == 1
    p.load.update(a=300, b=210, c=210)  # 90 apart but 300 <= 210 x 1.5: not imbalanced either (both must hold)
    assert p.pick(SYSTEM + "What is a trie?", 1.0) == "a"
    assert p.load["a"] == 301


def test_an_imbalanced_pool_goes_to_the_least_loaded_worker_whatever_the_prefix() -> None:
    p = policy()
    p.load.update(a=100, b=30, c=20)  # 80 apart and 100 > 20 x 1.5
    assert p.pick(SYSTEM + "What is a heap?", 1.0) == "c"
    assert p.decisions["imbalanced"] == 1 and p.load["c"] == 21
    assert p.tree.match(SYSTEM + "What is a heap?") == (227, "c")  # the text went into c's tree


def test_a_miss_goes_to_the_least_loaded_worker_in_the_0_3_rule_and_the_smallest_tree_before() -> None:
    text = SYSTEM[:40] + "z" * 200  # 40 of its 240 characters match a's: 0.17, under the threshold 0.3
    p = policy()
    p.load.update(a=0, b=2, c=5)
    assert p.pick(text, 1.0) == "a" and p.decisions["miss"] == 1
    old = policy(MISS_TREE)
    old.load.update(a=0, b=2, c=5)
    assert old.pick(text, 1.0) == "c"  # the smallest tree (0 characters), not the least loaded
    assert old.tree.size == {"a": 233, "b": 5000, "c": 240}
    assert old.pick("q" * 10, 1.0) == "a"  # a's 233 characters are the fewest now


def test_the_threshold_is_strict() -> None:
    p = policy(cache_threshold=0.5)
    p.load.update(a=2, b=0, c=3)
    half = SYSTEM[:100] + "y" * 100  # exactly half matches a's
    assert p.tree.match(half) == (100, "a")
    assert p.pick(half, 1.0) == "b" and p.decisions["miss"] == 1
    p.load.update(a=2, b=0, c=3)
    assert p.pick(SYSTEM[:101] + "w" * 99, 1.0) == "a" and p.decisions["hit"] == 1


def test_eviction_drops_each_workers_least_recently_used_leaves_down_to_the_cap() -> None:
    tree = Tree()
    tree.insert("old-request-text", "a")
    tree.insert("new-request-text", "a")
    tree.insert("old-request-text", "b")
    assert tree.size == {"a": 32, "b": 16}
    tree.evict(16)
    assert tree.size == {"a": 16, "b": 16}
    assert tree.match("new-request-text") == (16, "a")  # a's recent text stays
    assert tree.match("old-request-text") == (16, "b")  # a's old one went; b still has it


def test_the_policy_evicts_on_its_interval_of_the_runs_clock() -> None:
    p = CacheAware(["a", "b"], Config(eviction_interval_s=60, max_tree_size=100))
    assert p.pick("p" * 300, 0.0) == "a" and p.pick("q" * 300, 59.0) == "b"
    assert p.tree.size == {"a": 300, "b": 300}
    p.done("a")
    assert p.pick("r" * 50, 61.0) == "a"  # both trees evicted first (300 > 100), then a miss: a, the least loaded
    assert p.tree.size == {"a": 50, "b": 0} and p.next_eviction == 120
