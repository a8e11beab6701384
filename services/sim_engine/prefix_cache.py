"""Automatic prefix caching of the simulated engine, after vLLM's block manager (pure, no clock).

Rules:

* **Blocks.** A prompt is cut into full blocks of ``block_tokens`` tokens; with the simulator's
  tokenizer (``openai_api.estimate_tokens``: 4 characters a token) a block is ``4 * block_tokens``
  characters of the prompt text. A partial last block is never cached (as in vLLM).
* **Token ids.** The simulator's token ids of a text (``token_ids``) are its UTF-8 cut in 4-byte
  chunks, each read as a little-endian integer (the last, shorter chunk padded with zeros): as
  many ids as the tokenizer counts tokens for an ASCII text, and equal texts give equal ids.
* **Prefix chain.** Block i's key is ``schemas.kvcache.chain_key`` of block i-1's key and block
  i's token ids (``chain_keys``), so equal keys mean an equal prefix, like vLLM's block hashes
  that fold in the parent's hash; and they are the keys a router computes from the same token
  ids (``scheduler.routing.kvindex``): the simulated engine's KV events need no translation.
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
* **Change log** (``log_changes``, for the simulated KV events): every block that enters the
  cache (``acquire``, with its parent's key and its token ids when the caller gives them) or is
  evicted (``evict_to``) is noted, in order. ``take_events`` hands them as they happened (what
  the simulated engine's publisher turns into vLLM's ``BlockStored`` and ``BlockRemoved``,
  ``kv_publisher.py``); ``take_changes`` the keys stored and removed since the last take, each
  key's last change winning (no key in both), as vLLM's events of one engine step fold into one
  ``CacheChanged`` (the virtual bench's, ``bench/virtual_kv.py``).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from laswrr.schemas.kvcache import chain_keys

CHARS_PER_TOKEN = 4  # the simulator's tokenizer (openai_api.estimate_tokens)


def token_ids(text: str) -> tuple[int, ...]:
    """The simulator's token ids of ``text`` (module docstring, "Token ids")."""
    raw = text.encode()
    raw += bytes(-len(raw) % CHARS_PER_TOKEN)
    return struct.unpack(f"<{len(raw) // CHARS_PER_TOKEN}I", raw)


def block_keys(text: str, block_tokens: int, max_blocks: int) -> tuple[int, ...]:
    """The prefix-chain keys of the first ``max_blocks`` full blocks of ``text``'s token ids."""
    return tuple(chain_keys(token_ids(text)[:max(0, max_blocks) * block_tokens], block_tokens))


class BlockChange(NamedTuple):
    """One entry of the change log: ``key`` stored (with the key of the block before it, None for
    a prompt's first, and its token ids) or evicted."""

    key: int
    stored: bool
    parent: int | None = None
    token_ids: tuple[int, ...] = ()


class PrefixCache:
    """Cached KV blocks by key: reference counts, and the unreferenced ones in LRU order."""

    __slots__ = ("block_tokens", "refs", "free", "queries", "hits", "changes")

    def __init__(self, block_tokens: int, log_changes: bool = False) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.refs: dict[int, int] = {}  # every cached block -> running requests that hold it
        self.free: OrderedDict[int, None] = OrderedDict()  # refs == 0, least recently released first
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)
        # since the last take (key, stored, parent, the prompt's token ids, block index); None: no log
        self.changes: list[tuple[int, bool, int | None, Sequence[int], int]] | None = [] if log_changes else None

    def __len__(self) -> int:
        return len(self.refs)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached."""
        refs = self.refs
        for depth, key in enumerate(keys):
            if key not in refs:
                return depth
        return len(keys)

    def admit(self, keys: Sequence[int], prompt_tokens: int) -> tuple[int, int]:
        """Look up and count one request at scheduling and hold its cached prefix:
        (cached blocks, hit tokens)."""
        depth = self.match(keys)
        self.acquire(keys[:depth])
        hit = max(0, min(depth * self.block_tokens, prompt_tokens - 1))
        self.queries += prompt_tokens
        self.hits += hit
        return depth, hit

    def acquire(self, keys: Sequence[int], token_ids: Sequence[int] = (), parent: int | None = None,
                first: int = 0) -> None:
        """Reference ``keys``, inserting the ones not cached yet. For the change log: ``keys[0]`` is
        block ``first`` of ``token_ids`` (``block_tokens`` each), ``parent`` the key before it."""
        refs, free, changes = self.refs, self.free, self.changes
        for i, key in enumerate(keys):
            held = refs.get(key, 0)
            if held == 0:
                if key in free:
                    del free[key]
                elif changes is not None:  # not cached yet: stored now (its tokens cut out at take_events)
                    changes.append((key, True, keys[i - 1] if i else parent, token_ids, first + i))
            refs[key] = held + 1

    def release(self, keys: Sequence[int]) -> None:
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
        changes = self.changes
        while len(self.free) > limit:
            key, _ = self.free.popitem(last=False)
            del self.refs[key]
            if changes is not None:
                changes.append((key, False, None, (), 0))
            evicted += 1
        return evicted

    def take_changes(self) -> tuple[list[int], list[int]]:
        """The keys stored and the keys evicted since the last take (module docstring, "Change
        log"); ([], []) without a log."""
        changes = self.changes
        if not changes:  # every engine step asks: the common answer first
            return [], []
        self.changes = []
        net = {change[0]: change[1] for change in changes}  # a key's last change wins
        return [key for key, cached in net.items() if cached], [key for key, cached in net.items() if not cached]

    def take_events(self) -> list[BlockChange]:
        """The blocks stored and evicted since the last take, in order; [] without a log."""
        changes, size = self.changes, self.block_tokens
        if not changes:
            return []
        self.changes = []
        return [BlockChange(key, stored, parent, tuple(tokens[block * size:(block + 1) * size]))
                for key, stored, parent, tokens, block in changes]
