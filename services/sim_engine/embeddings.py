"""``POST /v1/embeddings`` of the simulated engine: request parsing and the answer (pure, no I/O).

As vLLM's pooling models answer it: ``input`` is a string, a list of strings, a list of token
ids or a list of such lists; one unit vector per input, deterministic for a seed and the input
text (same text, same vector), ``DEFAULT_DIMENSIONS`` long unless ``dimensions`` asks for
fewer or more; ``encoding_format`` ``float`` (JSON numbers) or ``base64`` (little-endian
float32, what the ``openai`` client asks for by default). The engine runs each request as a
prefill of all its inputs plus one step, so embeddings take slots like completions do.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from laswrr.services.sim_engine.openai_api import ApiError, estimate_tokens

DEFAULT_DIMENSIONS = 32
MAX_DIMENSIONS = 4096
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    texts: tuple[str, ...]
    prompt_tokens: int
    dimensions: int
    encoding_format: str


def _inputs(raw: Any) -> tuple[list[str], int]:
    """The input texts and their token count."""
    if isinstance(raw, str):
        raw = [raw]
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raw = [raw]  # one pre-tokenised input
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a string, a list of strings or token ids", code="invalid_value",
                       param="input")
    texts, tokens = [], 0
    for item in raw:
        if isinstance(item, str):
            texts.append(item)
            tokens += estimate_tokens(item)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            texts.append(" ".join(map(str, item)))
            tokens += len(item)
        else:
            raise ApiError(400, "each input must be a string or a non-empty list of token ids", code="invalid_value",
                           param="input")
    return texts, tokens


def parse_embedding_request(body: Any, default_model: str) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="bad_request")
    model = body.get("model", default_model)
    if model != default_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found", "model")
    texts, tokens = _inputs(body.get("input"))
    dimensions = body.get("dimensions", DEFAULT_DIMENSIONS)
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= MAX_DIMENSIONS:
        raise ApiError(400, f"'dimensions' must be an integer in 1..{MAX_DIMENSIONS}", code="invalid_value",
                       param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise ApiError(400, f"'encoding_format' must be one of {', '.join(ENCODINGS)}", code="invalid_value",
                       param="encoding_format")
    return EmbeddingRequest(model, tuple(texts), tokens, dimensions, encoding)


def vector(seed: int, text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text``."""
    rng = random.Random(f"{seed}:{zlib.crc32(text.encode())}")
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def embedding_response(req: EmbeddingRequest, seed: int) -> dict[str, Any]:
    data = []
    for index, text in enumerate(req.texts):
        values = vector(seed, text, req.dimensions)
        encoded: list[float] | str = values if req.encoding_format == "float" else \
            base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return {"object": "list", "model": req.model, "data": data,
            "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens}}
