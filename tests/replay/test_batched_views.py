"""The analyst views give the same answers on a batched log as on the same events unbatched.

One workload (every request outcome, continuations, retries, requests started and finished in
one batch, heartbeats, a drain, a proxy that stops with requests open, one that never stops)
is recorded twice through the real core and the recorder's insert path: once with each
proxy's events in ``lb.req.batch.<proxy>`` messages, once with every event alone on its own
subject at its batch's time. Every request view must give the same rows, seq numbers mapped
from each event's own message to its batch's (the only thing batching changes), and both logs
must replay exactly. (LB_OUT positions, ``out_seq``, differ: a batch emits one snapshot per
pool where its events alone emit one each.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload

VIEWS = ("attempts", "requests", "continuations", "interruptions", "open_requests", "proxy_stops", "clean_end",
         "drains", "phase_changes")
# Positions that batching changes by design: within a batch, and in LB_OUT (a batch emits one
# snapshot per pool where its events alone emit one each).
INDEX_COLUMNS = {"started_index", "finished_index", "last_attempt_index", "event_index", "out_seq"}
ALONE = {"req.started": sj.req_started, "req.finished": sj.req_finished,
         "proxy.heartbeat": sj.proxy_heartbeat, "proxy.stopped": sj.proxy_stopped}


class TwoLogs:
    """The same messages, batched (``batched``) and one event per message (``alone``)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.batched, self.alone = LogBuilder(), LogBuilder()
        self.seq_map: dict[int, int] = {}  # alone seq -> batched seq
        self.pending: dict[str, list[tuple[str, str | None, dict[str, Any]]]] = {}
        self.batches = 0
        self.batch_sizes: list[int] = []

    def input(self, subject: str, payload: Any, after_ms: float = 1.0) -> None:
        seq = self.batched.add(subject, payload, after_ms)
        self.seq_map[self.alone.add(subject, payload, after_ms)] = seq

    def event(self, proxy: str, kind: str, key: str | None, payload: dict[str, Any]) -> None:
        self.pending.setdefault(proxy, []).append((kind, key, payload))
        if self.rng.random() < 0.3:
            self.flush(proxy)

    def flush(self, proxy: str, after_ms: float = 1.0) -> None:
        events = self.pending.pop(proxy, [])
        if not events:
            return
        self.batches += 1
        self.batch_sizes.append(len(events))
        items = [batch_item(kind, key, json.dumps(payload).encode()) for kind, key, payload in events]
        seq = self.batched.add(sj.req_batch(proxy), batch_payload("b1", self.batches, items), after_ms)
        for index, (kind, key, payload) in enumerate(events):
            self.seq_map[self.alone.add(ALONE[kind](key or proxy), payload, after_ms if index == 0 else 0.0)] = seq

    def flush_all(self) -> None:
        for proxy in sorted(self.pending):
            self.flush(proxy)


def workload(seed: int) -> TwoLogs:
    rng = random.Random(seed)
    logs = TwoLogs(rng)
    for node in ("n1", "n2", "n3"):
        logs.input(sj.admin_node(node), {"url": f"http://{node}:8000", "capacity": 4})
    logs.input(sj.CLOCK_TICK, {"tick": 1}, 100.0)
    open_ids: dict[str, tuple[str, str, int]] = {}  # attempt id -> (proxy, node, attempt number)
    counter = 0

    def start(proxy: str, attempt: str, node: str) -> None:
        logs.event(proxy, "req.started", node, {"request_id": attempt, "proxy": proxy, "pool": "default",
                                                "boot_id": f"boot-{proxy}", "prompt_tokens": 10, "max_tokens": 20})

    for step in range(400):
        if step == 150:
            logs.input(sj.admin_drain("n3"), {})
        if step == 300:
            logs.input(sj.admin_undrain("n3"), {})
        roll = rng.random()
        if roll < 0.05:
            logs.input(sj.CLOCK_TICK, {"tick": step + 2}, 100.0)
        elif roll < 0.1:
            proxy = rng.choice(["p1", "p2"])
            mine = sum(1 for p, _, _ in open_ids.values() if p == proxy)
            logs.event(proxy, "proxy.heartbeat", None, {"inflight": mine, "boot_id": f"boot-{proxy}"})
        elif roll < 0.5 or not open_ids:
            counter += 1
            proxy = rng.choice(["p1", "p1", "p2", "p3"])
            node = rng.choice(["n1", "n2"] if 150 <= step < 300 else ["n1", "n2", "n3"])
            start(proxy, f"r{counter}", node)
            open_ids[f"r{counter}"] = (proxy, node, 0)
        else:
            attempt = rng.choice(sorted(open_ids))
            proxy, node, number = open_ids.pop(attempt)
            request = attempt.split(".")[0]
            outcome = rng.choice(["completed"] * 6 + ["client_cancelled", "upstream_error", "router_aborted",
                                                      "continued", "retried"])
            finished: dict[str, Any] = {"request_id": attempt, "proxy": proxy, "boot_id": f"boot-{proxy}",
                                        "ttft_ms": 40.0 + number, "duration_ms": 500.0 + step,
                                        "prompt_tokens": 10, "completion_tokens": rng.randint(0, 20)}
            if outcome in ("continued", "retried"):
                next_attempt = f"{request}.{number + 1}"
                finished["next_attempt"] = next_attempt
                if outcome == "retried":
                    finished.update(outcome="upstream_error", ttft_ms=None, error="retried: connection refused")
                else:
                    finished["outcome"] = "continued"
                logs.event(proxy, "req.finished", node, finished)
                other = "n2" if node == "n1" else "n1"
                start(proxy, next_attempt, other)
                open_ids[next_attempt] = (proxy, other, number + 1)
            else:
                finished["outcome"] = outcome
                if outcome == "upstream_error" and rng.random() < 0.5:
                    finished["ttft_ms"] = None  # failed before the first byte: not a cut
                logs.event(proxy, "req.finished", node, finished)
        if rng.random() < 0.1:
            logs.flush_all()
    # p2 stops with its requests open, p1 finishes its own and stops, p3 never stops: a clean end.
    for attempt, (proxy, node, _) in sorted(open_ids.items()):
        if proxy == "p1":
            logs.event("p1", "req.finished", node, {"request_id": attempt, "proxy": "p1", "outcome": "completed",
                                                    "boot_id": "boot-p1", "ttft_ms": 1.0, "duration_ms": 2.0})
    logs.event("p2", "proxy.stopped", None, {"boot_id": "boot-p2"})
    logs.event("p1", "proxy.stopped", None, {"boot_id": "boot-p1"})
    logs.flush("p3")
    logs.flush("p2")
    logs.flush("p1")
    return logs


def _rows(path: Path, view: str, seq_map: dict[int, int] | None) -> list[tuple[Any, ...]]:
    with store.open_read(path) as con:
        cursor = con.execute(f"SELECT * FROM {view}")
        names = [d[0] for d in cursor.description]
        rows = cursor.fetchall()
    keep = [i for i, name in enumerate(names) if name not in INDEX_COLUMNS]
    seqs = {i for i, name in enumerate(names) if name.endswith("seq") and name != "snapshot_seq"}
    mapped = []
    for row in rows:
        mapped.append(tuple(seq_map.get(row[i], row[i]) if seq_map is not None and i in seqs and row[i] is not None
                            else row[i] for i in keep))
    return sorted(mapped, key=repr)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_views_are_the_same_batched_and_unbatched(tmp_path: Path, seed: int) -> None:
    logs = workload(seed)
    batched, alone = tmp_path / "batched.duckdb", tmp_path / "alone.duckdb"
    logs.batched.write_db(batched)
    logs.alone.write_db(alone)
    assert len(logs.batched.inputs) < len(logs.alone.inputs)
    assert max(logs.batch_sizes) >= 5 and 1 in logs.batch_sizes
    for path in (batched, alone):
        with store.open_read(path) as con:
            result = replay_db(con)
        assert result.identical, result.first and result.first.describe()
    for view in VIEWS:
        got, want = _rows(batched, view, None), _rows(alone, view, logs.seq_map)
        assert got == want, view
    counts = {view: len(_rows(batched, view, None)) for view in VIEWS}
    assert counts["requests"] > 150 and counts["continuations"] > 5 and counts["drains"] == 1, counts
    with store.open_read(batched) as con:
        reasons = {r for (r,) in con.execute("SELECT DISTINCT reason FROM interruptions").fetchall()}
        same_batch = con.execute("SELECT count(*) FROM attempts WHERE started_seq = finished_seq").fetchone()
    assert reasons == {"router_aborted", "engine_cut", "open_at_proxy_stop", "open_at_end"}
    assert same_batch is not None and same_batch[0] > 0  # started and finished in one batch, in order


def test_input_events_shows_a_batched_event_as_it_would_be_alone(tmp_path: Path) -> None:
    logs = workload(4)
    batched, alone = tmp_path / "batched.duckdb", tmp_path / "alone.duckdb"
    logs.batched.write_db(batched)
    logs.alone.write_db(alone)
    sql = "SELECT seq, ts_ns, subject, family, key, j::VARCHAR FROM input_events ORDER BY seq, event_index"
    with store.open_read(batched) as con:
        got = con.execute(sql).fetchall()
    with store.open_read(alone) as con:
        want = [(logs.seq_map[seq], *rest) for seq, *rest in con.execute(sql).fetchall()]
    assert got == want
