"""The latency estimate is replayable (scheduler/routing/latency_fold.py): folding the request events a
proxy records, in its publish order, rebuilds the estimate it learned and every prediction it made,
including picks recorded after later completions (a held request) and ``slo_unmeetable`` refusals;
an altered figure is caught; a log written before the estimate's fields decodes and is skipped."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
from msgspec import UNSET

from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import decode_event
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas.words import RefusalCause, RequestOutcome
from laswrr.scheduler.routing.latency import LatencyModel, Objective, estimate_fields, slo_fields
from laswrr.scheduler.routing.latency_fold import OPEN_SPAN, LatencyFold, SharedLearner, learned_from_of
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Refusal, Router, scorer_for

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
SPEEDS = {"fast": 8000.0, "mid": 4000.0, "slow": 2000.0}  # prefill tokens/s of three chips
PROXY, BOOT = "p1", "b1"
SLOTS = 3  # each engine's: the proxy's batches (up to 7 in flight over 3 nodes, and the held) wait for slots


def snap() -> WeightSnapshot:
    nodes = [NodeView(node=n, url=f"http://{n}:8000", phase="active", routable=True, capacity=SLOTS, target_weight=1.0,
                      effective_weight=1.0, inflight=0, chip="910B", health=1.0, load=LOAD) for n in SPEEDS]
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=1, ts_ns=0, panic=False, nodes=nodes)


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)  # the proxy's rounding (services/proxy/exchange.py)


class Stream:
    """LB_EVENTS as the proxies' shared estimates read it: every message in order, each fed to
    the learners reading from its sequence on."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.learners: list[SharedLearner] = []

    @property
    def next_seq(self) -> int:
        return len(self.messages) + 1

    def publish(self, subject: str, data: bytes) -> None:
        self.messages.append((subject, data))
        seq = len(self.messages)
        node, event = decode_event(subject, data)
        for learner in self.learners:
            if learner.model.source <= seq:
                learner.apply(seq, node, event)

    def reader(self) -> LatencyModel:
        """A proxy starting now: a shared estimate from the next message on."""
        learner = SharedLearner(LatencyModel(source=self.next_seq))
        self.learners.append(learner)
        return learner.model


@dataclass
class Live:
    admission: Admission
    attempt: str
    prompt: int
    output: int


class Proxy:
    """A proxy's routing core and the events it would publish, in order (as JSON, decoded back)."""

    def __init__(self, seed: int, name: str = PROXY, boot: str = BOOT, model: LatencyModel | None = None,
                 stream: Stream | None = None) -> None:
        self.name, self.boot = name, boot
        self.model = model or LatencyModel()
        self.stream = stream  # the log's stream all proxies publish into (a shared estimate reads it)
        self.router = Router("la-swrr", seed, scorer=scorer_for("prefix"), latency=self.model)
        self.router.table.offer(snap(), 0.0)
        self.log: list[tuple[str, bytes]] = []
        self.rng = random.Random(seed)
        self.n = 0

    def publish(self, subject: str, event: ev.Event) -> None:
        self.log.append((subject, msgspec.json.encode(event)))
        if self.stream is not None:
            self.stream.publish(subject, self.log[-1][1])

    def started(self, live: Live, objective: Objective | None) -> None:
        a = live.admission
        self.publish(f"{sj.REQ_STARTED}.{a.node}", ev.RequestStarted(
            request_id=live.attempt, proxy=self.name, boot_id=self.boot, prompt_tokens=live.prompt,
            max_tokens=live.output,
            **slo_fields(objective, a.predicted), **estimate_fields(a.estimate)))

    def admit(self, objective: Objective | None) -> Live | Refusal:
        self.n += 1
        prompt, output = self.rng.randint(100, 6000), self.rng.randint(2, 200)
        text = f"user {self.n % 5} ".encode() * 40 + str(self.n).encode() * 30
        result = self.router.admitter.admit(AdmitRequest(DEFAULT_POOL, (), text, RequestSize(prompt, output),
                                                         objective=objective))
        if isinstance(result, Refusal):
            return result
        return Live(result, f"{self.name}-{self.boot}-{self.n}", prompt, output)

    def refused(self, refusal: Refusal) -> None:
        e = refusal.estimate
        assert e is not None and refusal.cause is RefusalCause.SLO_UNMEETABLE
        self.publish(f"{sj.REQ_REFUSED}.{self.name}", ev.RequestRefused(
            request_id=f"{self.name}-{self.boot}-{self.n}", proxy=self.name, boot_id=self.boot, status=429,
            cause=refusal.cause,
            **slo_fields(refusal.objective, refusal.predicted), predicted_node=e.node, max_tokens=e.output,
            **estimate_fields(e)))

    def finish(self, live: Live) -> None:
        """The engine answers (a made-up physics: its chip's prefill rate over the work ahead); the
        finished event is published, then the estimate learns from its figures, as AttemptRunner.finish."""
        a, e = live.admission, live.admission.estimate
        assert e is not None
        started = self.rng.uniform(0.0, 0.002)
        ttft = started + 0.1 + e.ahead / SPEEDS[a.node] * self.rng.uniform(0.8, 1.2)
        duration = ttft + (live.output - 1) * (0.02 + 0.002 * e.batch)
        figures = dict(ttft_ms=ms(ttft), duration_ms=ms(duration), completion_tokens=live.output)
        self.publish(f"{sj.REQ_FINISHED}.{a.node}", ev.RequestFinished(
            request_id=live.attempt, proxy=self.name, boot_id=self.boot, outcome=RequestOutcome.COMPLETED,
            started_ms=ms(started), **figures))
        self.router.admitter.prefilled(a)
        self.router.admitter.release(a)
        self.router.admitter.observed(a, figures["ttft_ms"], ms(started), figures["duration_ms"], live.output)

    def decoded(self) -> list[tuple[str | None, ev.Event]]:
        return [decode_event(subject, data) for subject, data in self.log]


def run_proxy(seed: int = 5, requests: int = 400) -> Proxy:
    proxy = Proxy(seed)
    live: list[Live] = []
    held: list[tuple[Live, Objective | None]] = []
    for i in range(requests):
        objective = (Objective(ttft_ms=proxy.rng.choice([300.0, 1500.0, 4000.0]), tpot_ms=60.0)
                     if i % 3 else None)
        result = proxy.admit(objective)
        if isinstance(result, Refusal):
            proxy.refused(result)
        elif i % 11 == 5:
            held.append((result, objective))  # picked now, recorded after the next completions
        else:
            proxy.started(result, objective)
            live.append(result)
        while len(live) > 6:
            proxy.finish(live.pop(proxy.rng.randrange(len(live))))
            if held and proxy.rng.random() < 0.5:
                late, target = held.pop(0)
                proxy.started(late, target)
                live.append(late)
    for late, target in held:
        proxy.started(late, target)
        live.append(late)
    for done in live:
        proxy.finish(done)
    return proxy


def fold_of(events: list[tuple[str | None, ev.Event]]) -> LatencyFold:
    fold = LatencyFold()
    for node, event in events:
        fold.apply(node, event)
    return fold


def test_the_fold_reproduces_the_live_estimate_and_every_recorded_prediction() -> None:
    proxy = run_proxy()
    fold = fold_of(proxy.decoded())
    assert fold.mismatches == 0, [m.describe() for m in fold.found]
    assert fold.checked["pick"] > 100 and fold.checked["refusal"] > 5, fold.checked
    assert fold.learned == 400 - fold.checked["refusal"] and fold.unknown == 0
    waited = [e for _, e in proxy.decoded() if isinstance(e, ev.RequestStarted) and e.predicted_ttft_ms is not UNSET
              and e.slots == SLOTS and e.batch_size > SLOTS]
    assert len(waited) >= 5  # predictions with a slot wait were recorded, and made again
    unslotted = [(n, msgspec.structs.replace(e, slots=UNSET) if isinstance(e, ev.RequestStarted) else e)
                 for n, e in proxy.decoded()]
    assert fold_of(unslotted).mismatches >= len(waited)  # the slot wait is in them: without the slots, not made again
    refolded = fold.model(PROXY, BOOT)
    for node in SPEEDS:
        assert refolded.learned(node) == proxy.model.learned(node) > 20
        for work, batch, stall, output in ((0, 1, 0, 0), (5000, 4, 3000, 100), (20000, 9, 20000, 2)):
            assert refolded.predict(node, work, batch, stall, output, SLOTS) == proxy.model.predict(
                node, work, batch, stall, output, SLOTS)
    accuracy = fold.accuracy()
    assert set(accuracy) == {*SPEEDS, ""} and accuracy[""].attempts == sum(accuracy[n].attempts for n in SPEEDS)
    assert accuracy[""].ttft_p50_ms is not None and accuracy[""].ttft_p50_ms <= accuracy[""].ttft_p90_ms


def test_an_altered_figure_or_a_lost_event_is_a_mismatch() -> None:
    proxy = run_proxy(seed=8, requests=120)
    events = proxy.decoded()
    first = next(i for i, (_, e) in enumerate(events) if isinstance(e, ev.RequestFinished))
    node, finished = events[first]
    assert isinstance(finished, ev.RequestFinished) and finished.ttft_ms is not None
    altered = [*events[:first], (node, msgspec.structs.replace(finished, ttft_ms=finished.ttft_ms + 1.0)),
               *events[first + 1:]]
    assert fold_of(altered).mismatches > 0
    assert fold_of([*events[:first], *events[first + 1:]]).mismatches > 0  # one completion lost


def test_an_old_log_decodes_and_is_skipped() -> None:
    started = (b'{"request_id":"p-b-1","proxy":"p","pool":"default","snapshot_seq":3,"ts_ns":null,"boot_id":"b",'
               b'"prompt_tokens":40,"max_tokens":null,"key_name":null,"ttft_slo_ms":500.0}')
    finished = (b'{"request_id":"p-b-1","proxy":"p","outcome":"completed","pool":"default","ttft_ms":120.5,'
                b'"duration_ms":900.0,"prompt_tokens":40,"completion_tokens":30,"status":200,"error":null,'
                b'"ts_ns":null,"next_attempt":null,"boot_id":"b"}')
    refused = (b'{"request_id":"p-b-2","proxy":"p","status":429,"cause":"slo_unmeetable","pool":"default",'
               b'"model":null,"key_name":null,"error":null,"ts_ns":null,"boot_id":"b","ttft_slo_ms":1.0,'
               b'"predicted_ttft_ms":300.0}')
    events = [decode_event(f"{sj.REQ_STARTED}.n1", started), decode_event(f"{sj.REQ_FINISHED}.n1", finished),
              decode_event(f"{sj.REQ_REFUSED}.p", refused)]
    for (_, event), data in zip(events, (started, finished, refused)):
        assert msgspec.json.encode(event) == data  # decodes, and encodes to its own bytes
    first = events[0][1]
    assert isinstance(first, ev.RequestStarted) and first.batch_size is UNSET and first.learned is UNSET
    fold = fold_of(events)
    assert (fold.picks, fold.learned, fold.mismatches, fold.unverifiable) == (0, 0, 0, 1)


def test_replicas_sharing_one_estimate_are_refolded_from_the_stream() -> None:
    """Two proxies, the second started later, each learning every attempt from the stream (its own
    included, never directly): the second's first picks are made from the first one's attempts,
    and the refold of the stream reproduces every prediction of both."""
    stream = Stream()
    first = Proxy(7, "p1", "b1", stream.reader(), stream)
    for _ in range(60):
        live = first.admit(None)
        assert isinstance(live, Live)
        first.started(live, None)
        first.finish(live)  # Admitter.observed teaches a shared estimate nothing: the stream does
    second = Proxy(8, "p2", "b2", stream.reader(), stream)
    assert second.model.source == 121 and first.model.source == 1
    proxies, live = [first, second], []
    for i in range(300):
        proxy = proxies[i % 2]
        result = proxy.admit(Objective(ttft_ms=4000.0, tpot_ms=60.0))
        if isinstance(result, Refusal):
            proxy.refused(result)
            continue
        proxy.started(result, Objective(ttft_ms=4000.0, tpot_ms=60.0))
        live.append((proxy, result))
        while len(live) > 6:
            owner, done = live.pop(first.rng.randrange(len(live)))
            owner.finish(done)
    for owner, done in live:
        owner.finish(done)
    events = [(seq, *decode_event(subject, data)) for seq, (subject, data) in enumerate(stream.messages, 1)]
    own_done: dict[str, int] = {}  # per node, p2's attempts ended so far
    beyond_own = []  # how many more attempts than its own on the node each p2 pick had learned from
    for _, node, e in events:
        assert node is not None
        if isinstance(e, ev.RequestFinished) and e.proxy == "p2":
            own_done[node] = own_done.get(node, 0) + 1
        elif isinstance(e, ev.RequestStarted) and e.proxy == "p2":
            assert e.learned_from == 121 and isinstance(e.learned, int)
            beyond_own.append(e.learned - own_done.get(node, 0))
    assert max(beyond_own) > 20  # p1's attempts since p2 started, on the pick's node alone
    opening = next(e for _, _, e in events if isinstance(e, ev.RequestStarted) and e.proxy == "p2"
                   and isinstance(e.predicted_ttft_ms, float))
    assert {learned_from_of(e) for _, _, e in events} == {1, 121, None}  # None: the finished events
    fold = LatencyFold(shared_from=[1, 121])
    for seq, node, event in events:
        fold.apply(node, event, seq)
    assert fold.mismatches == 0 and fold.checked["pick"] > 250, (fold.checked, [m.describe() for m in fold.found[:3]])
    assert not fold.models  # no proxy's own estimate: both were shared
    for learner in stream.learners:  # each live estimate is its refold, node by node
        refolded = fold.shared[learner.model.source].model
        for node in SPEEDS:
            assert learner.model.learned(node) == refolded.learned(node) > 0
            assert learner.model.prefill_rate(node) == refolded.prefill_rate(node)
    altered = [(seq, node, msgspec.structs.replace(e, predicted_ttft_ms=e.predicted_ttft_ms + 1.0)
                if e is opening else e) for seq, node, e in events]
    again = LatencyFold(shared_from=[1, 121])
    for seq, node, event in altered:
        again.apply(node, event, seq)
    assert again.mismatches == 1 and again.found[0].request_id == opening.request_id


def test_a_shared_estimate_learns_an_attempt_only_within_its_span_whatever_else_it_was_given() -> None:
    """Whether an attempt is learned depends on its two sequences only: a reader given the other
    messages between them (lb.req.queued, in a proxy's consumer) learns what one given only the
    request events (a refold's query) learns; an end more than OPEN_SPAN messages after its start
    is not learned by either."""
    stream = Stream()
    proxy = Proxy(3, model=stream.reader(), stream=stream)
    lives = []
    for _ in range(3):
        live = proxy.admit(None)
        assert isinstance(live, Live)
        proxy.started(live, None)
        lives.append(live)
    proxy.finish(lives[0])
    started = [(seq, *decode_event(s, d)) for seq, (s, d) in enumerate(stream.messages, 1)]
    assert len(stream.messages) == 4  # the three starts (seqs 1-3), the first one's end
    proxy.stream = None  # its further messages are placed by hand
    proxy.finish(lives[1])
    proxy.finish(lives[2])
    (s1, d1), (s2, d2) = proxy.log[-2:]
    # the second's end exactly OPEN_SPAN after its start (2); the third's (3) one beyond, with another
    # message between that only one reader is given
    ends = [(2 + OPEN_SPAN, *decode_event(s1, d1)), (5 + OPEN_SPAN, *decode_event(s2, d2))]
    queued = ev.RequestQueued(request_id="x", proxy=PROXY, pool=DEFAULT_POOL, band="default", work=1, ttl_ms=1)
    given_all, given_requests = SharedLearner(LatencyModel(source=1)), SharedLearner(LatencyModel(source=1))
    for seq, node, event in started + ends[:1] + [(4 + OPEN_SPAN, None, queued)] + ends[1:]:
        given_all.apply(seq, node, event)
        if not isinstance(event, ev.RequestQueued):
            given_requests.apply(seq, node, event)
    for learner in (given_all, given_requests):
        assert sum(learner.model.learned(n) for n in SPEEDS) == 2  # the first, and the second (just in time)
        assert not learner.open  # the third's start was dropped: its end came too late
