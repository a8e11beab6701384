"""The fact table: every kind of message the core reads or writes, in one place.

One row per kind: its struct (whose ``KIND`` tag is the kind), the subject it is published on
(or the subject's prefix, when a key token follows), what that key token names (a node, a proxy,
a pool, or nothing: the subject is the whole name), and whether a proxy may put it in an
``lb.req.batch.<proxy>`` message. Everything else that relates these is derived from this table:

* ``schemas.subjects``: the subject constants of the facts and their builders
  (``admin_node(node)``, ...), and which subjects ``split`` keeps whole;
* ``schemas.codec``: which struct a subject's payload decodes into, which kinds a batch may hold
  and which of them take the batch's proxy as key, and how outputs are read back;
* ``replay.store``: the ``fact_kinds`` view the analyst views (replay/views.sql) join to unnest a
  batch, and the filter replay uses to find the core's outputs in a recorded log;
* the wire contract page, docs/wire.md: its section ``<!-- generated: facts -->`` is ``markdown()``
  (``python -m laswrr.docgen`` writes it, ``python -m laswrr.schemas.facts --markdown`` prints it;
  tests/schemas/test_facts.py checks the page holds it).

This module imports only the structs (not ``schemas.subjects``, which is derived from it).
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, get_args, get_origin

import msgspec

from laswrr.schemas import events as ev
from laswrr.schemas import outputs as out

CONTRACT_VERSION = 1
"""The wire contract's version. Nothing records it: every log ever written is v1. A v2 that
changes a payload in a way a v1 reader cannot take will have to mark what it writes (a log
without the mark is v1) and bring v1 payloads up to it in the one read path."""


class Key(enum.Enum):
    """What the subject's last token names (``what``: as an error message says it)."""

    NODE = ("node", "node id")
    PROXY = ("proxy", "proxy name")
    POOL = ("pool", "pool name")
    NONE = ("none", "")

    def __init__(self, word: str, what: str) -> None:
        self.word, self.what = word, what


@dataclass(frozen=True)
class Fact:
    struct: type[msgspec.Struct]
    subject: str  # the whole subject (key NONE), else its prefix: ``<subject>.<key>``
    key: Key
    batchable: bool = False  # may travel in an ``lb.req.batch.<proxy>`` message (keyed as alone)

    @property
    def kind(self) -> str:
        kind: str = getattr(self.struct, "KIND")
        return kind

    @property
    def pattern(self) -> str:
        """The subject as the docs write it: ``lb.admin.node.<node>``, ``lb.clock.tick``."""
        return self.subject if self.key is Key.NONE else f"{self.subject}.<{self.key.word}>"


# Inputs (stream LB_EVENTS). The batchable kinds are listed in the order a rejection of a batch
# item names them ("one of req.started, ..."): recorded logs hold that text, so the order stays.
INPUTS: tuple[Fact, ...] = (
    Fact(ev.NodeRegistered, "lb.admin.node", Key.NODE),
    Fact(ev.NodeRemoveRequested, "lb.admin.remove", Key.NODE),
    Fact(ev.CapacitySet, "lb.admin.capacity", Key.NODE),
    Fact(ev.DrainRequested, "lb.admin.drain", Key.NODE),
    Fact(ev.UndrainRequested, "lb.admin.undrain", Key.NODE),
    Fact(ev.ConfigChanged, "lb.admin.config", Key.NONE),
    Fact(ev.EngineSampled, "lb.metrics.engine", Key.NODE),
    Fact(ev.NpuSampled, "lb.metrics.npu", Key.NODE),
    Fact(ev.ModelsListed, "lb.metrics.models", Key.NODE),
    Fact(ev.HealthProbed, "lb.health", Key.NODE),
    Fact(ev.RequestStarted, "lb.req.started", Key.NODE, batchable=True),
    Fact(ev.RequestFinished, "lb.req.finished", Key.NODE, batchable=True),
    Fact(ev.ProxyHeartbeat, "lb.proxy.heartbeat", Key.PROXY, batchable=True),
    Fact(ev.ProxyStopped, "lb.proxy.stopped", Key.PROXY, batchable=True),
    Fact(ev.RequestRefused, "lb.req.refused", Key.PROXY, batchable=True),
    Fact(ev.RequestQueued, "lb.req.queued", Key.PROXY, batchable=True),
    Fact(ev.RequestBatch, "lb.req.batch", Key.PROXY),
    Fact(ev.ClockTicked, "lb.clock.tick", Key.NONE),
)
# Outputs of the core (stream LB_OUT).
OUTPUTS: tuple[Fact, ...] = (
    Fact(out.WeightSnapshot, "lb.out.snapshot", Key.POOL),
    Fact(out.PhaseChanged, "lb.out.phase", Key.NODE),
    Fact(out.Rejected, "lb.out.rejected", Key.NONE),
    Fact(out.ConfigApplied, "lb.out.config", Key.NONE),
    Fact(out.RequestsVoided, "lb.out.voided", Key.PROXY),
)
FACTS: tuple[Fact, ...] = INPUTS + OUTPUTS

BY_STRUCT: dict[type[msgspec.Struct], Fact] = {fact.struct: fact for fact in FACTS}
BY_KIND: dict[str, Fact] = {fact.kind: fact for fact in FACTS}
WHOLE_SUBJECTS: frozenset[str] = frozenset(fact.subject for fact in FACTS if fact.key is Key.NONE)


def of(struct: type[msgspec.Struct]) -> Fact:
    return BY_STRUCT[struct]


def _check_table(facts: Iterable[Fact]) -> None:
    """Kinds, structs and subjects are each unique, and a batchable kind needs a key."""
    rows = list(facts)
    for name, values in (("kind", [f.kind for f in rows]), ("struct", [f.struct for f in rows]),
                         ("subject", [f.subject for f in rows])):
        if len(set(values)) != len(values):
            raise ValueError(f"the fact table names a {name} twice")
    if any(f.batchable and f.key is Key.NONE for f in rows):
        raise ValueError("a batchable fact needs a key")


_check_table(FACTS)


# -- the wire contract page (docs/wire.md) -------------------------------------------------------------


def _type_text(tp: Any) -> str:
    """A field's type as the page writes it: ``int``, ``str?`` (may be null), ``list[NpuChip]``."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        return _type_text(get_args(tp)[0])
    if origin is typing.Literal:
        return " or ".join(f'"{value}"' for value in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in get_args(tp) if arg is not type(None) and arg is not msgspec.UnsetType]
        text = " or ".join(_type_text(arg) for arg in members)
        if type(None) not in get_args(tp):
            return text
        return f"({text})?" if " or " in text else f"{text}?"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(arg) for arg in get_args(tp))}]"
    if tp is msgspec.Raw:
        return "JSON"
    return getattr(tp, "__name__", str(tp))


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return ""
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if value is msgspec.UNSET:
        return " (absent)"
    if isinstance(value, enum.Enum):
        value = value.value
    return f" = {msgspec.json.encode(value).decode()}"


def fields_text(struct: type[msgspec.Struct]) -> str:
    """``name: type`` for every field of ``struct`` (``= default`` when it may be left out)."""
    fields = msgspec.structs.fields(struct)
    if not fields:
        return "(none)"
    return ", ".join(f"`{f.encode_name}`: {_type_text(f.type)}{_default_text(f)}" for f in fields)


def markdown() -> str:
    """The generated section ``facts`` of docs/wire.md (what goes between its markers
    ``<!-- generated: facts -->`` and ``<!-- end generated -->``): the inputs, then the outputs."""
    lines = [f"Wire contract v{CONTRACT_VERSION}. A field written `type?` may be null; `= value` is its default when "
             "left out; `(absent)`: left out of the payload when it has no value.", ""]
    for title, rows in (("Inputs (stream `LB_EVENTS`)", INPUTS), ("Outputs of the core (stream `LB_OUT`)", OUTPUTS)):
        lines += [f"### {title}", "", "| kind | struct | subject | key | batchable | fields |",
                  "|---|---|---|---|---|---|"]
        for fact in rows:
            key = "" if fact.key is Key.NONE else fact.key.word
            lines.append(f"| `{fact.kind}` | `{fact.struct.__name__}` | `{fact.pattern}` | {key} | "
                         f"{'yes' if fact.batchable else ''} | {fields_text(fact.struct)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m laswrr.schemas.facts --markdown")
    sys.stdout.write(markdown())
