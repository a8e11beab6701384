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
* **The filter** (``meets``): a node whose prediction misses the request's target is removed
  before the policy picks; the weights still spread the load over the nodes that remain.

Like the rest of ``scheduler/`` it reads no clock: times arrive as measured seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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
class _Node:
    prefill: _Line = field(default_factory=_Line)  # TTFT (s) against the prefill work (tokens)
    decode: _Line = field(default_factory=_Line)  # time per output token (s) against the batch


@dataclass(frozen=True, slots=True)
class Prediction:
    """One node's predicted figures for one request (seconds); None: not measured yet."""

    ttft_s: float | None
    tpot_s: float | None


@dataclass(slots=True)
class LatencyModel:
    half_life: float = DEFAULT_HALF_LIFE
    _nodes: dict[str, _Node] = field(default_factory=dict)

    @property
    def _keep(self) -> float:
        return float(0.5 ** (1.0 / self.half_life))

    def observe_prefill(self, node: str, work_tokens: int, ttft_s: float) -> None:
        """A request on ``node`` waited ``ttft_s`` for ``work_tokens`` of prefill (the backlog
        ahead of it at its pick plus its own uncached prompt)."""
        if work_tokens < 0 or ttft_s <= 0:
            return
        self._nodes.setdefault(node, _Node()).prefill.add(self._keep, float(work_tokens), ttft_s)

    def observe_decode(self, node: str, batch: int, tokens: int, decode_s: float) -> None:
        """A request on ``node`` generated ``tokens`` in ``decode_s`` after its first token, in a
        batch of ``batch`` requests."""
        if tokens <= 1 or decode_s <= 0:
            return
        self._nodes.setdefault(node, _Node()).decode.add(self._keep, float(max(batch, 1)), decode_s / (tokens - 1))

    def prefill_rate(self, node: str) -> float | None:
        """Tokens per second of prefill work (the fit's slope); None: not measured."""
        state = self._nodes.get(node)
        line = None if state is None else state.prefill.fit()
        return None if line is None or line[1] <= 0 else 1.0 / line[1]

    def ttft(self, node: str, work_tokens: int) -> float | None:
        state = self._nodes.get(node)
        line = None if state is None else state.prefill.fit()
        return None if line is None else line[0] + line[1] * max(work_tokens, 0)

    def tpot(self, node: str, batch: int) -> float | None:
        state = self._nodes.get(node)
        line = None if state is None else state.decode.fit()
        return None if line is None else line[0] + line[1] * max(batch, 1)

    def predict(self, node: str, work_tokens: int, batch: int, stall_tokens: int = 0, output: int = 0) -> Prediction:
        """TTFT after ``work_tokens`` of prefill; TPOT in a batch of ``batch``, plus, for a request
        of ``output`` tokens, the stall of the ``stall_tokens`` other prompts the node prefills
        meanwhile (an engine's prefill step holds its batch's decode) spread over its tokens."""
        tpot = self.tpot(node, batch)
        rate = self.prefill_rate(node)
        if tpot is not None and stall_tokens > 0 and output > 1 and rate is not None:
            tpot += stall_tokens / rate / (output - 1)
        return Prediction(self.ttft(node, work_tokens), tpot)

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)


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


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What an autoscaler reads of one pool (the proxy's ``laswrr_pool_*`` gauges): ``saturation``,
    in flight over the routable nodes' slot limits (their ``concurrency_limit``, else capacity);
    ``backlog_s``, the prefill backlog in seconds of the pool's measured prefill throughput (None:
    no rate measured); ``predicted_ttft_s``, the soonest first token a short request could get
    (the least of the measured nodes' predictions; None: none measured)."""

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
        inflight += load.get(node, 0)
        limit += slots
        tokens += backlog.get(node, 0)
        if model is None:
            continue
        node_rate = model.prefill_rate(node)
        if node_rate is not None:
            rate += node_rate
        ttft = model.ttft(node, backlog.get(node, 0))
        if ttft is not None and (soonest is None or ttft < soonest):
            soonest = ttft
    return PoolSignals(inflight / limit if limit else 0.0, tokens / rate if rate > 0 else None, soonest)
