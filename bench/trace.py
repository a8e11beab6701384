"""Real LLM-serving traces as bench workloads: Mooncake FAST'25 JSONL and Azure 2023 CSV.

Theory of operation:

* **Rows.** A trace is read into ``TraceRow``s: arrival (seconds from the trace's first row),
  prompt and output tokens, and, for Mooncake, ``hash_ids``: the ids of the prompt's 512-token
  blocks, equal leading ids meaning an equal prefix. Azure rows have no prefix information.
  Format by file name: ``.jsonl`` is Mooncake, ``.csv`` is Azure. A malformed row is a
  ``TraceError`` naming the file and line, never a crash halfway through a run.
* **Window.** ``TraceWindow`` picks the rows arriving in ``[start_s, start_s + window_s)`` and
  replays them ``speed`` times faster: offset = (arrival − start_s) / speed. Arrivals are kept
  as the trace has them, bursts included (Mooncake's stamps come in ~3 s steps, so dozens of
  requests share one; they are sent together, as the trace says).
* **Requests.** Each row becomes a ``RequestSpec`` with the row's prompt tokens as
  ``prompt_tokens``, its output tokens as ``max_tokens`` (the simulated engine emits exactly
  that many) and its ``hash_ids`` as ``block_ids``; ``workload.prompt_text`` then builds a text
  in which every id is one fixed 2048-character block (512 simulated tokens), so two prompts share
  text exactly where the trace says they share a prefix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal

from laswrr.bench.workload import RequestSpec

TraceFormat = Literal["mooncake", "azure"]
TRACES_DIR = Path(__file__).resolve().parent / "traces"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


class TraceError(ValueError):
    """A trace file that cannot be replayed (unknown format, malformed row)."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    at_s: float  # arrival, seconds from the trace's first row
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceWindow:
    path: str  # a file; a bare name is looked up in bench/traces/
    start_s: float = 0.0
    window_s: float | None = None  # None: to the end of the trace
    speed: float = 1.0
    spread: bool = False  # rows sharing a stamp spread evenly up to the next stamp (``select``)

    def validate(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"--speed must be > 0, got {self.speed}")
        if self.start_s < 0 or (self.window_s is not None and self.window_s <= 0):
            raise ValueError("--start-s must be >= 0 and --window-s > 0")

    @property
    def file(self) -> Path:
        path = Path(self.path)
        return path if path.exists() or path.is_absolute() or len(path.parts) > 1 else TRACES_DIR / path

    def replay_s(self, rows: Sequence[TraceRow]) -> float:
        """How long the replay lasts: the window (or to the last row) divided by the speed."""
        end = self.start_s + self.window_s if self.window_s is not None else (rows[-1].at_s if rows else 0.0)
        return max(0.0, end - self.start_s) / self.speed

    def scaled(self, factor: float) -> "TraceWindow":
        return self if self.window_s is None else replace(self, window_s=self.window_s * factor)


def trace_format(path: Path) -> TraceFormat:
    if path.suffix == ".jsonl":
        return "mooncake"
    if path.suffix == ".csv":
        return "azure"
    raise TraceError(f"{path}: unknown trace format (Mooncake .jsonl or Azure .csv)")


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def parse_mooncake(lines: Sequence[str], name: str = "trace") -> list[TraceRow]:
    rows: list[TraceRow] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            ms = data["timestamp"]
            if isinstance(ms, bool) or not isinstance(ms, int | float) or ms < 0:
                raise ValueError(f"timestamp must be a number >= 0, got {ms!r}")
            ids = tuple(data.get("hash_ids", ()))
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("hash_ids must be integers")
            rows.append(TraceRow(ms / 1000.0, _positive(data["input_length"], "input_length"),
                                 _positive(data["output_length"], "output_length"), ids))
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{name}:{number}: {type(exc).__name__}: {exc}") from None
    return _sorted(rows)


def parse_azure(lines: Sequence[str], name: str = "trace") -> list[TraceRow]:
    if not lines or lines[0].strip() != AZURE_HEADER:
        raise TraceError(f"{name}:1: expected the header {AZURE_HEADER!r}")
    rows: list[TraceRow] = []
    first: datetime | None = None
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            stamp, context, generated = line.strip().split(",")
            at = datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f")  # %f takes 6 of the 7 digits
            first = first or at
            rows.append(TraceRow((at - first).total_seconds(), _positive(int(context), "ContextTokens"),
                                 _positive(int(generated), "GeneratedTokens")))
        except ValueError as exc:
            raise TraceError(f"{name}:{number}: {exc}") from None
    return _sorted(rows)


def _sorted(rows: list[TraceRow]) -> list[TraceRow]:
    if not rows:
        raise TraceError("the trace has no rows")
    base = min(r.at_s for r in rows)
    return sorted((replace(r, at_s=r.at_s - base) for r in rows), key=lambda r: r.at_s)


def read_trace(path: Path) -> list[TraceRow]:
    kind = trace_format(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    return parse_mooncake(lines, str(path)) if kind == "mooncake" else parse_azure(lines, str(path))


def select(rows: Sequence[TraceRow], window: TraceWindow) -> list[RequestSpec]:
    """The window's rows as requests, offsets from the window's start divided by the speed; with
    ``window.spread``, spread (``spread_bursts``)."""
    end = float("inf") if window.window_s is None else window.start_s + window.window_s
    chosen = [r for r in rows if window.start_s <= r.at_s < end]
    if window.spread:
        chosen = spread_bursts(chosen, end)
    return [RequestSpec(index=i, offset_s=round((r.at_s - window.start_s) / window.speed, 6),
                        prompt_tokens=r.prompt_tokens, max_tokens=r.output_tokens, cancel_after_s=None,
                        block_ids=r.hash_ids)
            for i, r in enumerate(chosen)]


def spread_bursts(rows: Sequence[TraceRow], end_s: float = float("inf")) -> list[TraceRow]:
    """``rows`` (sorted by arrival) with the rows of each stamp spread evenly over the time to the
    next stamp, in their order: k rows at t, the next stamp at t', arrive at t + (t' - t) * j / k.
    The last stamp's rows spread over the mean step between stamps, or up to ``end_s`` when that
    comes sooner. For traces whose stamps lost their resolution (Mooncake's conversation trace: ~3 s
    steps, dozens of requests on one stamp), an arrival pattern as the stamps would have had it
    with the resolution they lost; the order and the count of requests per step are kept."""
    stamps = sorted({r.at_s for r in rows})
    if not stamps or (len(stamps) < 2 and end_s == float("inf")):
        return list(rows)  # nothing to spread (an empty window is load_workload's error to report)
    mean_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    following = dict(zip(stamps, [*stamps[1:], min(end_s, stamps[-1] + mean_step)]))
    groups: dict[float, list[TraceRow]] = {}
    for row in rows:
        groups.setdefault(row.at_s, []).append(row)
    return [replace(row, at_s=at + (following[at] - at) * j / len(group))
            for at, group in groups.items() for j, row in enumerate(group)]


def load_workload(window: TraceWindow) -> list[RequestSpec]:
    window.validate()
    requests = select(read_trace(window.file), window)
    if not requests:
        raise TraceError(f"{window.file}: no rows in [{window.start_s}, {window.start_s + (window.window_s or 0)}) s")
    return requests


def arrival_bursts(offsets: Sequence[float], duration_s: float) -> dict[str, float | int]:
    """Requests, mean and peak arrivals per 1 s of the replay (the trace's bursts)."""
    per_second: dict[int, int] = {}
    for t in offsets:
        per_second[int(t)] = per_second.get(int(t), 0) + 1
    return {"requests": len(offsets), "mean_per_s": round(len(offsets) / duration_s, 3) if duration_s > 0 else 0.0,
            "peak_per_s": max(per_second.values(), default=0)}
