"""How exactly a row's cache view predicted what the engines found cached, request by request.

For every request the proxy records on its first ``lb.req.started`` the prompt tokens its view
predicted cached on the node it picked: ``cached_tokens`` (a proxy with ``--tokenizer``: the
exact view for a node whose engine publishes KV events, else the estimate's, both in engine
tokens); without a tokenizer the pick still records its latency estimate's ``prompt_tokens`` and
``uncached_tokens`` (the prompt less what the estimated view credits the node with, in the
estimate's 4-character tokens), so ``prompt_tokens - uncached_tokens`` is the estimated view's
prediction. The engine reports what it found in its answer's usage chunk
(``prompt_tokens_details.cached_tokens``: vLLM with ``--enable-prompt-tokens-details`` and
``stream_options.include_usage``; bench/load.py). Joined on the proxy's request id
(``x-laswrr-request-id``), per row: the share of requests predicted exactly, the mean absolute
error in tokens, each mismatch by direction and cause, and the share again by the time from the
pick to the request's first byte (how long the engine queued it: the cache changes meanwhile).

**Causes** (``cause``), from the engines' own KV events as the bench received them during the
row (``KvTimeline``: every ``lb.kv.<node>`` message with its arrival time, folded by the same
``KvIndex`` rules as a proxy's) and the request's engine tokens:

* ``elsewhere``: the request had another attempt (a retry, or a stream continued elsewhere: the
  prompt then also holds the text so far), so the count is not of the prompt predicted on the
  node picked;
* ``estimated view``: the prediction is the estimate's (no tokenizer, or no node of the pool had
  an exact view yet: the request was not tokenized);
* ``stored before prefill`` / ``evicted before prefill`` (under- / over-prediction): the engine's
  events said the node held exactly what it reported at some moment between the pick and the
  request's first byte (when the engine scheduled it), not at the pick: blocks another request
  stored meanwhile (often a request of the same prefix still in prefill at the pick), or evicted;
* ``ahead of the events at pick``: the prediction counted more than the events said the node
  held around the pick: with ``--kv-in-flight`` the blocks of this proxy's requests in flight
  there (``KvIndex``, "In flight") that the engine did not find (not stored yet, or freed), else
  the proxy's view ahead of the bench's copy of the events;
* ``view at pick``: the prediction is not what the events said the node held around the pick
  (the proxy's view lagged, was emptied by an ejection, or stale);
* ``unexplained``: none of these (no events received for the node, or a cause outside them: the
  request's tokens or block size not as the engine's).

Pure but for ``read_picks`` (DuckDB, read only), ``KvTimeline``'s ``add`` (a clock reading),
``save`` and ``load``, and ``row_figures``/``main`` (``python -m laswrr.bench.cache_view ROW...``:
a recorded row's figures again, from the files the bench saved of it).
"""

from __future__ import annotations

import base64
import bisect
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from laswrr.bench.metrics import RequestResult
from laswrr.scheduler.routing.kvindex import KvIndex
from laswrr.schemas.kvcache import CACHE_DECODER, CACHE_ENCODER, CacheChanged

WAITS_S = (1.0, 5.0)  # the figures again by how long the engine took to the request's first byte
PICK_SLACK_NS = 50_000_000  # a change that reached the bench up to 50 ms around the pick may have reached the proxy first


@dataclass(frozen=True, slots=True)
class Pick:
    """A request's first admission as its events recorded it."""

    request_id: str
    node: str
    ts_ns: int  # its lb.req.started
    predicted: int | None  # prompt tokens predicted cached on ``node`` (None: not recorded)
    exact: bool  # ``cached_tokens`` recorded (a tokenized request), else the estimate's figure
    prompt_tokens: int | None  # as the pick counted them (engine tokens when tokenized)
    first_byte_ns: int | None  # its attempt's first byte, when recorded
    attempts: int = 1  # a retry or a continuation elsewhere is another attempt (the engine answering is the last's)


_PICKS_SQL = """
WITH started AS (
    SELECT j->>'request_id' AS attempt_id, key AS node, TRY_CAST(j->>'ts_ns' AS BIGINT) AS ts_ns,
           TRY_CAST(j->>'cached_tokens' AS BIGINT) AS cached_tokens,
           TRY_CAST(j->>'prompt_tokens' AS BIGINT) AS prompt_tokens,
           TRY_CAST(j->>'uncached_tokens' AS BIGINT) AS uncached_tokens, seq, event_index
    FROM input_events WHERE family = 'lb.req.started' AND j->>'request_id' IS NOT NULL
), finished AS (
    SELECT j->>'request_id' AS attempt_id, TRY_CAST(j->>'ttft_ms' AS DOUBLE) AS ttft_ms,
           TRY_CAST(j->>'started_ms' AS DOUBLE) AS started_ms
    FROM input_events WHERE family = 'lb.req.finished' AND j->>'request_id' IS NOT NULL
)
SELECT s.attempt_id, s.node, s.ts_ns, s.cached_tokens, s.prompt_tokens, s.uncached_tokens, f.ttft_ms, f.started_ms
FROM started s LEFT JOIN finished f USING (attempt_id)
ORDER BY s.seq, s.event_index
"""


def read_picks(db_path: Path) -> dict[str, Pick]:
    """Each request's first admission in the recorded log (its attempts ``R``, ``R.1``, ...: ``R``)."""
    from laswrr.replay.store import open_read

    picks: dict[str, Pick] = {}
    with open_read(db_path) as con:
        rows = con.execute(_PICKS_SQL).fetchall()
    for attempt_id, node, ts_ns, cached, prompt, uncached, ttft_ms, started_ms in rows:
        request_id = attempt_id.split(".", 1)[0]
        if request_id in picks:
            picks[request_id] = replace(picks[request_id], attempts=picks[request_id].attempts + 1)
            continue
        if ts_ns is None:
            continue
        if cached is not None:
            predicted = cached
        elif prompt is not None and uncached is not None:
            predicted = max(0, prompt - uncached)
        else:
            predicted = None
        first_byte = None
        if ttft_ms is not None:
            first_byte = ts_ns + round((ttft_ms - (started_ms or 0.0)) * 1e6)
        picks[request_id] = Pick(request_id, node, ts_ns, predicted, cached is not None, prompt, first_byte)
    return picks


@dataclass(slots=True)
class KvTimeline:
    """Every KV change the bench received during a row, per node, with its arrival time (ns)."""

    changes: dict[str, list[tuple[int, CacheChanged]]] = field(default_factory=dict)
    clock: Callable[[], int] = time.time_ns

    def add(self, node: str, change: CacheChanged) -> None:
        self.changes.setdefault(node, []).append((self.clock(), change))

    def save(self, path: Path) -> None:
        """One JSON line per change: its arrival (ns), node and message (MessagePack, base64)."""
        rows = sorted((t, node, change) for node, changes in self.changes.items() for t, change in changes)
        with path.open("w") as handle:
            for t, node, change in rows:
                data = base64.b64encode(CACHE_ENCODER.encode(change)).decode()
                handle.write(json.dumps({"t_ns": t, "node": node, "change": data}) + "\n")

    @classmethod
    def load(cls, path: Path) -> KvTimeline:
        timeline = cls()
        for text in path.read_text().splitlines():
            row = json.loads(text)
            change = CACHE_DECODER.decode(base64.b64decode(row["change"]))
            timeline.changes.setdefault(row["node"], []).append((row["t_ns"], change))
        return timeline

    def depths(self, node: str, token_ids: Sequence[int], start_ns: int, end_ns: int) -> tuple[int | None, set[int]]:
        """The tokens the node's events said it held of ``token_ids`` (as vLLM counts a prompt's
        cached tokens: ``KvIndex.cached``) at ``start_ns``, and every value it took until ``end_ns``
        (None and nothing: no exact view of the node then)."""
        changes = self.changes.get(node, [])
        index = KvIndex()
        times = [t for t, _ in changes]
        first = bisect.bisect_right(times, start_ns)
        for _, change in changes[:first]:
            index.apply(node, change)
        at_start = index.cached(token_ids, (node,)).get(node)
        seen = set() if at_start is None else {at_start}
        for t, change in changes[first:]:
            if t > end_ns:
                break
            index.apply(node, change)
            value = index.cached(token_ids, (node,)).get(node)
            if value is not None:
                seen.add(value)
        return at_start, seen


Tokens = Callable[[int], Sequence[int] | None]  # a request's engine tokens by its workload index


def cause(pick: Pick, served: str | None, reported: int, timeline: KvTimeline | None,
          token_ids: Sequence[int] | None) -> str:
    """Why ``pick``'s prediction is not the ``reported`` count (module docstring, "Causes")."""
    assert pick.predicted is not None
    if served != pick.node or pick.attempts > 1:
        return "elsewhere"
    if not pick.exact:
        return "estimated view"
    if timeline is None or token_ids is None:
        return "unexplained"
    end = pick.first_byte_ns if pick.first_byte_ns is not None else pick.ts_ns
    around, near = timeline.depths(pick.node, token_ids, pick.ts_ns - PICK_SLACK_NS, pick.ts_ns + PICK_SLACK_NS)
    if around is None:
        return "unexplained"
    if pick.predicted not in near:  # more than the events said: with --kv-in-flight, blocks of requests in flight
        return "ahead of the events at pick" if near and pick.predicted > max(near) else "view at pick"
    _, later = timeline.depths(pick.node, token_ids, pick.ts_ns, end)
    if reported in later:
        return "stored before prefill" if reported > pick.predicted else "evicted before prefill"
    return "unexplained"


def accuracy(results: Iterable[RequestResult], picks: Mapping[str, Pick], timeline: KvTimeline | None = None,
             tokens: Tokens | None = None) -> dict[str, Any]:
    """The row's figures (module docstring): requests compared (a prediction recorded and the
    engine's count answered), the share predicted exactly, the mean absolute error (tokens), the
    mismatches by direction and cause, and how many predictions each view made (``views``)."""
    compared = equal = error = 0
    over: dict[str, int] = {}
    under: dict[str, int] = {}
    views = {"exact": 0, "estimated": 0}
    waits = {label: [0, 0] for label in _wait_labels()}  # compared, equal
    prompt_equal = prompt_known = 0
    for result in results:
        pick = picks.get(result.request_id)
        if pick is None or pick.predicted is None or result.cached_tokens is None:
            continue
        compared += 1
        views["exact" if pick.exact else "estimated"] += 1
        reported = result.cached_tokens
        if pick.exact and pick.attempts == 1 and result.prompt_tokens is not None and pick.prompt_tokens is not None:
            prompt_known += 1
            prompt_equal += pick.prompt_tokens == result.prompt_tokens
        if pick.first_byte_ns is not None:
            waited = waits[_wait_label((pick.first_byte_ns - pick.ts_ns) / 1e9)]
            waited[0] += 1
            waited[1] += pick.predicted == reported
        if pick.predicted == reported:
            equal += 1
            continue
        error += abs(pick.predicted - reported)
        token_ids = tokens(result.index) if tokens is not None else None
        why = cause(pick, result.node, reported, timeline, token_ids)
        side = over if pick.predicted > reported else under
        side[why] = side.get(why, 0) + 1
    return {
        "views": views,
        "compared": compared,
        "equal": equal,
        "equal_share": round(equal / compared, 4) if compared else None,
        "mean_abs_error_tokens": round(error / compared, 1) if compared else None,
        "over": dict(sorted(over.items())),
        "under": dict(sorted(under.items())),
        # by the time from the pick to the request's first byte: the engine's queue, which the cache outlives
        "by_first_byte": {label: {"compared": n, "equal": k} for label, (n, k) in waits.items()},
        # the prompt's tokens as the proxy counted them against the engine's (the chat template)
        "prompt_tokens_equal": f"{prompt_equal}/{prompt_known}" if prompt_known else None,
    }


def _wait_labels() -> list[str]:
    bounds = (0.0, *WAITS_S)
    return [f"{lo:g}-{hi:g} s" for lo, hi in zip(bounds, WAITS_S)] + [f">= {WAITS_S[-1]:g} s"]


def _wait_label(seconds: float) -> str:
    labels = _wait_labels()
    return labels[bisect.bisect_right(WAITS_S, seconds)]


def line(policy: str, figures: Mapping[str, Any]) -> str:
    """One row's figures as a line of text."""
    if not figures.get("compared"):
        return f"{policy}: no request with both a recorded prediction and the engine's cached count"
    causes = "; ".join(f"{side} {why} {n}" for side in ("over", "under")
                       for why, n in figures[side].items()) or "none"
    prompts = figures.get("prompt_tokens_equal")
    waits = "; ".join(f"{label} {w['equal']}/{w['compared']}" for label, w in figures["by_first_byte"].items()
                      if w["compared"])
    views = ", ".join(f"{n} {view}" for view, n in figures["views"].items() if n)
    return (f"{policy} (predictions: {views}): {figures['equal']}/{figures['compared']} predicted exactly "
            f"({figures['equal_share']:.1%}), mean abs error {figures['mean_abs_error_tokens']} tokens; "
            f"mismatches: {causes}; exact by the time to the first byte: {waits}"
            + (f"; prompt tokens as the engine's: {prompts}" if prompts else ""))


def row_figures(row: Path) -> dict[str, Any]:
    """A recorded row's figures again, from what the bench saved of it: ``row`` is
    ``<out>/<scenario>/runs/<policy>`` of a real-vLLM cache scenario (its ``requests.jsonl``,
    ``kv_changes.jsonl`` and ``data/events.duckdb``; the scenario's seed from its results.json)."""
    from laswrr.bench import real_vllm
    from laswrr.bench.cli import bench_workload
    from laswrr.bench.metrics import ClientOutcome
    from laswrr.bench.runner import engine_tokens
    from laswrr.bench.scenarios import REAL_SCENARIOS

    summary = json.loads((row.parent.parent / "results.json").read_text())
    _, workload = bench_workload(REAL_SCENARIOS[summary["scenario"]], summary["seed"])
    results = [RequestResult(**{**d, "outcome": ClientOutcome(d["outcome"])})
               for d in map(json.loads, (row / "requests.jsonl").read_text().splitlines())]
    kv = row / "kv_changes.jsonl"
    return accuracy(results, read_picks(row / "data" / "events.duckdb"), KvTimeline.load(kv) if kv.exists() else None,
                    engine_tokens(str(real_vllm.model_dir()), workload))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m laswrr.bench.cache_view ROW...``: each recorded row's figures again."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.cache_view", description=main.__doc__)
    parser.add_argument("rows", nargs="+", type=Path, help="<out>/<scenario>/runs/<policy> of a real-vLLM cache run")
    parser.add_argument("--json", action="store_true", help="the figures as JSON, one line per row")
    args = parser.parse_args(argv)
    for row in args.rows:
        figures = row_figures(row)
        print(json.dumps({"row": str(row), **figures}) if args.json else line(str(row), figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
