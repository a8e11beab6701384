"""``apply_guarded``: a core exception becomes the recorded rejection of that input (pure)."""

from __future__ import annotations

import msgspec
import pytest

from laswrr.scheduler.core import Scheduler, apply_guarded
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope

REGISTER = b'{"url": "http://a:8000", "capacity": 4}'


def test_no_exception_means_the_plain_outputs() -> None:
    plain, guarded = Scheduler(), Scheduler()
    envelope = Envelope(1, 1_000, sj.admin_node("a"), REGISTER)
    assert apply_guarded(guarded, envelope) == (plain.apply(envelope), None)


def test_an_exception_becomes_a_rejection_and_moves_the_log_position(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = Scheduler()
    apply_guarded(scheduler, Envelope(1, 1_000, sj.admin_node("a"), REGISTER))

    def explode(self: Scheduler, envelope: Envelope) -> list[object]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(Scheduler, "apply", explode)
    [output], exc = apply_guarded(scheduler, Envelope(2, 2_000, sj.admin_drain("a"), b"{}"))
    assert isinstance(exc, ZeroDivisionError)
    assert (output.subject, output.as_of_seq, output.msg_id) == (sj.OUT_REJECTED, 2, f"2:{sj.OUT_REJECTED}")
    reason = "internal error while applying: ZeroDivisionError: division by zero"
    assert msgspec.json.decode(output.data) == {"as_of_seq": 2, "subject": "lb.admin.drain.a",
                                                "cause": "internal_error", "reason": reason}
    assert scheduler.state.last_seq == 2
