"""Latency objectives: a request's TTFT/TPOT targets and each node's predicted TTFT/TPOT, pure.

* **Objectives** (``Objective``): a target time to first token and a target time per output
  token, in milliseconds, from the request's headers (``x-laswrr-ttft-slo-ms``,
  ``x-laswrr-tpot-slo-ms``) or the proxy's defaults; None: no target (served as before).
* **The estimate** (``LatencyModel``), learned online per node from what each finished request
  measured, so chips of different speeds need no table:

      predicted TTFT = c + (prefill work ahead + the request's uncached prompt) / prefill rate
      predicted TPOT = a + b x batch + (prefill work ahead / prefill rate) / output tokens

  (the node's decode time per token at that batch, plus the stall of the prompts it prefills
  meanwhile, an engine's prefill step holding its batch's decode, spread over the request's output).

  Both are exponentially weighted least-squares lines: the TTFT each request measured against
  the work it waited for (its node's prefill backlog at the pick plus its own uncached prompt, in
  tokens; the intercept ``c`` is the engine's fixed cost per request), and each request's decode
  time per generated token against the batch it decoded in (its node's in-flight count at the
  pick). Both forget with a half-life counted in requests
  (``half_life``), so a node whose speed changes is followed within a few half-lives
  (tests/scheduler/test_latency.py). A node never measured predicts None: it is never removed.
* **The slot queue.** An engine runs at most its ``slots`` requests at once (``slots_of``); a
  request that makes the node's in-flight ``batch`` exceed them waits for ``batch - slots``
  requests to end, one every ``hold / slots`` seconds, ``hold`` being the node's learned time a
  request holds a slot (its decode time plus its own prefill, exponentially weighted like the
  lines). Its predicted TTFT is then that wait plus its own prompt's prefill (the prompts queued
  ahead are prefilled while the running requests end: the hold times count those stalls), and
  its TPOT the decode line's at ``slots`` (the batch it will decode in). Such an attempt teaches
  the prefill line nothing, and the decode line at ``slots``.
* **The filter** (``meets``): a node whose prediction misses the request's target is removed
  before the policy picks; the weights still spread the load over the nodes that remain.
* **Replayable.** The estimate learns only from figures the proxy records on the request's
  events (``LatencyModel.learn``), and each pick records what its prediction was made of
  (``Estimate``: the queue, the uncached prompt, the batch, the node's slots and how many
  attempts the node's estimate had learned from), so folding one proxy's recorded events in log
  order rebuilds its estimate and every prediction it made (``scheduler.routing.latency_fold``).

Like the rest of ``scheduler/`` it reads no clock: times arrive as recorded milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from laswrr.schemas.outputs import NodeView
from laswrr.schemas.words import Band

TTFT_HEADER = "x-laswrr-ttft-slo-ms"
TPOT_HEADER = "x-laswrr-tpot-slo-ms"
MAX_SLO_MS = 3_600_000.0  # an hour: a target beyond it is a typo
DEFAULT_HALF_LIFE = 8.0  # requests of one node after which an observation weighs half


@dataclass(frozen=True, slots=True)
class Objective:
    """A request's latency targets, milliseconds; None: none."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __bool__(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


class SloError(ValueError):
    """A target header or default the proxy cannot use; the message says which and why."""


def _ms(text: str, what: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise SloError(f"{what} must be a positive number of milliseconds (got {text[:40]!r})") from None
    if not 0 < value <= MAX_SLO_MS:
        raise SloError(f"{what} must be a positive number of milliseconds up to {MAX_SLO_MS:.0f} (got {text[:40]!r})")
    return value


@dataclass(frozen=True, slots=True)
class SloDefaults:
    """The targets of a request that sends no header: its API key's, else its band's (``--slo-defaults``)."""

    bands: Mapping[Band, Objective] = field(default_factory=dict)
    keys: Mapping[str, Objective] = field(default_factory=dict)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> SloDefaults:
        """``BAND=TTFT/TPOT`` or ``key:NAME=TTFT/TPOT`` (milliseconds; either may be empty):
        ``interactive=1000/50``, ``batch=10000/``, ``key:etl=/200``."""
        bands: dict[Band, Objective] = {}
        keys: dict[str, Objective] = {}
        for spec in specs:
            scope, eq, figures = spec.partition("=")
            ttft, slash, tpot = figures.partition("/")
            if not eq or not scope.strip():
                raise SloError(f"--slo-defaults {spec!r}: use BAND=TTFT_MS/TPOT_MS or key:NAME=TTFT_MS/TPOT_MS")
            objective = Objective(_ms(ttft, f"--slo-defaults {spec!r}: TTFT"),
                                  _ms(tpot, f"--slo-defaults {spec!r}: TPOT") if slash else None)
            scope = scope.strip()
            if scope.startswith("key:"):
                keys[scope[4:]] = objective
            elif scope in Band.__members__.values():
                bands[Band(scope)] = objective
            else:
                raise SloError(f"--slo-defaults {spec!r}: scope must be one of {', '.join(Band)} or key:NAME")
        return cls(bands, keys)

    def objective(self, ttft_header: str | None, tpot_header: str | None, band: Band,
                  key_name: str | None) -> Objective | None:
        """The request's targets: each header, else the key's default, else the band's; None: none."""
        base = self.keys.get(key_name) if key_name is not None else None
        if base is None:
            base = self.bands.get(band, Objective())
        ttft = _ms(ttft_header, TTFT_HEADER) if ttft_header is not None else None
        tpot = _ms(tpot_header, TPOT_HEADER) if tpot_header is not None else None
        objective = Objective(base.ttft_ms if ttft is None else ttft, base.tpot_ms if tpot is None else tpot)
        return objective or None


@dataclass(slots=True)
class _Line:
    """An exponentially weighted least-squares line ``y = a + b x`` (b >= 0, a >= 0)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, keep: float, x: float, y: float) -> None:
        self.n = self.n * keep + 1.0
        self.sx = self.sx * keep + x
        self.sy = self.sy * keep + y
        self.sxx = self.sxx * keep + x * x
        self.sxy = self.sxy * keep + x * y

    def fit(self) -> tuple[float, float] | None:
        """(a, b); None: no observation. With too little spread in x, the line through the origin
        and the mean (a prefill rate) or a flat line (a decode time)."""
        if self.n <= 0:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self.sxy / self.n - mean_x * mean_y) / var
            if slope >= 0 and mean_y - slope * mean_x >= 0:
                return mean_y - slope * mean_x, slope
        if mean_x > 0 and self.sxx > 0:  # through the origin
            return 0.0, max(0.0, self.sxy / self.sxx)
        return mean_y, 0.0


@dataclass(slots=True)
class _Mean:
    """An exponentially weighted mean."""

    n: float = 0.0
    s: float = 0.0

    def add(self, keep: float, y: float) -> None:
        self.n = self.n * keep + 1.0
        self.s = self.s * keep + y

    def mean(self) -> float | None:
        return self.s / self.n if self.n > 0 else None


@dataclass(slots=True)
class _Node:
    prefill: _Line = field(default_factory=_Line)  # TTFT (s) against the prefill work (tokens)
    decode: _Line = field(default_factory=_Line)  # time per output token (s) against the batch
    hold: _Mean = field(default_factory=_Mean)  # the seconds a request holds an engine slot
    learned: int = 0  # the attempts it learned from (``LatencyModel.learn``)

    def copy(self) -> _Node:
        return _Node(replace(self.prefill), replace(self.decode), replace(self.hold), self.learned)

    def ttft(self, work_tokens: int) -> float | None:
        line = self.prefill.fit()
        return None if line is None else line[0] + line[1] * max(work_tokens, 0)

    def tpot(self, batch: int) -> float | None:
        line = self.decode.fit()
        return None if line is None else line[0] + line[1] * max(batch, 1)

    def rate(self) -> float | None:
        line = self.prefill.fit()
        return None if line is None or line[1] <= 0 else 1.0 / line[1]

    def slot_wait(self, batch: int, slots: int) -> float:
        """The seconds a request that makes the node's in-flight ``batch`` waits for one of its
        ``slots`` (0 while one is free): ``batch - slots`` requests must end first, and ``slots``
        requests that each hold a slot ``hold`` seconds end one every ``hold / slots`` seconds."""
        hold = self.hold.mean()
        if slots <= 0 or batch <= slots or hold is None:
            return 0.0
        return (batch - slots) * hold / slots

    def predict(self, queue: int, uncached: int, batch: int, output: int, slots: int) -> Prediction:
        wait = self.slot_wait(batch, slots)
        # waiting for a slot, the prompts queued ahead are prefilled while the running requests end,
        # and the hold times measured count those stalls: only its own prompt is left
        ttft = self.ttft(uncached if wait > 0 else queue + uncached)
        if ttft is not None:
            ttft += wait
        if 0 < slots < batch:  # it will decode in a full batch, once the prompts queued ahead are prefilled
            return Prediction(ttft, self.tpot(slots))
        tpot = self.tpot(batch)
        rate = self.rate()
        if tpot is not None and queue > 0 and output > 1 and rate is not None:
            tpot += queue / rate / (output - 1)
        return Prediction(ttft, tpot)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One node's predicted figures for one request (seconds); None: not measured yet."""

    ttft_s: float | None
    tpot_s: float | None


_UNMEASURED = Prediction(None, None)


@dataclass(slots=True)
class Estimate:
    """What one node's prediction for one request is made of, as the request's events record it
    (``lb.req.started``, and an ``slo_unmeetable`` ``lb.req.refused``: docs/proxy.md, "Latency
    objectives"), so that a refold of the log (``scheduler.routing.latency_fold``) predicts the same."""

    node: str
    queue: int  # the node's prefill backlog at the pick, tokens (this proxy's and the fresh peers')
    uncached: int  # the request's prompt tokens the node must prefill (the prefix scorer's figure)
    batch: int  # the node's pool-wide in-flight at the pick, the request included
    learned: int  # the attempts on the node the estimate had learned from at the pick
    output: int = 0  # the request's max_tokens (0: not given)
    slots: int = 0  # the node's engine slots at the pick (``slots_of``; 0: not known, no slot wait)
    learned_from: int = 0  # the estimate's ``LatencyModel.source`` (0: it learned its own proxy's attempts only)

    @property
    def ahead(self) -> int:
        """The prefill work the request waits for: the queue ahead plus its own uncached prompt."""
        return self.queue + self.uncached

    @property
    def queued(self) -> bool:
        """The request waits in the engine for a slot: its in-flight, it included, exceeds the slots."""
        return 0 < self.slots < self.batch

    def predict(self, model: LatencyModel) -> Prediction:
        return model.predict(self.node, self.ahead, self.batch, self.queue, self.output, self.slots)


@dataclass(slots=True)
class LatencyModel:
    """Per node, the two lines. ``history`` (a log's refold: ``scheduler.routing.latency_fold``;
    0 live) keeps that many past states of each node, for a prediction made before the node's
    latest observations (``predict_as_of``)."""

    half_life: float = DEFAULT_HALF_LIFE
    history: int = 0
    # 0: it learns its own proxy's attempts (``Admitter.observed``); else the LB_EVENTS sequence
    # from which it learns every proxy's attempts, in stream order (``latency_fold.SharedLearner``)
    source: int = 0
    _nodes: dict[str, _Node] = field(default_factory=dict)
    _past: dict[str, deque[_Node]] = field(default_factory=dict)
    _keep: float = field(init=False)  # an observation's weight after one more: 0.5 ** (1 / half_life)

    def __post_init__(self) -> None:
        self._keep = float(0.5 ** (1.0 / self.half_life))

    def _node(self, node: str) -> _Node:
        state = self._nodes.get(node)
        if state is None:
            state = self._nodes[node] = _Node()
        return state

    def observe_prefill(self, node: str, work_tokens: int, ttft_s: float) -> None:
        """A request on ``node`` waited ``ttft_s`` for ``work_tokens`` of prefill (the backlog
        ahead of it at its pick plus its own uncached prompt)."""
        if work_tokens < 0 or ttft_s <= 0:
            return
        self._node(node).prefill.add(self._keep, float(work_tokens), ttft_s)

    def observe_decode(self, node: str, batch: int, tokens: int, decode_s: float) -> None:
        """A request on ``node`` generated ``tokens`` in ``decode_s`` after its first token, in a
        batch of ``batch`` requests."""
        if tokens <= 1 or decode_s <= 0:
            return
        self._node(node).decode.add(self._keep, float(max(batch, 1)), decode_s / (tokens - 1))

    def learn(self, estimate: Estimate, ttft_ms: float, started_ms: float, duration_ms: float | None,
              completion_tokens: int | None) -> None:
        """One completed attempt, from the figures its events record: its ``Estimate`` (``lb.req.started``)
        and ``lb.req.finished``'s ``ttft_ms``, ``duration_ms`` (both from the request's arrival),
        ``started_ms`` (the attempt's start, from the arrival: its own TTFT is ``ttft_ms - started_ms``)
        and ``completion_tokens``. The proxy and a refold of its log call this with the same numbers,
        so both learn the same.

        An attempt that waited for an engine slot (``Estimate.queued``) teaches the prefill line
        nothing (its TTFT is mostly that wait) unless the line has nothing yet and the hold time
        something (then its TTFT less the predicted wait, against its own prompt), and its decode
        time at a full batch (``slots``);
        every attempt teaches the slot hold time: its decode time (``duration_ms - ttft_ms``) plus
        its own prompt's prefill at the learned rate."""
        node = estimate.node
        state = self._node(node)
        if self.history:
            self._past.setdefault(node, deque(maxlen=self.history)).append(state.copy())
        ttft = (ttft_ms - started_ms) / 1000
        rate = state.rate()
        if not estimate.queued:
            self.observe_prefill(node, estimate.ahead, ttft)
        elif state.prefill.n <= 0 and state.hold.n > 0:  # nothing else to learn the node's prefill from yet
            self.observe_prefill(node, estimate.uncached, ttft - state.slot_wait(estimate.batch, estimate.slots))
        if completion_tokens and duration_ms is not None:
            decode = (duration_ms - ttft_ms) / 1000
            self.observe_decode(node, estimate.batch if not estimate.queued else estimate.slots, completion_tokens,
                                decode)
            if decode >= 0:
                state.hold.add(self._keep, decode + (estimate.uncached / rate if rate else 0.0))
        state.learned += 1

    def learned(self, node: str) -> int:
        """The attempts on ``node`` learned from (``learn``)."""
        state = self._nodes.get(node)
        return 0 if state is None else state.learned

    def prefill_rate(self, node: str) -> float | None:
        """Tokens per second of prefill work (the fit's slope); None: not measured."""
        state = self._nodes.get(node)
        return None if state is None else state.rate()

    def ttft(self, node: str, work_tokens: int) -> float | None:
        state = self._nodes.get(node)
        return None if state is None else state.ttft(work_tokens)

    def tpot(self, node: str, batch: int) -> float | None:
        state = self._nodes.get(node)
        return None if state is None else state.tpot(batch)

    def predict(self, node: str, work_tokens: int, batch: int, stall_tokens: int = 0, output: int = 0,
                slots: int = 0) -> Prediction:
        """TTFT after ``work_tokens`` of prefill, plus, when ``batch`` exceeds the node's ``slots``,
        the wait for a slot; TPOT in a batch of ``batch``, plus, for a request of ``output`` tokens,
        the stall of the ``stall_tokens`` other prompts the node prefills meanwhile (an engine's
        prefill step holds its batch's decode) spread over its tokens."""
        state = self._nodes.get(node)
        return _UNMEASURED if state is None else state.predict(stall_tokens, work_tokens - stall_tokens, batch, output,
                                                                slots)

    def predict_as_of(self, estimate: Estimate) -> Prediction | None:
        """``estimate``'s prediction by the node's state after ``estimate.learned`` observations
        (kept by ``history``); None: that state is no longer kept, or never was (a count beyond
        the node's: the observations it counted were not all seen)."""
        state = self._nodes.get(estimate.node)
        current = 0 if state is None else state.learned
        if estimate.learned == current:
            return estimate.predict(self)
        past = self._past.get(estimate.node, ())
        index = estimate.learned - (current - len(past))
        if not 0 <= index < len(past):
            return None
        return past[index].predict(estimate.queue, estimate.uncached, estimate.batch, estimate.output, estimate.slots)

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)
        self._past.pop(node, None)


def slots_of(view: NodeView) -> int:
    """The node's engine slots (its requests decoding at once): its believed slots (fewer than its
    capacity after queue evidence of a silent loss), else its capacity."""
    believed = view.load.slots
    return view.capacity if believed is None else int(believed)


def meets(prediction: Prediction, objective: Objective) -> bool:
    """The prediction meets every target the objective sets (an unmeasured figure meets any)."""
    if objective.ttft_ms is not None and prediction.ttft_s is not None and prediction.ttft_s * 1000 > objective.ttft_ms:
        return False
    if objective.tpot_ms is not None and prediction.tpot_s is not None and prediction.tpot_s * 1000 > objective.tpot_ms:
        return False
    return True


def slo_fields(objective: Objective | None, predicted: Prediction | None = None) -> dict[str, float]:
    """The objective's (and the prediction's) fields of ``lb.req.started`` / ``lb.req.refused``:
    only those set, so an event without them keeps its bytes."""
    fields: dict[str, float] = {}
    if objective is not None:
        if objective.ttft_ms is not None:
            fields["ttft_slo_ms"] = objective.ttft_ms
        if objective.tpot_ms is not None:
            fields["tpot_slo_ms"] = objective.tpot_ms
    if predicted is not None:
        if predicted.ttft_s is not None:
            fields["predicted_ttft_ms"] = round(predicted.ttft_s * 1000, 1)
        if predicted.tpot_s is not None:
            fields["predicted_tpot_ms"] = round(predicted.tpot_s * 1000, 1)
    return fields


# ``estimate_record``'s, by name
ESTIMATE_FIELDS = ("queue_tokens", "uncached_tokens", "batch_size", "learned", "slots")


def estimate_record(estimate: Estimate) -> tuple[int, int, int, int, int]:
    """What ``lb.req.started`` / ``lb.req.refused`` record of the estimate: its ``ESTIMATE_FIELDS``,
    in that order (the one place that maps the estimate to them)."""
    return estimate.queue, estimate.uncached, estimate.batch, estimate.learned, estimate.slots


def estimate_fields(estimate: Estimate | None) -> dict[str, int]:
    """``estimate_record`` by field name, and ``learned_from`` when the estimate is shared (none
    without an estimate, so an event without them keeps its bytes)."""
    if estimate is None:
        return {}
    fields = dict(zip(ESTIMATE_FIELDS, estimate_record(estimate)))
    if estimate.learned_from:
        fields["learned_from"] = estimate.learned_from
    return fields


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What an autoscaler reads of one pool (the proxy's ``laswrr_pool_*`` gauges): ``saturation``,
    in flight over the routable nodes' slot limits (their ``concurrency_limit``, else capacity);
    ``backlog_s``, the prefill backlog in seconds of the pool's measured prefill throughput (None:
    no rate measured); ``predicted_ttft_s``, the soonest first token a short request could get
    (the least of the measured nodes' predictions, each node's prefill backlog ahead of it and,
    when its in-flight fills its slot limit, the wait for a slot; None: none measured)."""

    saturation: float
    backlog_s: float | None
    predicted_ttft_s: float | None


def pool_signals(nodes: Iterable[tuple[str, int]], load: Mapping[str, int], backlog: Mapping[str, int],
                 model: LatencyModel | None) -> PoolSignals:
    """``nodes``: each routable node and its slot limit."""
    inflight = limit = 0
    tokens, rate = 0, 0.0
    soonest: float | None = None
    for node, slots in nodes:
        busy, queue = load.get(node, 0), backlog.get(node, 0)
        inflight += busy
        limit += slots
        tokens += queue
        if model is None:
            continue
        node_rate = model.prefill_rate(node)
        if node_rate is not None:
            rate += node_rate
        ttft = model.predict(node, queue, busy + 1, queue, 0, slots).ttft_s
        if ttft is not None and (soonest is None or ttft < soonest):
            soonest = ttft
    return PoolSignals(inflight / limit if limit else 0.0, tokens / rate if rate > 0 else None, soonest)
