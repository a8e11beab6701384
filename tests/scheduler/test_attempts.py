"""The forwarder's attempt table (scheduler/routing/attempts.py): the "never cut" rules of
docs/proxy.md as rows, checked without any IO. The proxy tests (tests/proxy/test_proxy_never_cut.py,
test_proxy_continuation.py, test_proxy_pd.py) drive the same rules through real engines."""

from __future__ import annotations

import pytest

from laswrr.scheduler.routing.attempts import (CONTINUATIONS, RETRIES, TRANSITIONS, AttemptError, Budget, Decision,
                                              GiveUp, Leg, Outcome, Step, attempt_id, decide, give_up_text, next_leg,
                                              pair_leg)
from laswrr.schemas.words import PdProtocol

ROOMY = Budget(max_retries=2, continue_limit=1)


def _run(leg: Leg, outcomes: list[Outcome], budget: Budget,
         protocol: PdProtocol | None = None) -> list[tuple[Leg, Step, GiveUp | None]]:
    """A request's course: each attempt's leg, and the step the table gives after its outcome."""
    course = []
    for outcome in outcomes:
        decision = decide(leg, outcome, budget)
        course.append((leg, decision.step, decision.cause))
        if decision.step in (Step.ANSWER, Step.GIVE_UP):
            break
        budget = budget.spend(decision.step)
        leg = next_leg(decision.step, leg, protocol)
    return course


# -- before the first byte: retried on another node while max_retries allows ---------------------------


@pytest.mark.parametrize("leg", [Leg.WHOLE, Leg.PREFILL, Leg.DECODE])
def test_a_failure_before_the_first_byte_is_retried_in_the_same_leg(leg: Leg) -> None:
    assert decide(leg, Outcome.FAILED, ROOMY) == Decision(Step.RETRY)


def test_a_failed_sglang_pair_is_retried_as_a_new_pair_and_so_is_one_whose_prefill_failed() -> None:
    assert decide(Leg.PAIR, Outcome.FAILED, ROOMY) == Decision(Step.NEW_PAIR)
    assert decide(Leg.PAIR, Outcome.PARTNER_FAILED, ROOMY) == Decision(Step.NEW_PAIR)


def test_retries_stop_at_max_retries_and_the_last_failure_is_answered() -> None:
    failures = [Outcome.FAILED] * 5
    course = _run(Leg.WHOLE, failures, Budget(max_retries=2, continue_limit=1))
    assert [step for _, step, _ in course] == [Step.RETRY, Step.RETRY, Step.GIVE_UP]
    assert course[-1][2] is GiveUp.NO_RETRY_LEFT
    assert _run(Leg.WHOLE, failures, Budget(max_retries=0, continue_limit=1)) == [
        (Leg.WHOLE, Step.GIVE_UP, GiveUp.NO_RETRY_LEFT)]


def test_a_vllm_pair_shares_one_retry_budget_between_its_legs() -> None:
    """Prefill fails, is retried, answers; the decode leg fails: max_retries 1 is spent already."""
    course = _run(Leg.PREFILL, [Outcome.FAILED, Outcome.DONE, Outcome.FAILED], Budget(max_retries=1, continue_limit=1),
                  PdProtocol.VLLM)
    assert course == [(Leg.PREFILL, Step.RETRY, None), (Leg.PREFILL, Step.DECODE, None),
                      (Leg.DECODE, Step.GIVE_UP, GiveUp.NO_RETRY_LEFT)]


def test_an_answer_that_is_the_clients_is_never_retried() -> None:
    """A prefill leg's 4xx, a continuation answered with anything but SSE: given up whatever the budget."""
    for leg in Leg:
        assert decide(leg, Outcome.REFUSED, Budget(max_retries=9, continue_limit=9)) == \
            Decision(Step.GIVE_UP, GiveUp.NOT_RETRYABLE)


# -- after the first byte: continued while continue_limit allows, never retried -------------------------


def test_a_broken_stream_is_continued_on_a_node_or_on_a_new_pair() -> None:
    assert decide(Leg.WHOLE, Outcome.BROKEN, ROOMY) == Decision(Step.CONTINUE)
    assert decide(Leg.DECODE, Outcome.BROKEN, ROOMY) == Decision(Step.CONTINUE_ON_PAIR)
    assert decide(Leg.PAIR, Outcome.BROKEN, ROOMY) == Decision(Step.CONTINUE_ON_PAIR)
    assert next_leg(Step.CONTINUE_ON_PAIR, Leg.DECODE, PdProtocol.VLLM) is Leg.PREFILL
    assert next_leg(Step.CONTINUE_ON_PAIR, Leg.PAIR, PdProtocol.SGLANG) is Leg.PAIR
    assert next_leg(Step.CONTINUE, Leg.WHOLE, None) is Leg.WHOLE


def test_no_row_retries_after_the_first_byte_or_continues_before_it() -> None:
    for (leg, outcome), step in TRANSITIONS.items():
        if outcome is Outcome.BROKEN:
            assert step in CONTINUATIONS, (leg, outcome)
        else:
            assert step not in CONTINUATIONS, (leg, outcome)


def test_continuations_stop_at_continue_limit_and_a_limit_of_zero_continues_nothing() -> None:
    course = _run(Leg.WHOLE, [Outcome.BROKEN, Outcome.BROKEN], Budget(max_retries=3, continue_limit=1))
    assert course == [(Leg.WHOLE, Step.CONTINUE, None), (Leg.WHOLE, Step.GIVE_UP, GiveUp.CONTINUE_LIMIT)]
    assert decide(Leg.WHOLE, Outcome.BROKEN, Budget(max_retries=3, continue_limit=0)) == \
        Decision(Step.GIVE_UP, GiveUp.CONTINUE_LIMIT)


def test_a_continuation_that_fails_before_its_first_event_is_retried_like_any_attempt() -> None:
    """Retries and continuations are separate budgets: a continuation's own failure spends a retry."""
    course = _run(Leg.WHOLE, [Outcome.BROKEN, Outcome.FAILED, Outcome.FAILED, Outcome.DONE],
                  Budget(max_retries=2, continue_limit=1))
    assert [step for _, step, _ in course] == [Step.CONTINUE, Step.RETRY, Step.RETRY, Step.ANSWER]


def test_a_stream_continued_on_a_new_vllm_pair_runs_its_prefill_then_its_decode_leg() -> None:
    course = _run(Leg.DECODE, [Outcome.BROKEN, Outcome.DONE, Outcome.DONE], ROOMY, PdProtocol.VLLM)
    assert course == [(Leg.DECODE, Step.CONTINUE_ON_PAIR, None), (Leg.PREFILL, Step.DECODE, None),
                      (Leg.DECODE, Step.ANSWER, None)]


# -- the table itself ------------------------------------------------------------------------------


def test_every_leg_answers_when_done_and_the_decode_step_spends_nothing() -> None:
    assert {leg: TRANSITIONS[(leg, Outcome.DONE)] for leg in Leg} == {
        Leg.WHOLE: Step.ANSWER, Leg.PREFILL: Step.DECODE, Leg.DECODE: Step.ANSWER, Leg.PAIR: Step.ANSWER}
    assert ROOMY.spend(Step.DECODE) == ROOMY and ROOMY.spend(Step.ANSWER) == ROOMY
    assert ROOMY.spend(Step.NEW_PAIR).retries == 1 and ROOMY.spend(Step.CONTINUE_ON_PAIR).continuations == 1
    assert RETRIES.isdisjoint(CONTINUATIONS)


@pytest.mark.parametrize(("leg", "outcome"), [(Leg.PREFILL, Outcome.BROKEN), (Leg.WHOLE, Outcome.PARTNER_FAILED),
                                              (Leg.DECODE, Outcome.PARTNER_FAILED)])
def test_an_outcome_a_leg_cannot_have_is_an_error(leg: Leg, outcome: Outcome) -> None:
    with pytest.raises(AttemptError, match=f"a {leg.value} attempt cannot end {outcome.value}"):
        decide(leg, outcome, ROOMY)


def test_a_new_pair_is_the_protocols_first_leg() -> None:
    assert pair_leg(PdProtocol.VLLM) is Leg.PREFILL and pair_leg(PdProtocol.SGLANG) is Leg.PAIR
    assert next_leg(Step.NEW_PAIR, Leg.PAIR, PdProtocol.SGLANG) is Leg.PAIR
    assert next_leg(Step.RETRY, Leg.DECODE, PdProtocol.VLLM) is Leg.DECODE
    assert next_leg(Step.DECODE, Leg.PREFILL, PdProtocol.VLLM) is Leg.DECODE


def test_attempt_ids_and_the_texts_of_a_stream_not_continued() -> None:
    assert [attempt_id("r7", n) for n in range(3)] == ["r7", "r7.1", "r7.2"]
    assert give_up_text(Leg.WHOLE, Outcome.BROKEN, GiveUp.CONTINUE_LIMIT, 2) == "--continue-limit 2 reached"
    assert give_up_text(Leg.DECODE, Outcome.BROKEN, GiveUp.NO_NODE, 2) == "no untried node to continue on"
    assert give_up_text(Leg.PREFILL, Outcome.FAILED, GiveUp.NO_NODE, 2) == "no prefill node left for a new pair"
    assert give_up_text(Leg.WHOLE, Outcome.FAILED, GiveUp.NO_RETRY_LEFT, 2) == \
        "the continuation failed and no retry was left"
