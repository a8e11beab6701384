"""The shared words: request outcomes, drain causes and ejection causes, one definition each.

Each is a ``StrEnum``, so a member is its string on the wire, in checkpoints and in SQL
(``RequestOutcome.COMPLETED == "completed"``), and a typed msgspec field decodes only the listed
values: a ``lb.req.finished`` with an unknown outcome is a recorded rejection on
``lb.out.rejected``, not a silent new category. Adding a word is one line here; readers that
list every outcome (``laswrr report``) iterate the enum.
"""

from __future__ import annotations

from enum import StrEnum


class RequestOutcome(StrEnum):
    """How one proxy attempt ended (``lb.req.finished`` ``outcome``; docs/analysts.md, "Views")."""

    COMPLETED = "completed"  # status below 500 and the whole answer reached the client
    CLIENT_CANCELLED = "client_cancelled"  # the client went away; the upstream request was cancelled
    UPSTREAM_ERROR = "upstream_error"  # connection failure, timeout, 5xx, or a stream cut after its first byte
    ROUTER_ABORTED = "router_aborted"  # still running when the proxy's shutdown grace period ended
    CONTINUED = "continued"  # a stream broke after its first byte and went on at next_attempt, on another node


class DrainCause(StrEnum):
    """Why the scheduler is draining a node (``NodeState.drain_cause``); NONE while not draining."""

    NONE = ""
    CAPACITY = "capacity"  # lb.admin.capacity set it to 0
    OPERATOR = "operator"  # lb.admin.drain
    REMOVE = "remove"  # lb.admin.remove: drain, then forget
    NPU = "npu"  # npu-smi reported Alarm


class EjectCause(StrEnum):
    """Why the scheduler ejected a node (``NodeState.eject_cause``); NONE while not ejected."""

    NONE = ""
    OUTLIER = "outlier"  # consecutive upstream errors (for a growing time)
    PROBE = "probe"  # failed health probes
    NPU = "npu"  # npu-smi reported Critical or an unknown health
