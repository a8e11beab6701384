"""bench/cache_ceiling.py: the hit rate of one never-evicting cache, counted as vLLM counts."""

from __future__ import annotations

from laswrr.bench.cache_ceiling import ceiling


def test_a_repeated_prompt_hits_its_whole_blocks_but_never_its_last_token() -> None:
    prompt = list(range(1, 2 * 16 + 1))  # 32 tokens: two blocks of 16
    assert ceiling([prompt, prompt], 16) == {"requests": 2, "prompt_tokens": 64, "hit_tokens": 16,
                                              "hit_rate": 0.25}  # the second block ends at the last token
    longer = prompt + [99]
    assert ceiling([prompt, longer], 16)["hit_tokens"] == 32  # a next turn finds both blocks of the first


def test_a_prefix_counts_only_up_to_the_first_block_never_seen() -> None:
    first = list(range(48))
    other = list(range(16)) + [500] * 16 + list(range(32, 48)) + [1]  # its second block differs
    assert ceiling([first, other], 16)["hit_tokens"] == 16
