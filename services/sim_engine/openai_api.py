"""OpenAI wire format for the simulated engine: request parsing and response/chunk shaping.

Models what vLLM's OpenAI-compatible server accepts and returns for ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/responses`` (kind ``response``: ``input`` as a string or a list
of messages, ``instructions``, ``max_output_tokens``; the answer is a ``response`` object, or
the ``response.created`` / ``response.output_text.delta`` / ``response.completed`` SSE events
when streamed; embeddings are ``embeddings.py``): prompt length is a cheap estimate (chars / 4,
plus one per chat message), the output is deterministic filler words (one word = one token) seeded by the
engine seed and the prompt text, and errors use the ``{"error": {message, type, code}}``
shape. Non-standard request field ``"sim": {"output_tokens": N, "prompt_tokens": N}``
overrides the lengths (for load generators). Pure: no I/O.

**Continuations add up.** A router that continues a broken stream elsewhere sends the text so
far back as context: for completions appended to the prompt, for chat as a final assistant
message with vLLM's ``continue_final_message: true`` and ``add_generation_prompt: false`` (both
true is a 400, as in vLLM; ``add_generation_prompt`` defaults to true there too). Two rules make
the continued text and its token counts exactly those of an unbroken run:

* each output word is chosen from a running CRC-32 of the whole context (``zlib.crc32`` chains:
  crc(a + b) = crc(b, crc(a))), so generating from context + the first k words gives word k+1 on;
* every filler word is three letters and a space, four characters, exactly one token of the
  chars/4 estimate, so a prompt grown by k words counts k more tokens (a continued chat message
  counts its characters / 4, without the per-message token).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion", "response"]

DEFAULT_MAX_TOKENS = 64
FILLER_WORDS: tuple[str, ...] = (  # three letters each: word + space = 4 chars = one estimated token
    "tok", "sim", "npu", "hbm", "aic", "ddr", "bus", "die",
    "run", "ack", "key", "map", "row", "top", "gen", "put",
)
CHAT_GENERATION_PROMPT = "\n"  # what "add_generation_prompt" appends to the chat context


class ApiError(Exception):
    """An OpenAI-style error: HTTP status plus the JSON error body."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "code": self.code, "param": self.param}}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    kind: Kind
    model: str
    prompt_text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "length" when max_tokens bounds the output, else "stop"
    stream: bool
    include_usage: bool


def estimate_tokens(text: str) -> int:
    """Rough tokenizer: ~4 characters per token, at least one."""
    return max(1, math.ceil(len(text) / 4))


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, code="invalid_value" if param else "bad_request", param=param)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise _bad("message content must be a string or a list of content parts", "messages")


def _chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """The context the output continues, and its token count (see "Continuations add up")."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise _bad("each message must be an object with a 'role'", "messages")
    continue_final = bool(body.get("continue_final_message", False))
    if continue_final and body.get("add_generation_prompt", True):
        raise _bad("Cannot set both `add_generation_prompt` and `continue_final_message` to true.",
                   "continue_final_message")
    if continue_final and messages[-1].get("role") != "assistant":
        raise _bad("continue_final_message needs a final assistant message", "messages")
    closed = messages[:-1] if continue_final else messages
    text = "\n".join(_content_text(m.get("content")) for m in closed)
    tokens = estimate_tokens(text) + len(closed)
    if not continue_final:
        return text + CHAT_GENERATION_PROMPT, tokens
    final = _content_text(messages[-1].get("content"))
    return text + CHAT_GENERATION_PROMPT + final, tokens + math.ceil(len(final) / 4)


def _completion_prompt(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)  # pre-tokenised prompt
    raise _bad("'prompt' must be a string (or a list of token ids)", "prompt")


def _responses_prompt(body: dict[str, Any]) -> tuple[str, int]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of messages", "input")
    instructions = body.get("instructions")
    parts = [instructions] if isinstance(instructions, str) else []
    for item in items:
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", "input")
        parts.append(_content_text(item.get("content")))
    text = "\n".join(parts)
    return text, estimate_tokens(text) + len(parts)


_PROMPTS = {"chat": _chat_prompt, "completion": _completion_prompt, "response": _responses_prompt}


def _positive_int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"'{param}' must be a positive integer, got {value!r}", param)
    return value


def parse_request(body: Any, kind: Kind, default_model: str) -> CompletionRequest:
    """Validate a decoded JSON body; ApiError(400) on anything we do not accept."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    text, prompt_tokens = _PROMPTS[kind](body)
    model = body.get("model", default_model)
    if model != default_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found", "model")
    if body.get("n", 1) != 1:
        raise _bad("only n=1 is supported", "n")
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if kind == "response":
        max_key = "max_output_tokens"
    max_tokens = body.get(max_key)
    max_tokens = None if max_tokens is None else _positive_int(max_tokens, max_key)
    sim = body.get("sim") or {}
    if not isinstance(sim, dict):
        raise _bad("'sim' must be an object", "sim")
    if "prompt_tokens" in sim:
        prompt_tokens = _positive_int(sim["prompt_tokens"], "sim.prompt_tokens")
    output_tokens, finish = _output_length(max_tokens, sim)
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    return CompletionRequest(kind, model, text, prompt_tokens, output_tokens, finish, stream, include_usage)


def _output_length(max_tokens: int | None, sim: dict[str, Any]) -> tuple[int, str]:
    if "output_tokens" in sim:
        wanted = _positive_int(sim["output_tokens"], "sim.output_tokens")
        if max_tokens is not None and wanted >= max_tokens:
            return max_tokens, "length"
        return wanted, "stop"
    if max_tokens is None:
        return DEFAULT_MAX_TOKENS, "stop"
    return max_tokens, "length"


def filler_tokens(seed: int, context: str, count: int) -> list[str]:
    """Deterministic output words (each ends with a space) that continue ``context``.

    Word i is picked by the CRC-32 of the seed, the context and the words before it, so the
    words after context + w1..wk are wk+1, wk+2, ... of the words after context alone.
    """
    state = zlib.crc32(context.encode(), seed & 0xFFFFFFFF)
    words: list[str] = []
    for _ in range(count):
        word = FILLER_WORDS[(state * 0x9E3779B1 >> 20) % len(FILLER_WORDS)] + " "
        words.append(word)
        state = zlib.crc32(word.encode(), state)
    return words


def _choice(kind: Kind, text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    if kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _envelope(kind: Kind, rid: str, created: int, model: str, streaming: bool) -> dict[str, Any]:
    if kind == "chat":
        obj = "chat.completion.chunk" if streaming else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_chunk(kind: Kind, rid: str, created: int, model: str, text: str | None,
                 finish: str | None = None, first: bool = False) -> dict[str, Any]:
    chunk = _envelope(kind, rid, created, model, True)
    chunk["choices"] = [_choice(kind, text, finish, first)]
    return chunk


def usage_chunk(kind: Kind, rid: str, created: int, model: str, prompt: int, completion: int) -> dict[str, Any]:
    chunk = _envelope(kind, rid, created, model, True)
    chunk["choices"] = []
    chunk["usage"] = usage(prompt, completion)
    return chunk


def full_response(kind: Kind, rid: str, created: int, model: str, text: str, finish: str,
                  prompt: int, completion: int) -> dict[str, Any]:
    body = _envelope(kind, rid, created, model, False)
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    body["choices"] = [choice]
    body["usage"] = usage(prompt, completion)
    return body


# -- /v1/responses ---------------------------------------------------------------------------------


def response_object(rid: str, created: int, model: str, text: str | None, finish: str,
                    prompt: int, completion: int) -> dict[str, Any]:
    """A ``response`` object: ``in_progress`` with no output while ``text`` is None, else completed."""
    done = text is not None
    output = [{"type": "message", "id": f"msg_{rid[5:]}", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}] if done else []
    incomplete = {"reason": "max_output_tokens"} if done and finish == "length" else None
    status = "in_progress" if not done else "incomplete" if incomplete else "completed"
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "incomplete_details": incomplete, "error": None, "parallel_tool_calls": False,
            "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}
            if done else None}


def response_event(event_type: str, sequence: int, **fields: Any) -> dict[str, Any]:
    return {"type": event_type, "sequence_number": sequence, **fields}


def text_delta(rid: str, sequence: int, delta: str) -> dict[str, Any]:
    return response_event("response.output_text.delta", sequence, item_id=f"msg_{rid[5:]}", output_index=0,
                          content_index=0, delta=delta, logprobs=[])
