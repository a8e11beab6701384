"""Continuing a broken stream on another node: reading the SSE the client was sent, and the
continuation request that picks up where it broke. No IO here; ``upstream`` drives it.

Theory of operation. When a request may be continued, the proxy forwards its SSE stream one
whole event at a time (``SseFramer``: bytes in, complete ``\\n\\n``-terminated events out, so the
client never holds half an event when an engine dies) and ``StreamText`` reads each event it
forwards: the text so far, the tokens so far (the engine's ``usage.completion_tokens`` when a
chunk carries it, else one per chunk with text), whether the choice finished, and the ``id``,
``created``, ``object`` and ``model`` of the first chunk. After a break the proxy sends
``continuation_body`` to another node and forwards that node's events through ``StreamText``
too, rewritten so the client sees one completion:

* ``id`` and ``created`` (and ``model``) are those of the first attempt's chunks;
* a chat delta's ``role`` is dropped (the client already has it) and a chunk left with nothing
  (no text, no finish, no usage, no tool call) is not forwarded;
* ``usage`` counts against the original prompt: ``prompt_tokens`` is the continuation's prompt
  less the tokens it was sent back, ``completion_tokens`` the sum over the attempts.

Continuation requests (vLLM's and SGLang's OpenAI servers take both forms):

* ``/v1/completions``: the prompt is the original prompt plus the text so far;
* ``/v1/chat/completions``: the messages plus an assistant message holding the text so far (or
  that text appended to a final assistant message the client itself asked to continue), with
  ``continue_final_message: true`` and ``add_generation_prompt: false``;
* both: ``max_tokens`` / ``max_completion_tokens`` (and ``min_tokens``) less the tokens so far.
  When nothing is left to generate (the finish was sent, or the token budget is spent) the
  proxy ends the stream itself (a ``finish_reason: "length"`` chunk when none was sent, then
  ``[DONE]``) instead of sending a continuation.

Not continuable (``not_continuable`` says why; the break then ends the stream with the SSE
error event): another route; ``n`` or ``best_of`` above 1, a list of prompts or token ids;
``logprobs``/``top_logprobs``, ``echo``, a ``seed`` (exact reproducibility), structured output
(``response_format`` other than text, ``guided_*``, ``structured_outputs``); and, seen in the
stream, a tool call or reasoning text in progress (the continued message would lose them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Kind = Literal["chat", "completion"]
ROUTES: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
DONE_EVENT = b"data: [DONE]\n\n"
_TOKEN_KEYS = ("max_tokens", "max_completion_tokens")
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class Broken(Exception):
    """The engine's stream cannot go on (an error event, or an event that is not JSON)."""


# -- is the request continuable? ------------------------------------------------------------------

_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a body's top level: prompts and messages stay undecoded


def route_kind(path_qs: str) -> Kind | None:
    return ROUTES.get(path_qs.split("?", 1)[0].rstrip("/"))


def not_continuable(kind: Kind | None, body: bytes) -> str | None:
    """Why a stream of this request could not be continued elsewhere; None when it could."""
    if kind is None:
        return "this route is not continuable"
    try:
        fields = _TOP.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "the request body is not a JSON object"

    def value(name: str) -> Any:  # only the fields that decide are decoded (null or absent: None)
        raw = fields.get(name)
        return None if raw is None else msgspec.json.decode(raw)

    if (value("n") not in (None, 1)) or (value("best_of") not in (None, 1)):
        return "n > 1"
    if value("logprobs") not in (None, False) or value("top_logprobs") not in (None, 0):
        return "logprobs requested"
    if value("echo"):
        return "echo requested"
    if value("seed") is not None:
        return "seed given (exact reproducibility)"
    response_format = value("response_format")
    if (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")) or \
            any(value(name) is not None for name in _STRUCTURED):
        return "structured output"
    if kind == "completion" and not _one_text_prompt(fields.get("prompt", msgspec.Raw(b"null"))):
        return "the prompt is not one string"
    return None


def _one_text_prompt(prompt: msgspec.Raw) -> bool:
    raw = bytes(prompt).lstrip()
    if raw.startswith(b'"'):
        return True
    if not raw.startswith(b"["):
        return False
    value = msgspec.json.decode(raw)
    return len(value) == 1 and isinstance(value[0], str)


# -- SSE framing --------------------------------------------------------------------------------

class SseFramer:
    """Bytes from the engine in, whole SSE events (each ending in a blank line) out."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        data = self._pending + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            yield data[start:end + 2]
            start = end + 2
        self._pending = data[start:]


# -- what the client was sent ---------------------------------------------------------------------

class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: Any = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    id: Any = None
    object: Any = None
    created: Any = None
    model: Any = None
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_CHUNK = msgspec.json.Decoder(_Chunk)


@dataclass(slots=True)
class StreamText:
    """One continuable stream as the client has received it, over all its attempts."""

    kind: Kind
    parts: list[str] = field(default_factory=list)
    tokens_before: int = 0  # sent by the attempts before the current one
    chunks: int = 0  # chunks with text in the current attempt
    usage_tokens: int | None = None  # the current attempt's usage.completion_tokens, when seen
    prompt_tokens: int | None = None  # of the original prompt, when known
    finished: bool = False
    done: bool = False
    blocked: str | None = None  # a tool call or reasoning in progress: no continuation
    head: dict[str, Any] | None = None  # id, object, created, model of the first chunk
    rewrite: bool = False  # the current attempt is a continuation

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def attempt_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tokens(self) -> int:
        return self.tokens_before + self.attempt_tokens

    def next_attempt(self) -> None:
        """The current attempt broke; what follows comes from a continuation."""
        self.tokens_before, self.chunks, self.usage_tokens, self.rewrite = self.tokens, 0, None, True

    def event(self, event: bytes) -> bytes | None:
        """Read one whole SSE event; what to send the client (None: nothing). Raises Broken."""
        if not event.startswith(b"data:"):
            return event  # a comment or another field: passed as is
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return DONE_EVENT if self.rewrite else event
        try:
            chunk = _CHUNK.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Broken(f"undecodable event from the engine: {exc}") from None
        if chunk.error is not None and not chunk.choices:
            raise Broken(f"error event from the engine: {payload[:200].decode(errors='replace')}")
        if self.head is None:
            self.head = {"id": chunk.id, "object": chunk.object, "created": chunk.created, "model": chunk.model}
        self._read(chunk)
        return self._rewritten(payload) if self.rewrite else event

    def _read(self, chunk: _Chunk) -> None:
        if chunk.usage is not None:
            if chunk.usage.completion_tokens is not None:
                self.usage_tokens = chunk.usage.completion_tokens
            if chunk.usage.prompt_tokens is not None and self.prompt_tokens is None:
                self.prompt_tokens = chunk.usage.prompt_tokens - self.tokens_before
        for choice in chunk.choices or ():
            text = choice.text if self.kind == "completion" else (choice.delta.content if choice.delta else None)
            if text:
                self.parts.append(text)
                self.chunks += 1
            delta = choice.delta
            if delta is not None and (delta.tool_calls or delta.reasoning_content or delta.reasoning):
                self.blocked = "a tool call or reasoning was in progress"
            if choice.finish_reason is not None:
                self.finished = True

    def _rewritten(self, payload: bytes) -> bytes | None:
        obj = msgspec.json.decode(payload)
        assert self.head is not None and isinstance(obj, dict)
        for key in ("id", "created", "model"):
            if self.head.get(key) is not None:
                obj[key] = self.head[key]
        keep = False
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
                keep = keep or any(delta.get(key) for key in ("content", "tool_calls", "reasoning_content", "reasoning"))
            keep = keep or bool(isinstance(choice, dict) and (choice.get("text") or choice.get("finish_reason")))
        usage = obj.get("usage")
        if isinstance(usage, dict):
            keep = True
            self._sum_usage(usage)
        return b"data: " + msgspec.json.encode(obj) + b"\n\n" if keep else None

    def _sum_usage(self, usage: dict[str, Any]) -> None:
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + self.tokens_before
        if self.prompt_tokens is not None:
            usage["prompt_tokens"] = self.prompt_tokens
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

    def ending(self) -> bytes:
        """The events that end the stream when nothing is left to generate."""
        out = b""
        if not self.finished and self.head is not None:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            if self.kind == "completion":
                choice["text"] = ""
            else:
                choice["delta"] = {}
            out = b"data: " + msgspec.json.encode({**self.head, "choices": [choice]}) + b"\n\n"
        return out + DONE_EVENT


def continuation_body(body: bytes, stream: StreamText) -> bytes | None:
    """The request that continues ``stream`` on another node; None when nothing is left to generate."""
    if stream.finished:
        return None
    obj = msgspec.json.decode(body)
    sent = stream.tokens
    for key in _TOKEN_KEYS:
        limit = obj.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent <= 0:
                return None
            obj[key] = limit - sent
    if isinstance(obj.get("min_tokens"), int):
        obj["min_tokens"] = max(0, obj["min_tokens"] - sent)
    text = stream.text
    if not text:
        return msgspec.json.encode(obj)  # nothing to carry over: send the request again
    if stream.kind == "completion":
        prompt = obj["prompt"]
        obj["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
    else:
        obj["messages"] = _continued_messages(obj, text)
        obj["continue_final_message"], obj["add_generation_prompt"] = True, False
    return msgspec.json.encode(obj)


def _continued_messages(obj: dict[str, Any], text: str) -> list[Any]:
    messages = list(obj.get("messages") or [])
    last = messages[-1] if messages else None
    if obj.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant" \
            and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    return messages
