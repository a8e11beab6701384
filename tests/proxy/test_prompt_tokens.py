"""The proxy's engine tokens of a request (services/proxy/tokens.py), on the tiny model's own
tokenizer and chat template as bench/tiny_model.py builds them for the real-engine tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tiny_model
from laswrr.services.proxy.tokens import PromptTokenizer



def test_a_chat_request_is_its_template_then_its_tokens(model_dir: Path) -> None:
    tok = PromptTokenizer(model_dir)
    messages = [{"role": "system", "content": "You route."}, {"role": "user", "content": "What does the guard do?"}]
    rendered = "<|system|>You route.\n<|user|>What does the guard do?\n<|assistant|>"
    assert tok.chat_prompt(messages) == rendered
    ids = tok.encode(messages, None)
    assert ids == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids is not None and ids[0] == tiny_model.SPECIAL.index("<|system|>")  # the role marker is one special token
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.chat_prompt(parts) == "<|user|>a\nb\n<|assistant|>"  # text parts joined as vLLM joins them


def test_a_completion_and_token_ids(model_dir: Path) -> None:
    tok = PromptTokenizer(model_dir)
    assert tok.encode(None, "the guard") == tok.tokenizer.encode("the guard").ids
    assert tok.encode(None, ["the guard"]) == tok.encode(None, "the guard")
    assert tok.encode(None, [5, 6, 7]) == [5, 6, 7]
    assert tok.encode(None, None) is None and tok.encode(None, [1, "x"]) is None


def test_what_cannot_be_rendered_has_no_tokens(model_dir: Path, tmp_path: Path) -> None:
    tok = PromptTokenizer(model_dir)
    assert tok.encode([{"role": "user", "content": 5}], None) is None
    assert tok.encode(["not a message"], None) is None
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                          "{{ messages[0]['content'] }}"}))
    strict = PromptTokenizer(tmp_path)
    assert strict.chat_prompt([{"role": "user", "content": "hi"}]) == "hi"
    assert strict.encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None) is None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert PromptTokenizer(tmp_path).encode([{"role": "user", "content": "hi"}], None) is None  # no template
    with pytest.raises(ValueError, match="no tokenizer.json"):
        PromptTokenizer(tmp_path / "missing")
