"""The fold: recorded inputs, applied one by one to the core, as every driver of the core applies them.

``Fold.apply(envelope)`` is the one loop body of the scheduler service, replay (and what-if, a
replay with other parameters), the portable replay, the synthetic log builder and the virtual
bench. Per input it

* applies the envelope through ``apply_guarded`` (scheduler/core.py): a broken invariant in the
  core becomes the input's recorded rejection, and ``fault`` holds the exception (None otherwise)
  for the caller to report;
* re-applies the what-if ``overrides`` after a recorded ``lb.admin.config``, so they stay in
  force while every other key follows the log;
* replaces an output over ``limit`` bytes by a rejection of its input (``schemas.codec.publishable``:
  the service's connection limit, or the limit a recorded rejection names in a replay);
* with ``dedupe``, drops an output whose ``Nats-Msg-Id`` (``Output.msg_id``) was returned before,
  as JetStream's de-duplication drops a republished one;
* counts what it did: ``applied`` inputs, ``rejections`` by cause, ``faults``.

Pure, as the core: no clock, IO or logging here (the service logs ``fault``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from laswrr.scheduler import config as config_mod
from laswrr.scheduler.core import Scheduler, apply_guarded
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, publishable
from laswrr.schemas.words import RejectCause


class Fold:
    """One core and the inputs applied to it (module docstring). ``scheduler`` may be replaced
    (a restored checkpoint) between inputs."""

    def __init__(self, scheduler: Scheduler | None = None, config: config_mod.SchedulerConfig | None = None,
                 overrides: Mapping[str, Any] | None = None, dedupe: bool = False) -> None:
        if scheduler is None:
            config = config or config_mod.SchedulerConfig()
            scheduler = Scheduler(config_mod.with_changes(config, dict(overrides)) if overrides else config)
        self.scheduler = scheduler
        self.overrides = dict(overrides) if overrides else None
        self.fault: Exception | None = None  # the core's exception on the last input, if it raised
        self.applied = 0
        self.faults = 0
        self.rejections: Counter[RejectCause] = Counter()
        self._seen: set[str] | None = set() if dedupe else None

    def apply(self, envelope: Envelope, limit: int | None = None) -> list[Output]:
        """The outputs of one input (see the module docstring); ``fault`` says whether the core raised."""
        scheduler = self.scheduler
        outputs, self.fault = apply_guarded(scheduler, envelope)
        self.applied += 1
        if self.fault is not None:
            self.faults += 1
        if self.overrides is not None and envelope.subject == sj.ADMIN_CONFIG:
            scheduler.state.config = config_mod.with_changes(scheduler.state.config, self.overrides)
        if not outputs:
            return outputs
        if limit is not None:
            outputs = publishable(outputs, envelope.subject, limit)
        if self._seen is not None:
            outputs = self._new(outputs)
        for output in outputs:
            if output.cause is not None:
                self.rejections[output.cause] += 1
        return outputs

    def _new(self, outputs: list[Output]) -> list[Output]:
        seen, kept = self._seen, []
        assert seen is not None
        for output in outputs:
            msg_id = output.msg_id
            if msg_id not in seen:
                seen.add(msg_id)
                kept.append(output)
        return kept


def rejections(outputs: list[Output]) -> list[Output]:
    """The rejections among ``outputs`` (each carries its cause)."""
    return [output for output in outputs if output.cause is not None]
