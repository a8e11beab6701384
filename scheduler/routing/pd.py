"""The prefill/decode protocols' bodies (docs/proxy.md, "Prefill/decode pairs").

**vllm.** vLLM and vLLM-Ascend disaggregate a request in two sequential legs, as vllm-router's
``--vllm-pd-disaggregation`` and vLLM's example proxies do:

1. the **prefill leg** goes to a prefill node: the client's body with ``max_tokens`` (and
   ``max_completion_tokens``) 1, ``stream`` false (no ``stream_options``) and
   ``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false, ...}``; the
   engine computes the prompt's KV, keeps it for the decode node, and answers JSON whose
   top-level ``kv_transfer_params`` says where the KV is;
2. the **decode leg** goes to a decode node: the client's body unchanged but for
   ``kv_transfer_params``, the object the prefill answered; it pulls the KV and generates, and
   its answer (streamed or not) is the client's.

Both legs carry the same ``X-Request-Id``.

**sglang.** SGLang (its router's and SMG's ``--pd-disaggregation``) runs both legs at once with
one body: the client's, plus ``bootstrap_host`` (the prefill node's host), ``bootstrap_port``
(its bootstrap server's port, from its registration) and ``bootstrap_room`` (a fresh random
63-bit integer per pair, which the caller draws: nothing here is random). The decode engine
meets the prefill engine at that address and room, pulls the KV and generates; the prefill
engine's own answer (its one token) is read and dropped.

Pure: bytes in, bytes out; every other value of the client's body passes byte for byte.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])

# what a prefill leg asks of a vLLM KV connector (vLLM's disaggregated-serving example proxy)
PREFILL_KV_PARAMS = msgspec.Raw(msgspec.json.encode({
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}))


class PdBodyError(ValueError):
    """A body the protocol cannot carry (not a JSON object; a prefill answer without KV params)."""


def _fields(body: bytes, what: str) -> dict[str, msgspec.Raw]:
    try:
        return _FIELDS.decode(body)
    except msgspec.DecodeError:
        raise PdBodyError(f"{what} is not a JSON object") from None


def prefill_body(body: bytes) -> bytes:
    """The prefill leg's body: one token, not streamed, the KV kept for a remote decode."""
    fields = _fields(body, "the request body")
    fields.pop("stream_options", None)
    fields["stream"] = msgspec.Raw(b"false")
    fields["max_tokens"] = msgspec.Raw(b"1")
    if "max_completion_tokens" in fields:
        fields["max_completion_tokens"] = msgspec.Raw(b"1")
    fields["kv_transfer_params"] = PREFILL_KV_PARAMS
    return msgspec.json.encode(fields)


def kv_transfer_params(answer: bytes) -> msgspec.Raw:
    """The ``kv_transfer_params`` object of a prefill leg's JSON answer (PdBodyError without one:
    an engine without a KV connector answers the one token and nothing to decode from)."""
    params = _fields(answer, "the prefill answer").get("kv_transfer_params")
    if params is None or not bytes(params).lstrip().startswith(b"{"):
        raise PdBodyError("the prefill answer has no kv_transfer_params object (is the engine's KV connector "
                          "configured as a producer?)")
    return params


def decode_body(body: bytes, params: msgspec.Raw) -> bytes:
    """The decode leg's body: the client's, with the prefill's ``kv_transfer_params``."""
    fields = _fields(body, "the request body")
    fields["kv_transfer_params"] = params
    return msgspec.json.encode(fields)


BOOTSTRAP_ROOM_BITS = 63  # SGLang's rooms: a random non-negative 64-bit signed integer


def bootstrap_host(url: str) -> str:
    """The host of a prefill node's URL, as SGLang's routers send it (an IPv6 address unbracketed)."""
    host = urlsplit(url).hostname
    if not host:
        raise PdBodyError(f"the prefill node's URL {url!r} has no host")
    return host


def sglang_body(body: bytes, host: str, port: int | None, room: int) -> bytes:
    """Both legs' body in the ``sglang`` protocol: the client's with the pair's bootstrap address and room."""
    fields = _fields(body, "the request body")
    fields["bootstrap_host"] = msgspec.Raw(msgspec.json.encode(host))
    fields["bootstrap_port"] = msgspec.Raw(msgspec.json.encode(port))
    fields["bootstrap_room"] = msgspec.Raw(msgspec.json.encode(room))
    return msgspec.json.encode(fields)
