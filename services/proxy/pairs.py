"""A P/D pool's pairs (``scheduler.routing.pd``; docs/proxy.md, "Prefill/decode pairs"): the IO
of the two protocols' legs. What follows each leg is the forwarder's (``scheduler.routing.attempts``):
``vllm_prefill`` is one ``prefill`` attempt, ``SglangPair`` one ``pair`` attempt (its decode leg,
its prefill leg beside it)."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from laswrr.schemas.words import FailureKind, RequestOutcome
from laswrr.scheduler.routing import pd
from laswrr.scheduler.routing.router import Admission
from laswrr.services.proxy.attempt import AttemptRunner, record
from laswrr.services.proxy.events import Attempt
from laswrr.services.proxy.exchange import AttemptState, Done, Exchange, Failed, Result, ms

# an sglang pair whose decode leg ended: how long its prefill leg may still take to answer before it is cancelled
PREFILL_GRACE_S = 1.0


async def vllm_prefill(runner: AttemptRunner, exchange: Exchange, admission: Admission, decode: Admission,
                       attempt_id: str) -> bytes | Failed:
    """A vllm pair's prefill leg (one token, the KV kept for the decode node): the decode leg's body
    (the client's, with the KV params the prefill answered), or why the leg failed (unrecorded:
    the forwarder records it with what follows). The pair's decode node is released if the client goes."""
    base = exchange.base
    state = runner.started(attempt_id, admission, exchange)
    try:
        result = await runner.prefill(exchange, admission, state, pd.prefill_body(base))  # a JSON object (app.py)
    except asyncio.CancelledError:
        runner.cancelled(attempt_id, admission, exchange, state)
        runner.router.admitter.release(decode)
        raise
    finally:
        runner.router.admitter.release(admission)
    if isinstance(result, Failed):
        return result
    try:
        params = pd.kv_transfer_params(result[0])
    except pd.PdBodyError as exc:  # a prefill engine without its KV connector: another may have one
        return Failed(FailureKind.NO_KV_PARAMS, str(exc), status=state.status)
    runner.prefilled(attempt_id, admission, exchange, state, result[1])
    return pd.decode_body(base, params)


@dataclass(slots=True, eq=False)
class PrefillLeg:
    """An ``sglang`` pair's prefill leg: its own task, beside the decode leg."""

    admission: Admission
    attempt_id: str
    state: AttemptState
    task: asyncio.Task[Failed | None] | None = None  # None: the leg completed; a Failed: why not
    cancel_reason: str | None = None  # set before its pair cancels it (its decode leg ended or failed)


class SglangPair:
    """Both legs of an ``sglang`` pair at once, one body with the pair's bootstrap address and room:
    when either fails first, the other is cancelled at once (a decode leg whose first byte came
    keeps its KV: a later prefill failure no longer matters); a completed decode leg gives its
    prefill leg ``PREFILL_GRACE_S`` to answer."""

    def __init__(self, runner: AttemptRunner) -> None:
        self.runner = runner

    def start(self, exchange: Exchange, admission: Admission, attempt_id: str) -> tuple[PrefillLeg, bytes]:
        """Start the prefill leg with a fresh bootstrap room; the body both legs carry."""
        room = secrets.randbits(pd.BOOTSTRAP_ROOM_BITS)
        body = pd.sglang_body(exchange.base, pd.bootstrap_host(admission.url), admission.bootstrap_port, room)
        leg = PrefillLeg(admission, attempt_id, self.runner.started(attempt_id, admission, exchange))
        leg.task = asyncio.create_task(self._prefill(exchange, leg, body))
        return leg, body

    async def _prefill(self, exchange: Exchange, leg: PrefillLeg, body: bytes) -> Failed | None:
        """The prefill leg, recorded; its failure (None: completed)."""
        runner, admission, state = self.runner, leg.admission, leg.state
        try:
            result = await runner.prefill(exchange, admission, state, body)
        except asyncio.CancelledError:
            if leg.cancel_reason is None:  # the client went, or the proxy stops
                runner.cancelled(leg.attempt_id, admission, exchange, state)
                raise
            failed = Failed(FailureKind.LEG_CANCELLED, f"cancelled: {leg.cancel_reason}", status=state.status)
            runner.finish(leg.attempt_id, admission, exchange,
                          record(exchange, state, RequestOutcome.UPSTREAM_ERROR, state.status, error=failed.reason))
            return failed
        finally:
            runner.router.admitter.release(admission)
        if isinstance(result, Failed):
            exchange.tried.append(admission.node)
            runner.finish(leg.attempt_id, admission, exchange,
                          Attempt(outcome=result.outcome(), status=result.status,
                                  duration_ms=ms(time.perf_counter() - exchange.arrived), error=result.reason))
            return result
        runner.prefilled(leg.attempt_id, admission, exchange, state, result[1])
        return None

    async def run(self, request: web.BaseRequest, exchange: Exchange, leg: PrefillLeg, admission: Admission,
                  attempt_id: str, body: bytes, suspect: list[str]) -> Result:
        """The decode leg on ``admission`` beside ``leg``; a prefill node whose decode leg failed
        beside it joins ``suspect`` (its bootstrap may be what failed)."""
        prefill = leg.task
        assert prefill is not None
        state = self.runner.started(attempt_id, admission, exchange)
        decode = asyncio.create_task(self.runner.run(request, exchange, admission, attempt_id, body, state))
        try:
            await asyncio.wait((decode, prefill), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode.done():
                failure = prefill.result()
                if failure is not None and not state.streaming:
                    state.partner_failed = failure
                    decode.cancel()
            result = await decode
            failure = prefill.result() if prefill.done() else None
            if isinstance(result, Failed) and failure is not None and not result.partner and not state.streaming:
                # both ended in the same turn: the decode leg's failure is its prefill's (its bootstrap broke)
                result = Failed(result.kind, f"{result.reason} beside its failed prefill leg ({failure.reason})",
                                status=result.status, response=None if failure.retryable else failure.response,
                                retryable=failure.retryable, partner=True)
            if not prefill.done():
                await self._end_prefill(leg, admission, result, suspect)
            await asyncio.wait((prefill,))
            return result
        except asyncio.CancelledError:  # the client went, or the proxy stops: both legs end with it
            decode.cancel()
            prefill.cancel()
            await asyncio.gather(decode, prefill, return_exceptions=True)
            raise

    @staticmethod
    async def _end_prefill(leg: PrefillLeg, admission: Admission, result: Result, suspect: list[str]) -> None:
        """The decode leg ended first: its prefill leg gets the grace if it completed, else is cancelled."""
        prefill = leg.task
        assert prefill is not None
        if isinstance(result, Done):
            await asyncio.wait((prefill,), timeout=PREFILL_GRACE_S)
            why = f"its decode leg on {admission.node} ended {PREFILL_GRACE_S:g} s before it"
        else:
            why = f"its decode leg on {admission.node} failed: " + (
                result.reason if isinstance(result, Failed) else result.attempt.error or "broken")
            if isinstance(result, Failed):
                suspect.append(leg.admission.node)
        if not prefill.done():
            leg.cancel_reason = why
            prefill.cancel()
