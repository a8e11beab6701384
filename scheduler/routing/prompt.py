"""What prefix affinity and the work referee read from a request body: its prompt text and size.

The body is decoded once (``app.RequestPeek``); this module turns the decoded ``messages`` (chat)
or ``prompt`` (completions) into the bytes the prefix index hashes, and estimates the request's
tokens: the prompt at ~4 characters a token plus ``max_completion_tokens`` / ``max_tokens`` (the
decode reservation; 0 when absent). Both go on ``lb.req.started`` (``prompt_tokens``,
``max_tokens``), so the scheduler weighs tokens in flight too. Anything of an unexpected shape counts as no prompt (no
affinity, the plain LA-SWRR pick): the proxy never rejects a request the engine would take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(messages: Any, prompt: Any) -> bytes:
    """The prompt as the index hashes it: each chat message as role, newline, text, newline."""
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}\n{_content(message.get('content'))}\n")
        return "".join(parts).encode()
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0].encode()
    return b""


@dataclass(frozen=True, slots=True)
class RequestSize:
    """A request's size as the proxy sees it: the prompt estimate and the output limit."""

    prompt_tokens: int
    max_tokens: int | None = None


def request_size(text: bytes, max_tokens: Any, max_completion_tokens: Any) -> RequestSize:
    """``text``'s estimate (4 characters a token) and the body's ``max_completion_tokens`` or
    ``max_tokens`` (None when absent or not a positive integer)."""
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    valid = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    return RequestSize(len(text) // CHARS_PER_TOKEN, limit if valid else None)
