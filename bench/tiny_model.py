"""Build the tiny deterministic Llama that the real-vLLM tier serves (run with the vLLM venv's python).

    <vllm-venv>/bin/python bench/tiny_model.py OUT_DIR TRAINING_TEXT [--seed 0]

Writes a Hugging Face model directory vLLM loads with no download: ``config.json`` (Llama, hidden
128, 2 layers, 2 attention heads, 1 KV head, head_dim 64: vLLM's CPU attention rejects head_dim
16), ``model.safetensors`` (random weights from ``--seed``), ``generation_config.json`` and a
byte-level BPE tokenizer of 1,024 tokens trained with ``tokenizers`` on TRAINING_TEXT, saved with
a chat template (``continue_final_message`` works through it). Same inputs, same bytes.

The model generates nonsense, fast. Its EOS row of ``lm_head`` is zero and the other rows have a
large spread (std 1), so the EOS logit sits at the median of a ~N(0, 11^2) spread: a request runs
to its ``max_tokens`` (probability of an early stop ~e^-30 a token), as the benchmarks' workloads
assume.

Only torch, safetensors and tokenizers are imported (the vLLM venv has them); ``bench/real_vllm.py``
runs this file as a script and never imports it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, MAX_POS = 128, 2, 2, 1, 64, 256, 1024, 2048
SPECIAL = ["<|pad|>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0..5
# Each message is "<|role|>" + content + "\n"; with add_generation_prompt, "<|assistant|>" follows.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def config() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }


def weights(seed: int) -> dict[str, object]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ones(HIDDEN),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": ones(HIDDEN),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    head = normal(VOCAB, HIDDEN, std=1.0)
    head[2] = 0  # EOS: see the module docstring
    out |= {"model.norm.weight": ones(HIDDEN), "lm_head.weight": head}
    return out


def tokenizer(text: str, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<|pad|>", "add_bos_token": False, "model_max_length": MAX_POS,
        "chat_template": CHAT_TEMPLATE}, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|pad|>"}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("text", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config(), indent=1) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=1) + "\n")
    save_file(weights(args.seed), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer(args.text.read_text(encoding="utf-8"), args.out)


if __name__ == "__main__":
    main()
