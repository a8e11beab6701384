"""Chat workloads with shared prefixes, generated up front from a seed (pure: no IO, no clock).

What a prefix cache is for: a few **system prompts**, each shared by many conversations, and
**multi-turn conversations** whose every turn resends the whole history (system prompt, the user
turns so far, the assistant's answers). A turn's prompt therefore starts with the previous turn's
prompt as the engine rendered it with the model's chat template, and an engine that served the
previous turn and still holds its blocks serves the prefix from its cache.

* Conversations start as a Poisson process at ``conversations_per_s``; each picks one of
  ``system_prompts`` uniformly and has ``turns_min..turns_max`` turns (uniform). A turn follows
  the previous one after ``think_min_s`` plus an exponential gap of mean ``think_s`` (a reader
  reading the answer); turns after ``duration_s`` are not sent.
* Texts are words drawn from ``WORDS`` (system prompts ``system_words`` long; user turns and
  assistant answers lognormal around ``user_words`` and ``assistant_words``, sigma 0.4). The
  assistant's answers are fixed texts of the workload (a transcript replayed), not what the engine
  generated: the workload stays open loop and identical for every row of a benchmark.
* Each request enters through the second proxy (``entry`` 1) with probability
  ``second_entry_share``, else through the first (``entry`` 0), turn by turn, as an L4
  balancer spreads connections: a conversation's turns may arrive at either proxy.

Every draw comes from ``random.Random`` seeded with ``seed`` (one stream for the conversations'
shapes and times, one per text), so the same spec and seed give byte-for-byte the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from laswrr.bench.workload import RequestSpec

WORDS = (
    "node", "pool", "engine", "request", "token", "prefix", "cache", "block", "weight", "capacity", "slot",
    "queue", "batch", "decode", "prefill", "stream", "proxy", "router", "latency", "tail", "budget", "health",
    "drain", "eject", "return", "signal", "metric", "sample", "window", "share", "load", "guard", "bound",
    "policy", "round", "robin", "least", "power", "choice", "random", "seed", "replay", "event", "log",
    "record", "snapshot", "table", "index", "view", "exact", "estimate", "model", "chip", "memory", "core",
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "at", "by", "from",
    "each", "every", "when", "then", "while", "after", "before", "more", "less", "than", "one", "two",
    "three", "many", "few", "all", "none", "some", "first", "last", "next", "new", "old", "fast", "slow",
    "high", "low", "full", "empty", "busy", "idle", "short", "long", "whole", "part", "same", "other",
    "keeps", "sends", "holds", "reads", "writes", "waits", "moves", "picks", "counts", "takes", "gives",
)
TEXT_SEED = 0x43A7  # mixed into the seed for the texts' streams


@dataclass(frozen=True, slots=True)
class ChatSpec:
    duration_s: float = 150.0
    conversations_per_s: float = 0.4
    system_prompts: int = 4
    system_words: int = 220
    turns_min: int = 2
    turns_max: int = 6
    user_words: int = 30  # median
    assistant_words: int = 40  # median
    think_min_s: float = 3.0
    think_s: float = 5.0  # mean of the exponential part of the gap between turns
    max_tokens: int = 24
    second_entry_share: float = 0.0

    def validate(self) -> None:
        if self.duration_s <= 0 or self.conversations_per_s <= 0:
            raise ValueError("duration_s and conversations_per_s must be > 0")
        if self.system_prompts < 1 or not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("system_prompts must be >= 1 and 1 <= turns_min <= turns_max")
        if min(self.system_words, self.user_words, self.assistant_words, self.max_tokens) < 1:
            raise ValueError("word counts and max_tokens must be >= 1")
        if self.think_min_s < 0 or self.think_s <= 0 or not 0 <= self.second_entry_share <= 1:
            raise ValueError("think_min_s must be >= 0, think_s > 0, second_entry_share in 0..1")


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _lognormal(rng: random.Random, median: int) -> int:
    return max(1, round(median * math.exp(0.4 * rng.gauss(0.0, 1.0))))


def generate_chat(spec: ChatSpec, seed: int) -> list[RequestSpec]:
    """The whole chat workload for ``spec`` and ``seed``, in arrival order (module docstring)."""
    spec.validate()
    rng = random.Random(seed)
    systems = [words(random.Random(f"{seed ^ TEXT_SEED}:system:{k}"), spec.system_words)
               for k in range(spec.system_prompts)]
    turns: list[tuple[float, int, tuple[tuple[str, str], ...]]] = []  # (offset, conversation, messages)
    start, conversation = 0.0, 0
    while True:
        start += rng.expovariate(spec.conversations_per_s)
        if start >= spec.duration_s:
            break
        system = rng.randrange(spec.system_prompts)
        count = rng.randint(spec.turns_min, spec.turns_max)
        gaps = [spec.think_min_s + rng.expovariate(1.0 / spec.think_s) for _ in range(count - 1)]
        text = random.Random(f"{seed ^ TEXT_SEED}:conversation:{conversation}")
        history: tuple[tuple[str, str], ...] = (("system", systems[system]),)
        at = start
        for turn in range(count):
            if turn:
                history += (("assistant", words(text, _lognormal(text, spec.assistant_words))),)
                at += gaps[turn - 1]
            history += (("user", words(text, _lognormal(text, spec.user_words))),)
            if at < spec.duration_s:
                turns.append((at, conversation, history))
        conversation += 1
    turns.sort(key=lambda t: (t[0], t[1]))
    entries = random.Random(f"{seed ^ TEXT_SEED}:entry")
    out = []
    for index, (at, _, messages) in enumerate(turns):
        entry = 1 if entries.random() < spec.second_entry_share else 0
        chars = sum(len(text) for _, text in messages)
        out.append(RequestSpec(index, round(at, 6), max(1, chars // 4), spec.max_tokens, None,
                               messages=messages, entry=entry))
    return out
