"""Micro-benchmarks of the pure core: pick per policy, and ``Scheduler.apply`` throughput.

    .venv/bin/python -m laswrr.bench.micro            (or: make bench)

* **pick**: each policy over 16 candidates with mixed weights and live in-flight counts; the
  figure is the median over ``--rounds`` batches of the per-pick time (target ≤ 5 µs).
* **affinity pick**: the proxy's whole admission with prefix affinity (``Admitter.admit`` given
  the prompt: its text from the decoded chat messages, the prefix keys, the index match, the
  guarded LA-SWRR pick, the index update; then ``release``) over 16 nodes, for 2 KB prompts
  drawn from 64 conversations that share a 1 KB system prompt, with requests kept in flight
  (target ≤ 20 µs); beside it the same admission without a prompt (plain LA-SWRR).
* **tokenize** (the exact cache view, ``laswrr proxy --tokenizer``): a chat request of 2, 8 and
  32 KB turned into its engine tokens (``services.proxy.tokens``: the tiny model's chat template
  and tokenizer, as bench/tiny_model.py builds them from docs/algorithm.md) and its block keys
  (``schemas.kvcache.chain_keys``, 128-token blocks); once per request, in the proxy.
* **apply**: one simulated second of a 16-node pool, repeated: request started/finished pairs at
  ``--rps`` requests/s, an engine sample per node every 500 ms, an NPU sample per node every
  second, ticks at 10/s. Envelopes are built (and encoded) before the clock starts, so the figure
  is decode + apply + output encoding, what the scheduler service does per message
  (target ≥ 100,000 events/s). Per-kind costs are measured on the same stream.

Timing uses ``time.perf_counter_ns`` here, in the benchmark, never in the core. Figures depend on
the machine; the targets are for one core of a 2-core CI runner.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from laswrr.scheduler.core import Scheduler
from laswrr.schemas.words import NpuHealth, RequestOutcome
from laswrr.scheduler.policies import POLICIES, Candidate, PickContext, make_policy
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope

NODES = [f"node-{i:02d}" for i in range(16)]
PICK_TARGET_US = 5.0
AFFINITY_TARGET_US = 20.0
APPLY_TARGET_EPS = 100_000


def _median_ns_per_call(call: Callable[[], object], batch: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(batch):
            call()
        samples.append((time.perf_counter_ns() - start) / batch)
    return statistics.median(samples)


def bench_pick(rounds: int) -> list[tuple[str, float, float]]:
    """(policy, median µs per pick, median µs per pick with one node excluded)."""
    candidates = [Candidate(n, 1000 * (1 + i % 5) + 137 * i) for i, n in enumerate(NODES)]
    inflight = {n: (i * 7) % 5 for i, n in enumerate(NODES)}
    excluded = frozenset({NODES[3]})
    rows = []
    for name in POLICIES:
        policy = make_policy(name, seed=1)
        policy.set_candidates(candidates)
        plain = _median_ns_per_call(lambda: policy.pick(PickContext(inflight)), 1000, rounds)  # noqa: B023
        retry = _median_ns_per_call(lambda: policy.pick(PickContext(inflight, excluded)), 1000, rounds)  # noqa: B023
        rows.append((name, plain / 1000, retry / 1000))
    return rows


def bench_affinity_pick(rounds: int) -> tuple[float, float, float]:
    """(median µs per admission+release with a 2 KB prompt, the same without a prompt, the same
    with a prompt on a router sharing with 3 peers whose messages carry a backlog on every node
    and a sparse prefix record, so its index matches at the grid positions too)."""
    from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
    from laswrr.schemas.words import Phase
    from laswrr.scheduler.routing.prompt import prompt_text, request_size
    from laswrr.scheduler.routing.router import AdmitRequest, Admission, Router

    load = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
    views = [NodeView(node=n, url=f"http://{n}:8000", phase=Phase.ACTIVE, routable=True, capacity=10,
                      target_weight=1 + i % 5, effective_weight=1 + i % 5, inflight=0, chip="910B", health=1.0,
                      load=load) for i, n in enumerate(NODES)]
    system = "You are a helpful assistant for NPU clusters. " * 22  # ~1 KB, in every prompt
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": (f"conversation {c}: how do I drain a node? " * 30)[:1000]}]
             for c in range(64)]

    from laswrr.schemas.peers import PeerState, PrefixRecord, pack_keys

    def timed(with_prompt: bool, peers: bool = False) -> float:
        router = Router("la-swrr", seed=1, proxy_id="me", share=peers)
        router.table.offer(WeightSnapshot(pool="default", as_of_seq=1, tick=1, ts_ns=0, panic=False, nodes=views), now=0)
        for k in range(3 if peers else 0):
            assert router.channel is not None
            router.channel.receive(f"peer{k}", "default", PeerState(boot_id="b", seq=1, ts_ns=1,
                                         inflight={n: 1 + k for n in NODES}, backlog={n: 500 * k for n in NODES},
                                         prefixes=[PrefixRecord(NODES[k], pack_keys([k + 1, k + 2]))]),
                               now=0.0)
        admitter = router.admitter
        held = [admitter.admit(AdmitRequest("default")) for _ in range(24)]  # requests in flight meanwhile
        state = {"i": 0}

        def one() -> None:
            chat = chats[state["i"] % 64]
            state["i"] += 1
            if with_prompt:
                text = prompt_text(chat, None)
                admission = admitter.admit(AdmitRequest("default", (), text, request_size(text, 128, None)))
            else:
                admission = admitter.admit(AdmitRequest("default"))
            assert isinstance(admission, Admission)
            admitter.release(admission)

        result = _median_ns_per_call(one, 1000, rounds) / 1000
        assert all(isinstance(h, Admission) for h in held)
        return result

    return timed(True), timed(False), timed(True, peers=True)


def mix_stream(seconds: int, rps: int) -> list[Envelope]:
    """The realistic mix, as encoded envelopes in stream order."""
    events: list[tuple[int, str, bytes]] = []
    ms = 1_000_000

    def add(t_ns: int, subject: str, payload: dict[str, object]) -> None:
        events.append((t_ns, subject, json.dumps(payload, separators=(",", ":")).encode()))

    for i, node in enumerate(NODES):
        add(0, sj.admin_node(node), {"url": f"http://10.0.0.{i}:8000", "pool": "default", "chip": "910B",
                                     "capacity": 8 + 8 * (i % 2)})
    request = 0
    for second in range(seconds):
        base = (second + 1) * 1000 * ms
        for k in range(10):
            add(base + k * 100 * ms + 1, sj.CLOCK_TICK, {"tick": second * 10 + k + 1})
        for half in range(2):
            for i, node in enumerate(NODES):
                add(base + half * 500 * ms + 3 + i, sj.metrics_engine(node),
                    {"running": 4 + i % 5, "waiting": i % 3, "kv_cache_usage": 0.31 + i / 100, "ttft_ms": 180.0 + i})
        for i, node in enumerate(NODES):
            add(base + 250 * ms + i, sj.metrics_npu(node), {"chips": [
                {"npu_id": i, "chip_id": 0, "aicore_util": 0.5 + i / 64, "hbm_used_mb": 50_000,
                 "hbm_total_mb": 65_536, "health": NpuHealth.OK}]})
        for r in range(rps):
            request += 1
            node = NODES[(request * 7) % len(NODES)]
            start = base + (r * 1000 * ms) // rps
            rid = f"req-{request:09d}"
            add(start + 2, sj.req_started(node), {"request_id": rid, "proxy": "proxy-a", "pool": "default",
                                                  "snapshot_seq": 1})
            add(start + 2 + 400 * ms + (request % 11) * 20 * ms, sj.req_finished(node), {
                "request_id": rid, "proxy": "proxy-a", "pool": "default", "outcome": RequestOutcome.COMPLETED,
                "ttft_ms": 150.0 + request % 50, "duration_ms": 900.0})
    events.sort(key=lambda e: e[0])  # stable: same-time events keep their order
    return [Envelope(seq, ts + 1_700_000_000_000_000_000, subject, data)
            for seq, (ts, subject, data) in enumerate(events, start=1)]


def _kind(subject: str) -> str:
    return sj.split(subject)[0].removeprefix("lb.")


def bench_apply(seconds: int, rps: int, rounds: int) -> tuple[int, float, dict[str, tuple[int, float]]]:
    """(events, best events/s over the rounds, per-kind (count, median µs))."""
    stream = mix_stream(seconds, rps)
    best = 0.0
    per_kind: dict[str, list[int]] = defaultdict(list)
    for round_no in range(rounds):
        scheduler = Scheduler()
        apply = scheduler.apply
        start = time.perf_counter_ns()
        for envelope in stream:
            apply(envelope)
        elapsed = time.perf_counter_ns() - start
        best = max(best, len(stream) / (elapsed / 1e9))
        if round_no == 0:
            scheduler = Scheduler()
            for envelope in stream:
                t0 = time.perf_counter_ns()
                scheduler.apply(envelope)
                per_kind[_kind(envelope.subject)].append(time.perf_counter_ns() - t0)
    kinds = {k: (len(v), statistics.median(v) / 1000) for k, v in sorted(per_kind.items())}
    return len(stream), best, kinds


TOKENIZE_KB = (2, 8, 32)


def bench_tokenize(rounds: int) -> list[tuple[int, int, float, float]]:
    """Per prompt size: (KB, tokens, tokenize µs, block keys µs), medians (module docstring)."""
    import tempfile
    from pathlib import Path

    from laswrr.bench.tiny_model import tokenizer
    from laswrr.schemas.kvcache import chain_keys
    from laswrr.services.proxy.tokens import PromptTokenizer

    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithm.md").read_text(encoding="utf-8")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer(text, Path(tmp))
        tok = PromptTokenizer(tmp)
        for kb in TOKENIZE_KB:
            body = (text * (1 + kb * 1024 // len(text)))[:kb * 1024 - 200]
            messages = [{"role": "system", "content": body}, {"role": "user", "content": "What does the guard do?"}]
            ids = tok.encode(messages, None)
            assert ids is not None
            encode_ns = _median_ns_per_call(lambda: tok.encode(messages, None), 5, rounds)
            keys_ns = _median_ns_per_call(lambda: chain_keys(ids, 128), 5, rounds)
            out.append((kb, len(ids), encode_ns / 1000, keys_ns / 1000))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.micro", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=31, help="timing rounds per figure (default 31)")
    parser.add_argument("--seconds", type=int, default=10, help="simulated seconds in the apply mix (default 10)")
    parser.add_argument("--rps", type=int, default=2000, help="requests per simulated second (default 2000)")
    args = parser.parse_args(argv)

    print("pick, 16 nodes (median per pick)")
    print(f"  {'policy':<14} {'pick µs':>8} {'retry µs':>9}  target ≤ {PICK_TARGET_US:g} µs")
    for name, plain, retry in bench_pick(args.rounds):
        verdict = "ok" if plain <= PICK_TARGET_US else "MISSED"
        print(f"  {name:<14} {plain:>8.2f} {retry:>9.2f}  {verdict}")

    affinity, plain, shared = bench_affinity_pick(args.rounds)
    verdict = "ok" if affinity <= AFFINITY_TARGET_US else "MISSED"
    print("\nproxy admission with prefix affinity, 16 nodes, 2 KB chat prompts (median per admit + release)")
    print(f"  with affinity {affinity:>7.2f} µs  target ≤ {AFFINITY_TARGET_US:g} µs  {verdict}")
    print(f"  no prompt     {plain:>7.2f} µs  (plain LA-SWRR admission)")
    print(f"  with 3 peers  {shared:>7.2f} µs  (the channel between proxies: their counts and backlogs)")

    print("\nexact cache view: a chat request's engine tokens and block keys (median per request)")
    print(f"  {'prompt':>7} {'tokens':>7} {'tokenize µs':>12} {'keys µs':>8}")
    for kb, tokens, encode_us, keys_us in bench_tokenize(args.rounds):
        print(f"  {kb:>5} KB {tokens:>7} {encode_us:>12.1f} {keys_us:>8.1f}")

    events, eps, kinds = bench_apply(args.seconds, args.rps, max(3, args.rounds // 10))
    verdict = "ok" if eps >= APPLY_TARGET_EPS else "MISSED"
    print(f"\napply, 16 nodes, {args.rps} req/s + samples + 10 ticks/s ({events} events)")
    print(f"  throughput {eps:>10,.0f} events/s  target ≥ {APPLY_TARGET_EPS:,}  {verdict}")
    print(f"  {'kind':<18} {'count':>7} {'median µs':>10}")
    for kind, (count, median_us) in kinds.items():
        print(f"  {kind:<18} {count:>7} {median_us:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
