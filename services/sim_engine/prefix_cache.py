"""Automatic prefix caching of the simulated engine, after vLLM's block manager (pure, no clock).

Rules:

* **Blocks.** A prompt is cut into full blocks of ``block_tokens`` tokens; with the simulator's
  tokenizer (``openai_api.estimate_tokens``: 4 characters a token) a block is ``4 * block_tokens``
  characters of the prompt text. A partial last block is never cached (as in vLLM).
* **Prefix chain.** Block i's key is the hash of the whole text up to the end of block i
  (blake2b, 8 bytes, a running digest), so equal keys mean an equal prefix, like vLLM's block
  hashes that fold in the parent's hash.
* **Lookup at admission.** A request's cached prefix is the number of its leading keys in the
  cache when it is scheduled; the hit in tokens is that many blocks, capped at
  ``prompt_tokens - 1`` (vLLM always recomputes the last prompt token to get logits). The
  queried and hit tokens are counted then, once per request (``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits``).
* **Registration after prefill.** The blocks a request computes enter the cache when its prefill
  step ends, not when it is admitted: two requests admitted in the same step do not hit each
  other (a burst of one system prompt pays its prefill once per request in that step, as in vLLM).
* **References and eviction.** A running request holds a reference on its blocks; a block nobody
  references stays cached and is evictable, least recently released first. A finished request
  releases its blocks tail first, so its last blocks are evicted before its first ones (vLLM's
  free-queue order: a common prefix outlives the conversations that extend it). The engine calls
  ``evict_to(room)`` whenever the KV room left beside the running requests' reservations shrinks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

CHARS_PER_TOKEN = 4  # the simulator's tokenizer (openai_api.estimate_tokens)


def block_keys(text: str, block_tokens: int, max_blocks: int) -> tuple[bytes, ...]:
    """The prefix-chain keys of the first ``max_blocks`` full blocks of ``text``."""
    size = block_tokens * CHARS_PER_TOKEN
    raw = text.encode()
    count = min(max_blocks, len(raw) // size)
    running = hashlib.blake2b(digest_size=8)
    keys: list[bytes] = []
    for i in range(count):
        running.update(raw[i * size:(i + 1) * size])
        keys.append(running.copy().digest())
    return tuple(keys)


class PrefixCache:
    """Cached KV blocks by key: reference counts, and the unreferenced ones in LRU order."""

    __slots__ = ("block_tokens", "refs", "free", "queries", "hits")

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.refs: dict[bytes, int] = {}  # every cached block -> running requests that hold it
        self.free: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, least recently released first
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)

    def __len__(self) -> int:
        return len(self.refs)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are cached."""
        refs = self.refs
        for depth, key in enumerate(keys):
            if key not in refs:
                return depth
        return len(keys)

    def admit(self, keys: Sequence[bytes], prompt_tokens: int) -> tuple[int, int]:
        """Look up and count one request at scheduling and hold its cached prefix:
        (cached blocks, hit tokens)."""
        depth = self.match(keys)
        self.acquire(keys[:depth])
        hit = max(0, min(depth * self.block_tokens, prompt_tokens - 1))
        self.queries += prompt_tokens
        self.hits += hit
        return depth, hit

    def acquire(self, keys: Sequence[bytes]) -> None:
        """Reference ``keys``, inserting the ones not cached yet."""
        refs, free = self.refs, self.free
        for key in keys:
            held = refs.get(key, 0)
            if held == 0:
                free.pop(key, None)
            refs[key] = held + 1

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop one reference on each of ``keys``; unreferenced blocks become evictable, tail first."""
        refs, free = self.refs, self.free
        for key in reversed(keys):
            held = refs[key] - 1
            refs[key] = held
            if held == 0:
                free[key] = None

    def evict_to(self, room_tokens: int) -> int:
        """Evict LRU unreferenced blocks until they fit in ``room_tokens``; how many were evicted."""
        limit = max(0, room_tokens) // self.block_tokens
        evicted = 0
        while len(self.free) > limit:
            key, _ = self.free.popitem(last=False)
            del self.refs[key]
            evicted += 1
        return evicted
