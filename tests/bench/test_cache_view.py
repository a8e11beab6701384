"""The cache view's accuracy (bench/cache_view.py): a recorded log's predictions joined with the
engines' reported cached tokens, and each mismatch's cause from the KV events received."""

from __future__ import annotations

from pathlib import Path

from laswrr.bench.cache_view import KvTimeline, Pick, accuracy, read_picks
from laswrr.bench.runner import SnapshotWatch
from laswrr.bench.metrics import ClientOutcome, RequestResult
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj
from laswrr.schemas.kvcache import CACHE_ENCODER, CacheChanged, chain_keys, pack_block_keys
from laswrr.services import accounts
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.natsbus import NatsAuth, connect

BLOCK = 4
MS = 1_000_000
TOKENS = list(range(100, 113))  # 13 tokens: three whole blocks before the last token


def _result(index: int, request_id: str, node: str, cached: int | None, prompt: int | None = 13) -> RequestResult:
    return RequestResult(index, 0.0, 1.0, 0.1, 1.0, node, ClientOutcome.COMPLETED, 200, 3,
                         request_id=request_id, cached_tokens=cached, prompt_tokens=prompt)


def test_read_picks_takes_each_requests_first_admission_and_the_estimates_figure(tmp_path: Path) -> None:
    log = LogBuilder()
    log.node("n1", 4)
    log.node("n2", 4)
    log.add(sj.req_started("n1"), {"request_id": "p-1", "proxy": "p", "pool": "default", "ts_ns": 5_000 * MS,
                                   "prompt_tokens": 13, "cached_tokens": 8})
    log.add(sj.req_finished("n1"), {"request_id": "p-1", "proxy": "p", "outcome": "continued", "ttft_ms": 30.0,
                                    "started_ms": 10.0, "duration_ms": 50.0, "next_attempt": "p-1.1"})
    log.add(sj.req_started("n2"), {"request_id": "p-1.1", "proxy": "p", "pool": "default", "ts_ns": 5_100 * MS,
                                   "prompt_tokens": 13, "cached_tokens": 0})
    # no tokenizer: the latency estimate's figures say what the estimated view credited the node with
    log.add(sj.req_started("n2"), {"request_id": "p-2", "proxy": "p", "pool": "default", "ts_ns": 6_000 * MS,
                                   "prompt_tokens": 40, "uncached_tokens": 24, "queue_tokens": 0, "batch_size": 1,
                                   "learned": 0})
    log.add(sj.req_started("n2"), {"request_id": "p-3", "proxy": "p", "pool": "default", "ts_ns": 7_000 * MS})
    db = tmp_path / "events.duckdb"
    log.write_db(db)
    picks = read_picks(db)
    assert picks["p-1"] == Pick("p-1", "n1", 5_000 * MS, 8, True, 13, 5_020 * MS, attempts=2)
    assert picks["p-2"] == Pick("p-2", "n2", 6_000 * MS, 16, False, 40, None)
    assert picks["p-3"].predicted is None
    assert set(picks) == {"p-1", "p-2", "p-3"}


def _change(n: int, stored: list[int] = (), removed: list[int] = (), cleared: bool = False) -> CacheChanged:
    return CacheChanged(n=n, seq=n, block_size=BLOCK, stored=pack_block_keys(list(stored)),
                        removed=pack_block_keys(list(removed)), cleared=cleared)


def test_mismatches_are_told_apart_by_the_events_received_between_pick_and_first_byte() -> None:
    keys = chain_keys(TOKENS, BLOCK)  # 3 keys
    now = [0]
    timeline = KvTimeline(clock=lambda: now[0])
    now[0] = 1_000 * MS
    timeline.add("n1", _change(1, cleared=True))
    timeline.add("n1", _change(2, stored=keys[:1]))  # n1 holds one block of the prompt
    now[0] = 2_000 * MS
    timeline.add("n1", _change(3, stored=keys[1:]))  # a request of the same prefix stored the rest
    now[0] = 4_000 * MS
    timeline.add("n1", _change(4, removed=keys[1:]))  # evicted again
    picks = {
        "exact": Pick("exact", "n1", 1_500 * MS, 4, True, 13, 1_600 * MS),  # predicted 4, engine 4
        "stored": Pick("stored", "n1", 1_500 * MS, 4, True, 13, 2_500 * MS),  # engine found 12 at its prefill
        "evicted": Pick("evicted", "n1", 3_000 * MS, 12, True, 13, 4_500 * MS),  # engine found 4
        "lagged": Pick("lagged", "n1", 3_000 * MS, 0, True, 13, 3_100 * MS),  # the events said 12 then
        "moved": Pick("moved", "n1", 3_000 * MS, 12, True, 13, 3_100 * MS),  # served by n2
        # continued on another node: the client names the first attempt's node, the prompt grew
        "continued": Pick("continued", "n1", 3_000 * MS, 12, True, 13, 3_100 * MS, attempts=2),
        "unknown": Pick("unknown", "n9", 3_000 * MS, 8, True, 13, 3_100 * MS),  # no events of n9
        "no-usage": Pick("no-usage", "n1", 3_000 * MS, 8, True, 13, 3_100 * MS),
    }
    results = [_result(0, "exact", "n1", 4), _result(1, "stored", "n1", 12), _result(2, "evicted", "n1", 4),
               _result(3, "lagged", "n1", 12), _result(4, "moved", "n2", 0),
               _result(8, "continued", "n1", 0, prompt=20), _result(5, "unknown", "n9", 4),
               _result(6, "no-usage", "n1", None), _result(7, "unrecorded", "n1", 4)]
    figures = accuracy(results, picks, timeline, lambda index: TOKENS)
    assert figures["compared"] == 7 and figures["equal"] == 1
    assert figures["views"] == {"exact": 7, "estimated": 0}
    assert figures["equal_share"] == round(1 / 7, 4)
    assert figures["mean_abs_error_tokens"] == round((8 + 8 + 12 + 12 + 12 + 4) / 7, 1)
    assert figures["under"] == {"stored before prefill": 1, "view at pick": 1}
    assert figures["over"] == {"elsewhere": 2, "evicted before prefill": 1, "unexplained": 1}
    assert figures["prompt_tokens_equal"] == "6/6"  # not the continued request's
    # "stored" and "evicted" had their first byte 1 s and 1.5 s after their pick, the others 0.1 s
    assert figures["by_first_byte"] == {"0-1 s": {"compared": 5, "equal": 1}, "1-5 s": {"compared": 2, "equal": 0},
                                        ">= 5 s": {"compared": 0, "equal": 0}}


def test_the_estimated_views_figures_are_compared_without_causes() -> None:
    picks = {"a": Pick("a", "n1", 0, 16, False, 40, None), "b": Pick("b", "n1", 0, 0, False, 40, None)}
    figures = accuracy([_result(0, "a", "n1", 128), _result(1, "b", "n1", 0)], picks)
    assert figures["views"] == {"exact": 0, "estimated": 2}
    assert figures["equal"] == 1 and figures["mean_abs_error_tokens"] == 56.0
    assert figures["under"] == {"estimated view": 1} and figures["prompt_tokens_equal"] is None


def test_a_saved_timeline_loads_as_it_was(tmp_path: Path) -> None:
    now = [5]
    timeline = KvTimeline(clock=lambda: now[0])
    timeline.add("n1", _change(1, cleared=True))
    now[0] = 9
    timeline.add("n2", _change(1, stored=[7, 8]))
    timeline.save(tmp_path / "kv.jsonl")
    assert KvTimeline.load(tmp_path / "kv.jsonl").changes == timeline.changes


async def test_the_bench_hears_the_kv_changes_on_a_secured_bus(tmp_path: Path, eventually) -> None:
    """The bench reads lb.kv.> as the proxy's role: the operator, which it watches snapshots as,
    may not subscribe to it."""
    passwords = accounts.new_passwords()
    config = accounts.write_private(tmp_path / "secrets" / "nats-server.conf", accounts.server_config(passwords))
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log"), config_file=config) as server:
        urls = {role: accounts.role_url(role, pw, server.host, server.port) for role, pw in passwords.items()}
        watch = SnapshotWatch(KvTimeline())
        await watch.start(urls["operator"], urls["proxy"])
        collector = await connect(urls["collector"], "test-collector", NatsAuth())
        try:
            await collector.publish(sj.kv("n1"), CACHE_ENCODER.encode(_change(1, cleared=True)))
            await collector.flush()
            await eventually(lambda: watch.kv.changes.get("n1"), what="the change heard")
        finally:
            await collector.close()
            await watch.stop()
    assert watch.kv.changes["n1"][0][1] == _change(1, cleared=True)
