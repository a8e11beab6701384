"""The pure parts of continuation (scheduler/routing/continuation.py): framing, reading, rewriting, bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from laswrr.scheduler.routing.continuation import (
    Broken,
    SseFramer,
    StreamText,
    continuation_body,
    not_continuable,
    route_kind,
)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(content: str | None = None, role: bool = False, finish: str | None = None, **delta: Any) -> bytes:
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 11, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_framer_yields_whole_events_across_reads_and_crlf() -> None:
    framer = SseFramer()
    stream = chat_chunk("a") + b": keep-alive\n\n" + chat_chunk("b")
    cut = len(chat_chunk("a")) + 5
    assert list(framer.feed(stream[:3])) == []
    assert list(framer.feed(stream[3:cut])) == [chat_chunk("a")]
    assert list(framer.feed(stream[cut:])) == [b": keep-alive\n\n", chat_chunk("b")]
    assert list(SseFramer().feed(b"data: [DONE]\r\n\r\n")) == [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("path, kind", [("/v1/chat/completions", "chat"), ("/v1/completions?x=1", "completion"),
                                        ("/v1/embeddings", None), ("/v1/responses", None)])
def test_only_the_two_generation_routes_are_continuable(path: str, kind: str | None) -> None:
    assert route_kind(path) == kind


@pytest.mark.parametrize("body, why", [
    ({"messages": [], "n": 2}, "n > 1"),
    ({"messages": [], "logprobs": True}, "logprobs requested"),
    ({"messages": [], "top_logprobs": 3}, "logprobs requested"),
    ({"messages": [], "seed": 0}, "seed given (exact reproducibility)"),
    ({"messages": [], "response_format": {"type": "json_schema"}}, "structured output"),
    ({"messages": [], "guided_json": {}}, "structured output"),
    ({"messages": [], "logprobs": False, "n": 1, "response_format": {"type": "text"}}, None),
])
def test_what_makes_a_request_not_continuable(body: dict[str, Any], why: str | None) -> None:
    assert not_continuable("chat", json.dumps(body).encode()) == why
    assert not_continuable("chat", b"[1, 2]") == "the request body is not a JSON object"
    assert not_continuable("completion", json.dumps({"prompt": "x", "echo": True}).encode()) == "echo requested"


def test_reading_counts_text_and_notes_the_finish() -> None:
    text = StreamText("chat")
    for event in (chat_chunk("", role=True), chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(finish="length")):
        assert text.event(event) == event  # the first attempt passes byte for byte
    assert (text.text, text.tokens, text.finished, text.done) == ("Hello", 2, True, False)
    assert text.event(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and text.done


def test_a_tool_call_in_progress_blocks_continuation() -> None:
    text = StreamText("chat")
    text.event(chat_chunk(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": "{"}}]))
    assert text.blocked == "a tool call or reasoning was in progress"


@pytest.mark.parametrize("event", [b"data: {not json\n\n", sse({"error": {"message": "engine dead", "code": 500}})])
def test_an_undecodable_or_error_event_is_a_break(event: bytes) -> None:
    with pytest.raises(Broken):
        StreamText("chat").event(event)


def test_a_continuation_is_rewritten_into_the_first_attempts_stream() -> None:
    text = StreamText("chat")
    text.event(chat_chunk("", role=True))
    text.event(chat_chunk("one "))
    text.event(chat_chunk("two "))
    text.next_attempt()
    other = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 99, "model": "m"}
    assert text.event(sse({**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})) is None
    out = text.event(sse({**other, "choices": [{"index": 0, "delta": {"content": "three "}}]}))
    assert out is not None and json.loads(out[6:]) == {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                                       "created": 11, "model": "m",
                                                       "choices": [{"index": 0, "delta": {"content": "three "}}]}
    usage = text.event(sse({**other, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                                                              "total_tokens": 13}}))
    assert usage is not None and json.loads(usage[6:])["usage"] == {"prompt_tokens": 10, "completion_tokens": 3,
                                                                     "total_tokens": 13}
    assert (text.text, text.tokens) == ("one two three ", 3)


def test_continuation_bodies() -> None:
    text = StreamText("completion", parts=["a b "], chunks=2)
    body = json.loads(continuation_body(json.dumps({"prompt": "P: ", "max_tokens": 5, "min_tokens": 1}).encode(),
                                        text) or b"")
    assert body == {"prompt": "P: a b ", "max_tokens": 3, "min_tokens": 0}
    assert json.loads(continuation_body(json.dumps({"prompt": ["P: "]}).encode(), text) or b"")["prompt"] == ["P: a b "]
    assert continuation_body(json.dumps({"prompt": "P", "max_tokens": 2}).encode(), text) is None  # budget spent

    chat = StreamText("chat", parts=["Hi "], chunks=1)
    messages = [{"role": "user", "content": "q"}]
    body = json.loads(continuation_body(json.dumps({"messages": messages, "max_completion_tokens": 9}).encode(),
                                        chat) or b"")
    assert body == {"messages": [*messages, {"role": "assistant", "content": "Hi "}], "max_completion_tokens": 8,
                    "continue_final_message": True, "add_generation_prompt": False}
    own = {"messages": [*messages, {"role": "assistant", "content": "Well, "}], "continue_final_message": True,
           "add_generation_prompt": False}
    assert json.loads(continuation_body(json.dumps(own).encode(), chat) or b"")["messages"][-1] == {
        "role": "assistant", "content": "Well, Hi "}
    chat.finished = True
    assert continuation_body(json.dumps({"messages": messages}).encode(), chat) is None


def test_the_proxy_ends_a_stream_whose_budget_is_spent() -> None:
    text = StreamText("completion")
    text.event(sse({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                    "choices": [{"index": 0, "text": "x ", "finish_reason": None}]}))
    first, done = text.ending().split(b"\n\n")[:2]
    assert json.loads(first[6:]) == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                     "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "text": ""}]}
    assert done == b"data: [DONE]"
