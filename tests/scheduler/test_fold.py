"""``scheduler.fold.Fold``: the one loop body every driver of the core applies inputs with (pure)."""

from __future__ import annotations

import msgspec
import pytest

from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.core import Scheduler
from laswrr.scheduler.fold import Fold, rejections
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope
from laswrr.schemas.words import RejectCause

REGISTER = b'{"url": "http://a:8000", "capacity": 4}'


def test_outputs_rejections_and_counts() -> None:
    fold = Fold()
    outputs = fold.apply(Envelope(1, 1_000, sj.admin_node("a"), REGISTER))
    assert [o.subject for o in outputs] == [sj.out_phase("a"), sj.out_snapshot("default")] and rejections(outputs) == []
    bad = fold.apply(Envelope(2, 2_000, sj.admin_capacity("a"), b'{"capacity": -1}'))
    assert rejections(bad) == bad and bad[0].cause == RejectCause.INVALID_PAYLOAD
    assert (fold.applied, fold.faults, fold.fault, dict(fold.rejections)) == (2, 0, None, {RejectCause.INVALID_PAYLOAD: 1})


def test_a_fault_is_the_inputs_rejection_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    fold = Fold()

    def explode(self: Scheduler, envelope: Envelope) -> list[object]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(Scheduler, "apply", explode)
    [output] = fold.apply(Envelope(1, 1_000, sj.admin_drain("a"), b"{}"))
    assert isinstance(fold.fault, ZeroDivisionError) and fold.faults == 1
    assert output.cause == RejectCause.INTERNAL_ERROR and fold.rejections[RejectCause.INTERNAL_ERROR] == 1


def test_dedupe_drops_a_repeated_msg_id() -> None:
    envelope = Envelope(1, 1_000, sj.admin_node("a"), REGISTER)
    plain, deduped = Fold(), Fold(dedupe=True)
    assert len(plain.apply(envelope)) == 2 and len(plain.apply(envelope)) == 1  # a re-registration: its snapshot
    assert len(deduped.apply(envelope)) == 2 and deduped.apply(envelope) == []


def test_overrides_stay_in_force_after_a_recorded_config() -> None:
    fold = Fold(overrides={"ease_alpha": 0.25})
    assert fold.scheduler.config.ease_alpha == 0.25
    fold.apply(Envelope(1, 1_000, sj.ADMIN_CONFIG, b'{"set": {"ease_alpha": 0.5, "drain_deadline_ms": 500}}'))
    assert fold.scheduler.config.ease_alpha == 0.25 and fold.scheduler.config.drain_deadline_ms == 500
    free = Fold(config=SchedulerConfig())
    free.apply(Envelope(1, 1_000, sj.ADMIN_CONFIG, b'{"set": {"ease_alpha": 0.5}}'))
    assert free.scheduler.config.ease_alpha == 0.5


def test_an_output_over_the_limit_becomes_a_rejection_of_its_input() -> None:
    phase, snapshot = Fold().apply(Envelope(1, 1_000, sj.admin_node("a"), REGISTER), limit=150)
    assert phase.subject == sj.out_phase("a")  # under the limit: kept
    assert snapshot.subject == sj.OUT_REJECTED and snapshot.cause == RejectCause.UNPUBLISHABLE_OUTPUT
    assert msgspec.json.decode(snapshot.data)["limit"] == 150
