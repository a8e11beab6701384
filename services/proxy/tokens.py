"""A request's prompt as its engine's token ids, for the exact cache view (``--tokenizer DIR``).

The nodes whose engines publish KV events (``laswrr kv-events``, ``lb.kv.<node>``) are matched on
the tokens their engine caches (``scheduler.routing.kvindex``), so the proxy must turn a request
into the same tokens as the engine: ``DIR`` is the model's tokenizer directory, as the engine
loads it (``tokenizer.json``, read with the ``tokenizers`` package, and ``tokenizer_config.json``,
its ``chat_template`` and special tokens; no hub access). As vLLM does:

* a **chat** request: the messages rendered with the chat template (jinja2, sandboxed, with
  ``add_generation_prompt``, ``bos_token``/``eos_token`` and HF's ``raise_exception``; a message
  whose content is a list of parts has its text parts joined by newlines), then encoded without
  special tokens (the template adds them);
* a **completion** request: the prompt encoded with the tokenizer's special tokens.

Anything that does not render or encode (no template, a template error, an unexpected shape)
gives None: the request is matched by the estimated view alone, never refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIN_THREAD_CHARS = 2048  # a longer prompt is tokenized in a thread (0.5 ms and up), off the event loop


def _special(config: dict[str, Any], name: str) -> str:
    token = config.get(name)
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None if content is not None else ""


class PromptTokenizer:
    """The engine's tokens of a request (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer  # imported only by a proxy with --tokenizer

        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {directory}: no tokenizer.json there")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        self.specials = {name: _special(config, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        self.template = None
        if isinstance(template, str):
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            self.template = env.from_string(template)

    def chat_prompt(self, messages: list[Any]) -> str | None:
        """The chat template's text for ``messages`` (None: no template, or it does not render)."""
        if self.template is None:
            return None
        shaped = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            text = _text(message.get("content"))
            if text is None:
                return None
            shaped.append({**message, "content": text})
        try:
            return self.template.render(messages=shaped, add_generation_prompt=True, **self.specials)
        except Exception:  # a template's own raise_exception, or any error inside it: no exact view
            return None

    def encode(self, messages: Any, prompt: Any) -> list[int] | None:
        """The request's token ids as its engine computes them; None when they cannot be known."""
        if isinstance(messages, list):
            text = self.chat_prompt(messages)
            return None if text is None else self.tokenizer.encode(text, add_special_tokens=False).ids
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # already token ids
        return None
