"""The latency estimates a log's request events imply: their refold, its audit and its accuracy, pure.

A proxy process learns its ``LatencyModel`` only from figures it records (``LatencyModel.learn``:
``lb.req.started``'s estimate fields, ``lb.req.finished``'s ``ttft_ms``, ``started_ms``,
``duration_ms`` and ``completion_tokens``), and it learns from an attempt right after publishing
its finished event. So ``LatencyFold``, fed the request events of the log in log order (one
process's events are in the order it published them), rebuilds one model per process (its
``proxy`` id and ``boot_id``: each process starts with an empty estimate) by the same calls with
the same numbers. Every prediction a process recorded (a pick's ``predicted_ttft_ms`` /
``predicted_tpot_ms``, an ``slo_unmeetable`` refusal's, with the node, queue, uncached prompt,
batch and ``learned`` count it was made of) is then made again from the node's state after
``learned`` attempts (``LatencyModel.predict_as_of``: a pick's event may follow later attempts'
events, as a held request is recorded after its pick) and compared at the recorded precision
(``slo_fields``): a **mismatch** is an event lost or altered, or a bug.

**Shared by the replicas.** A proxy that reads the log's stream (``SharedLearner``: from the
LB_EVENTS sequence ``S`` it started reading at, every proxy's request events in stream order,
its own included) learns every proxy's completed attempts into one model whose ``source`` is
``S``, and each of its picks records ``learned_from = S``. Each node's state after ``k`` attempts is
then the same in every proxy that reads from ``S``, and the refold rebuilds it by feeding the
same ``SharedLearner`` the log's events from ``S`` on (``shared_from``: the ``S`` values the log
names, ``learned_from_of``); picks without ``learned_from`` are refolded per process as above.
An attempt is learned only when its finished event comes within ``OPEN_SPAN`` stream messages of
its started one (a pick whose end never came, its proxy killed, is forgotten after that), in the
proxy and in the refold alike.

**Accuracy.** For each completed attempt whose node had been measured at its pick, the TTFT its
estimate predicted (the refolded one: every pick has its estimate recorded, with or without
targets) against the TTFT it measured from its own start, ``ttft_ms - started_ms``, the same
figure the estimate learns from; and the TPOT predicted (for its ``max_tokens``) against its
decode time per token after the first. A request answered whole (not streamed) measures its
whole answer as its TTFT; the events do not say which were streamed, so both are counted.

No clock, no IO: events in, figures out (``replay/latency.py`` reads them from a recorded log).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from laswrr.schemas import events as ev
from laswrr.schemas.words import RefusalCause, RequestOutcome
from laswrr.scheduler.routing.latency import DEFAULT_HALF_LIFE, Estimate, LatencyModel, Prediction, slo_fields

DEFAULT_HISTORY = 1024  # past states kept per node: a pick recorded after this many later attempts is not checked
OPEN_SPAN = 1_000_000  # stream messages a shared estimate waits for an attempt's end (``SharedLearner``)
KEEP = 100  # mismatches kept for the report (all are counted)
_PREDICTED = ("predicted_ttft_ms", "predicted_tpot_ms")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A recorded prediction the refold does not reproduce."""

    proxy: str
    boot_id: str | None
    request_id: str
    kind: str  # "pick" (lb.req.started) or "refusal" (lb.req.refused, slo_unmeetable)
    node: str
    learned: int
    recorded: dict[str, float]
    refolded: dict[str, float] | None  # None: the node's state after ``learned`` attempts is not known

    def describe(self) -> str:
        again = "not known (events missing, or beyond the kept history)" if self.refolded is None else self.refolded
        return (f"{self.kind} {self.request_id} on {self.node} (proxy {self.proxy}, boot {self.boot_id}, "
                f"learned {self.learned}): recorded {self.recorded}, refolded {again}")


@dataclass(slots=True)
class _Errors:
    """One node's absolute errors, seconds (``array``: a long log's millions stay small)."""

    ttft: array[float] = field(default_factory=lambda: array("d"))
    measured: array[float] = field(default_factory=lambda: array("d"))
    tpot: array[float] = field(default_factory=lambda: array("d"))


@dataclass(frozen=True, slots=True)
class Accuracy:
    """One node's (or every node's) prediction errors: absolute, milliseconds; None: no sample."""

    attempts: int  # completed attempts with a TTFT prediction
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    measured_ttft_p50_ms: float | None
    tpot_attempts: int
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None


def quantile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank, as bench/slo_mixed.py's); None for no value."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _accuracy(errors: _Errors) -> Accuracy:
    return Accuracy(len(errors.ttft), _ms(quantile(errors.ttft, 0.5)), _ms(quantile(errors.ttft, 0.9)),
                    _ms(quantile(errors.measured, 0.5)), len(errors.tpot), _ms(quantile(errors.tpot, 0.5)),
                    _ms(quantile(errors.tpot, 0.9)))


def _recorded(event: ev.RequestStarted | ev.RequestRefused) -> dict[str, float]:
    found: dict[str, float] = {}
    for name in _PREDICTED:
        value = getattr(event, name)
        if isinstance(value, float | int):
            found[name] = value
    return found


def estimate_of(node: str, event: ev.RequestStarted) -> Estimate | None:
    """What the pick's prediction was made of, as ``lb.req.started`` records it (None: the proxy
    had no estimate, a log written before it)."""
    if not isinstance(event.batch_size, int):
        return None
    return Estimate(node, _int(event.queue_tokens), _int(event.uncached_tokens), event.batch_size,
                    _int(event.learned), event.max_tokens or 0, _int(event.slots), _int(event.learned_from))


def lesson(event: ev.RequestFinished) -> tuple[float, float] | None:
    """``(ttft_ms, started_ms)`` of an attempt the estimate learns from: completed and streamed (a
    whole answer has no time to first token: it teaches nothing); None otherwise."""
    ttft_ms, started_ms = event.first_token_ms, event.started_ms
    if event.outcome is not RequestOutcome.COMPLETED or ttft_ms is None or not isinstance(started_ms, float | int):
        return None
    return ttft_ms, started_ms


def learned_from_of(event: ev.Event) -> int | None:
    """The ``learned_from`` a pick or an ``slo_unmeetable`` refusal records (None: none), for
    ``LatencyFold``'s ``shared_from``."""
    value = getattr(event, "learned_from", None) if isinstance(event, ev.RequestStarted | ev.RequestRefused) else None
    return value if isinstance(value, int) else None


class SharedLearner:
    """One estimate learned from every proxy's attempts: feed ``apply`` the request events of the
    log's stream from sequence ``model.source`` on, in stream order (a proxy as they arrive, a
    refold as the log holds them: both learn the same)."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self.open: dict[tuple[str, str | None, str], tuple[Estimate, int]] = {}  # in stream order

    def apply(self, seq: int, node: str | None, event: ev.Event) -> None:
        """One request event of stream message ``seq`` (several events of one batch share it). The
        picks older than ``OPEN_SPAN`` messages go first, so whether an attempt is learned depends
        on its two sequences only, not on which other messages a reader was given."""
        open_, oldest = self.open, seq - OPEN_SPAN
        while open_:
            key = next(iter(open_))
            if open_[key][1] >= oldest:
                break
            del open_[key]
        if isinstance(event, ev.RequestStarted):
            estimate = estimate_of(node, event) if node is not None else None
            if estimate is not None:
                self.open[(event.proxy, event.boot_id, event.request_id)] = estimate, seq
        elif isinstance(event, ev.RequestFinished):
            opened = self.open.pop((event.proxy, event.boot_id, event.request_id), None)
            taught = lesson(event)
            if opened is not None and taught is not None:
                self.model.learn(opened[0], taught[0], taught[1], event.duration_ms, event.completion_tokens)


class LatencyFold:
    """Feed ``apply`` every request event of a log in log order; then read the audit (``checked``,
    ``mismatches``, ``found``) and ``accuracy()``."""

    def __init__(self, history: int = DEFAULT_HISTORY, half_life: float = DEFAULT_HALF_LIFE,
                 shared_from: Iterable[int] = ()) -> None:
        self.history, self.half_life = history, half_life
        self.models: dict[tuple[str, str | None], LatencyModel] = {}
        # the shared estimates the log's picks name (``learned_from``), each fed from its sequence on
        self.shared = {s: SharedLearner(LatencyModel(half_life, history, source=s)) for s in sorted(set(shared_from))}
        self.open: dict[tuple[str, str | None, str], tuple[Estimate, Prediction | None]] = {}
        self.picks = 0  # lb.req.started events with an estimate
        self.learned = 0  # completed attempts learned from
        self.checked = {"pick": 0, "refusal": 0}  # recorded predictions compared
        self.unverifiable = 0  # slo_unmeetable refusals recorded without their estimate (an older proxy)
        self.mismatches = 0
        self.found: list[Mismatch] = []
        self.unmeasured = 0  # completed attempts whose node had not been measured at the pick
        self.unknown = 0  # picks whose node state (after ``learned`` attempts) the refold does not have
        self._errors: dict[str, _Errors] = {}

    def model(self, proxy: str, boot_id: str | None) -> LatencyModel:
        """The refolded estimate of one proxy process."""
        key = (proxy, boot_id)
        model = self.models.get(key)
        if model is None:
            model = self.models[key] = LatencyModel(self.half_life, self.history)
        return model

    def apply(self, node: str | None, event: ev.Event, seq: int = 0) -> None:
        """One event of the log (``node``: its subject's key, the node of a started or finished
        event; ``seq``: its LB_EVENTS sequence, which the shared estimates need)."""
        for source, learner in self.shared.items():
            if source > seq:
                break
            learner.apply(seq, node, event)
        if isinstance(event, ev.RequestStarted) and node is not None:
            self._started(node, event)
        elif isinstance(event, ev.RequestFinished):
            self._finished(event)
        elif isinstance(event, ev.RequestRefused) and event.cause is RefusalCause.SLO_UNMEETABLE:
            self._refused(event)

    def _started(self, node: str, event: ev.RequestStarted) -> None:
        estimate = estimate_of(node, event)
        if estimate is None:  # no estimate at that proxy (a log written before it)
            return
        self.picks += 1
        prediction = self._check("pick", event, estimate)
        self.open[(event.proxy, event.boot_id, event.request_id)] = estimate, prediction

    def _refused(self, event: ev.RequestRefused) -> None:
        if not isinstance(event.predicted_node, str) or not isinstance(event.batch_size, int):
            self.unverifiable += 1
            return
        estimate = Estimate(event.predicted_node, _int(event.queue_tokens), _int(event.uncached_tokens),
                            event.batch_size, _int(event.learned), _int(event.max_tokens), _int(event.slots),
                            _int(event.learned_from))
        self._check("refusal", event, estimate)

    def _check(self, kind: str, event: ev.RequestStarted | ev.RequestRefused, estimate: Estimate) -> Prediction | None:
        """The refolded prediction; a recorded one is compared with it."""
        if estimate.learned_from:
            learner = self.shared.get(estimate.learned_from)
            prediction = None if learner is None else learner.model.predict_as_of(estimate)
        else:
            prediction = self.model(event.proxy, event.boot_id).predict_as_of(estimate)
        if prediction is None:
            self.unknown += 1
        recorded = _recorded(event)
        if not recorded and kind == "pick":
            return prediction
        self.checked[kind] += 1
        refolded = None if prediction is None else slo_fields(None, prediction)
        if refolded != recorded:
            self.mismatches += 1
            if len(self.found) < KEEP:
                self.found.append(Mismatch(event.proxy, event.boot_id, event.request_id, kind, estimate.node,
                                           estimate.learned, recorded, refolded))
        return prediction

    def _finished(self, event: ev.RequestFinished) -> None:
        opened = self.open.pop((event.proxy, event.boot_id, event.request_id), None)
        taught = lesson(event)
        if opened is None or taught is None:
            return
        ttft_ms, started_ms = taught
        estimate, prediction = opened
        if not estimate.learned_from:  # a shared estimate learned it already (its SharedLearner)
            self.model(event.proxy, event.boot_id).learn(estimate, ttft_ms, started_ms, event.duration_ms,
                                                         event.completion_tokens)
        self.learned += 1
        if prediction is None or prediction.ttft_s is None:
            self.unmeasured += 1
            return
        errors = self._errors.setdefault(estimate.node, _Errors())
        measured = (ttft_ms - started_ms) / 1000
        errors.ttft.append(abs(prediction.ttft_s - measured))
        errors.measured.append(measured)
        tokens, duration = event.completion_tokens, event.duration_ms
        if prediction.tpot_s is not None and tokens is not None and tokens > 1 and duration is not None:
            errors.tpot.append(abs(prediction.tpot_s - (duration - ttft_ms) / 1000 / (tokens - 1)))

    def accuracy(self) -> Mapping[str, Accuracy]:
        """Per node, and ``""`` for every node together."""
        every = _Errors()
        found: dict[str, Accuracy] = {}
        for node in sorted(self._errors):
            errors = self._errors[node]
            found[node] = _accuracy(errors)
            every.ttft.extend(errors.ttft)
            every.measured.extend(errors.measured)
            every.tpot.extend(errors.tpot)
        found[""] = _accuracy(every)
        return found


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0
