"""The engine's own free slots and KV blocks (MindIE /v1/status through the collector) and the
npu-exporter's fault causes, in the core: slots believed from one sample, KV load from blocks, a
drain or ejection that records the fault; events without them apply exactly as before."""

from __future__ import annotations

from typing import Any

from sched_feed import Feed, idle_pool, phase_changes

from laswrr.schemas import subjects as sj


def _status(feed: Feed, node: str, running: int, free_slots: int, waiting: int = 0, kv: float = 0.0,
            free_blocks: int | None = None, total_blocks: int | None = None, dt_ms: int = 0) -> None:
    payload: dict[str, Any] = {"running": running, "waiting": waiting, "kv_cache_usage": kv, "free_slots": free_slots}
    if free_blocks is not None:
        payload["free_blocks"] = free_blocks
    if total_blocks is not None:
        payload["total_blocks"] = total_blocks
    feed.send(sj.metrics_engine(node), payload, dt_ms)


def _load(feed: Feed, node: str) -> dict[str, Any]:
    return feed.view(node)["load"]


def test_free_slots_are_believed_from_one_sample_without_a_queue() -> None:
    feed = idle_pool("n1", "n2")
    _status(feed, "n1", running=2, free_slots=0, dt_ms=500)  # 10 registered, the engine runs 2, none waiting
    feed.tick()
    load = _load(feed, "n1")
    assert load["slots"] == 2.1 and load["free_slots"] == 0  # 100 ms of regain since the sample
    assert feed.node("n1").target <= 2.1 < feed.node("n2").target
    queue_path = idle_pool("n1", "n2")  # the same engine through /metrics alone: no queue, no belief
    queue_path.engine("n1", running=2, waiting=0, dt_ms=500)
    queue_path.tick()
    assert _load(queue_path, "n1").get("slots") is None


def test_every_status_sample_confirms_the_belief_and_full_slots_end_it_at_once() -> None:
    feed = idle_pool("n1", "n2")
    for _ in range(30):  # 15 s of samples every 0.5 s: the belief never climbs back on its own
        _status(feed, "n1", running=1, free_slots=1, dt_ms=400)
        feed.tick()
    assert _load(feed, "n1")["slots"] == 2.1
    _status(feed, "n1", running=1, free_slots=9, dt_ms=400)
    feed.tick()
    assert _load(feed, "n1").get("slots") is None and feed.node("n1").slots_seen is None


def test_kv_load_comes_from_blocks_where_the_engine_gives_them() -> None:
    feed = idle_pool("n1", "n2")
    _status(feed, "n1", running=1, free_slots=9, kv=0.9, free_blocks=750, total_blocks=1000, dt_ms=500)
    _status(feed, "n2", running=1, free_slots=9, kv=0.9, free_blocks=750, dt_ms=0)  # no total: the percentage
    feed.tick()
    assert _load(feed, "n1")["kv"] == 0.25 and _load(feed, "n1")["free_blocks"] == 750
    assert _load(feed, "n2")["kv"] == 0.9


def _npu(feed: Feed, node: str, health: str, fault: str | None) -> list[Any]:
    chip: dict[str, Any] = {"npu_id": 3, "chip_id": 1, "aicore_util": 0.1, "health": health}
    if fault:
        chip["fault"] = fault
    return feed.send(sj.metrics_npu(node), {"chips": [{"npu_id": 3, "chip_id": 0, "health": "OK"}, chip]})


def test_a_separating_fault_ejects_and_a_restart_business_fault_drains_with_the_cause() -> None:
    feed = idle_pool("n1", "n2", "n3")
    ejected = phase_changes(_npu(feed, "n1", "Critical", "fault 80E18402 SeparateNPU"))
    drained = phase_changes(_npu(feed, "n2", "Alarm", "fault 8C204E00 RestartBusiness"))
    plain = phase_changes(_npu(feed, "n3", "Alarm", None))  # npu-smi: no fault text, the reason as before
    assert ejected[0][1:] == ("active", "ejected", "npu health Critical: npu 3 chip 1 fault 80E18402 SeparateNPU")
    assert drained[0][1:] == ("active", "draining", "npu health Alarm: npu 3 chip 1 fault 8C204E00 RestartBusiness")
    assert plain[0][1:] == ("active", "draining", "npu health Alarm")
    assert feed.view("n1")["phase_reason"].endswith("SeparateNPU")
    _npu(feed, "n1", "OK", None)
    assert feed.phase("n1") == "recovering"


def test_samples_without_the_new_fields_keep_their_snapshot_bytes() -> None:
    feed = idle_pool("n1", "n2")
    feed.engine("n1", running=2, waiting=0, kv=0.4, dt_ms=500)
    outputs = feed.tick()
    snapshot = next(o for o in outputs if o.subject == sj.out_snapshot("default"))
    assert b"free_slots" not in snapshot.data and b"free_blocks" not in snapshot.data
    assert _load(feed, "n1")["kv"] == 0.4


def _npu_sample(feed: Feed, node: str, util: float, max_age_ms: int | None, dt_ms: int = 0) -> None:
    payload: dict[str, Any] = {"chips": [{"npu_id": 0, "chip_id": 0, "aicore_util": util, "health": "OK"}]}
    if max_age_ms is not None:
        payload["max_age_ms"] = max_age_ms
    feed.send(sj.metrics_npu(node), payload, dt_ms)


def _npu_signal_over(max_age_ms: int | None, seconds: int) -> list[float]:
    """The n1's npu signal once a second while a 5 s source refreshes it (engine samples keep coming)."""
    feed = idle_pool("n1", "n2")
    signal = []
    for second in range(seconds):
        if second % 5 == 0 and second < 15:
            _npu_sample(feed, "n1", 0.8, max_age_ms)
        feed.engine("n1")
        feed.tick(period_ms=1000)
        signal.append(_load(feed, "n1")["npu"])
    return signal


def test_an_npu_sample_stands_for_its_source_refresh_then_ages_over_the_usual_span() -> None:
    """An npu-exporter sample every 5 s: with the source's max age (10 s) it is believed until the
    next one, where the configuration's 3 s made it drift toward unknown (0.5) in every gap."""
    stamped, unstamped = _npu_signal_over(10_000, 32), _npu_signal_over(None, 32)
    assert stamped[:15] == [0.8] * 15  # three refreshes, no drift between them
    assert min(unstamped[:15]) < 0.8  # the flapping a sample without max_age gets (as before the field)
    # after the last sample (at 10 s): fresh to 10 s of age, unknown at 10 + 7 s
    assert stamped[19] == 0.8 and 0.5 < stamped[23] < 0.8 and stamped[27:] == [0.5] * 5


def test_max_age_shorter_than_stale_after_changes_nothing_and_bad_values_are_rejected() -> None:
    assert _npu_signal_over(1_000, 20) == _npu_signal_over(None, 20)
    feed = idle_pool("n1", "n2")
    for bad in (0, -5, "10s"):
        outputs = feed.send(sj.metrics_npu("n1"), {"chips": [], "max_age_ms": bad})
        assert [o.subject for o in outputs] == [sj.OUT_REJECTED]
