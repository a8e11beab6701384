"""The most a prefix cache can give a chat workload: every request served where each of its
leading blocks was computed before, caches never evicting (an upper bound no router reaches).

``python -m laswrr.bench.cache_ceiling [--scenario cache] [--seed 1] [--tokenizer DIR]`` renders
every request of the scenario's chat workload (bench/conversations.py, the same requests as
``laswrr bench --engines vllm --scenario S --seed N``) as its engine does (the model's chat template
and tokenizer: services/proxy/tokens.py, default the real-vLLM tier's tiny model), cuts it into
blocks of ``--block-tokens`` (128: the CPU build's), and counts, in arrival order, the leading
whole blocks already computed by an earlier request: the prompt tokens an engine could find cached
(never the prompt's last token, as vLLM counts) over all prompt tokens. That is the hit rate of one
engine with an infinite cache; a real pool loses to it what its first visits to each node and its
evictions cost. It prints that ceiling and its parts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from laswrr.bench.conversations import generate_chat
from laswrr.bench.scenarios import REAL_BLOCK_TOKENS, REAL_SCENARIOS
from laswrr.schemas.kvcache import chain_keys


def ceiling(prompts: list[list[int]], block_tokens: int) -> dict[str, float | int]:
    """The hit rate of one never-evicting cache over ``prompts`` (token ids, in arrival order)."""
    seen: set[int] = set()
    hit = total = 0
    for tokens in prompts:
        keys = chain_keys(tokens[:-1], block_tokens)
        depth = 0
        for key in keys:
            if key not in seen:
                break
            depth += 1
        hit += depth * block_tokens
        total += len(tokens)
        seen.update(chain_keys(tokens, block_tokens))  # its prefill computed every whole block of it
    return {"requests": len(prompts), "prompt_tokens": total, "hit_tokens": hit,
            "hit_rate": round(hit / total, 4) if total else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.cache_ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    chats = sorted(name for name, s in REAL_SCENARIOS.items() if s.chat is not None)
    parser.add_argument("--scenario", default="cache", choices=chats)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--block-tokens", type=int, default=REAL_BLOCK_TOKENS)
    parser.add_argument("--tokenizer", default=None, help="the model's tokenizer directory (default: the "
                        "real-vLLM tier's tiny model, bench/real_vllm.py)")
    args = parser.parse_args(argv)
    from laswrr.services.proxy.tokens import PromptTokenizer

    if args.tokenizer is None:
        from laswrr.bench import real_vllm
        args.tokenizer = str(real_vllm.model_dir())
    scenario = REAL_SCENARIOS[args.scenario]
    assert scenario.chat is not None
    requests = generate_chat(replace(scenario.chat, duration_s=scenario.duration_s), args.seed)
    tokenizer = PromptTokenizer(args.tokenizer)
    prompts = []
    for request in requests:
        tokens = tokenizer.encode([{"role": role, "content": text} for role, text in request.messages or ()], None)
        if tokens is None:
            print(f"cannot render request {request.index}'s chat prompt", file=sys.stderr)
            return 1
        prompts.append(tokens)
    print(json.dumps({"scenario": args.scenario, "seed": args.seed, "block_tokens": args.block_tokens,
                      **ceiling(prompts, args.block_tokens)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
