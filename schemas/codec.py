"""Decode inputs by subject and encode outputs; one typed error for every bad payload.

``decode_event(subject, data)`` returns ``(key, event)`` where ``key`` is the subject's last
token (node id or proxy name, None for subject-wide events). Anything that cannot be applied
(not JSON, wrong type, value out of range, missing field, unknown subject) raises
``SchemaError`` whose message is the rejection reason recorded on ``lb.out.rejected``.

A batch (``lb.req.batch.<proxy>``, ``events.RequestBatch``) decodes to its events still raw;
``unbatch`` then decodes each one exactly as ``decode_event`` would have decoded it alone on its
own subject, and returns a ``SchemaError`` in place of each event that does not decode, naming
its index, so the others still apply. ``decode_batch`` does both from the message's bytes,
decoding the events in the same pass as the batch when it can. ``batch_item`` and
``batch_payload`` write the wire form (docs/wire.md, "Batched request events").
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from laswrr.schemas import events as ev
from laswrr.schemas import facts
from laswrr.schemas import subjects as sj
from laswrr.schemas.facts import Key
from laswrr.schemas.outputs import ConfigApplied, PhaseChanged, Rejected, RequestsVoided, WeightSnapshot, clip
from laswrr.schemas.words import RejectCause

MAX_PAYLOAD_BYTES = 1 << 20


class SchemaError(ValueError):
    """A payload or subject that does not satisfy the wire contract; ``cause`` is the code its
    rejection records (the message is its reason, for people)."""

    def __init__(self, message: str, cause: RejectCause = RejectCause.INVALID_PAYLOAD) -> None:
        super().__init__(message)
        self.cause = cause


class Envelope(msgspec.Struct, frozen=True):
    """One input as the core sees it: stream sequence, event time, subject, raw payload."""

    seq: int
    ts_ns: int
    subject: str
    data: bytes


class Output(msgspec.Struct, frozen=True):
    """One output message: subject, encoded payload, and the cause it derives from."""

    subject: str
    data: bytes
    as_of_seq: int
    index: int = 0  # position among this input's outputs on the same subject
    cause: RejectCause | None = None  # a rejection's cause, so a counter needs no decode (not encoded)

    @property
    def msg_id(self) -> str:
        """De-duplication id: the same input yields the same id on every replica.

        One input can yield two outputs on one subject (a node that goes draining -> drained at
        once); the second gets a ``:<index>`` suffix so de-duplication keeps both.
        """
        base = f"{self.as_of_seq}:{self.subject}"
        return base if self.index == 0 else f"{base}:{self.index}"


def _event(fact: facts.Fact) -> type[ev.Event]:
    assert issubclass(fact.struct, ev.Event), fact
    return fact.struct


# The codec's lookups, derived from the fact table (schemas.facts).
_BY_PREFIX: dict[str, type[ev.Event]] = {
    fact.subject: _event(fact) for fact in facts.INPUTS if fact.key is not Key.NONE}
_WHOLE_SUBJECT: dict[str, type[ev.Event]] = {
    fact.subject: _event(fact) for fact in facts.INPUTS if fact.key is Key.NONE}
_DECODERS: dict[type[ev.Event], msgspec.json.Decoder[Any]] = {
    cls: msgspec.json.Decoder(cls) for cls in (*_BY_PREFIX.values(), *_WHOLE_SUBJECT.values())
}
_ENCODER = msgspec.json.Encoder()


_EVENT_TYPES: dict[str, tuple[type[ev.Event], str | None]] = {}  # subjects event_type has answered


def event_type(subject: str) -> tuple[type[ev.Event], str | None]:
    """The struct a subject's payload decodes into, and the subject's key token (remembered per
    subject, as a pool has few nodes and proxies: every input asks)."""
    found = _EVENT_TYPES.get(subject)
    if found is not None:
        return found
    if subject in _WHOLE_SUBJECT:
        return _WHOLE_SUBJECT[subject], None
    prefix, _, key = subject.rpartition(".")
    cls = _BY_PREFIX.get(prefix)
    if cls is None:
        raise SchemaError(f"unknown subject {subject!r}: no event kind is published there",
                          RejectCause.UNKNOWN_SUBJECT)
    try:
        sj.check_token(key)
    except sj.SubjectError as exc:
        raise SchemaError(str(exc), RejectCause.INVALID_NAME) from None
    if len(_EVENT_TYPES) > 10_000:
        _EVENT_TYPES.clear()
    found = _EVENT_TYPES[subject] = (cls, key)
    return found


def decode_event(subject: str, data: bytes, core: bool = False) -> tuple[str | None, ev.Event]:
    """``(key, event)`` of one input; with ``core`` a batchable kind's event is decoded as
    ``decode_batch(..., core=True)`` decodes it (the scheduler's path, its names checked once)."""
    cls, key = event_type(subject)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise SchemaError(f"payload of {len(data)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit",
                          RejectCause.PAYLOAD_TOO_LARGE)
    if not data.strip():
        data = b"{}"
    if core and cls in _UNPATTERNED:
        loose, fields = _UNPATTERNED[cls]
        try:
            event = _CORE_DECODERS[loose].decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # the kind's own struct says why
        else:
            if _named(event, fields):
                return key, event
    return key, _decode_as(cls, data)


def _decode_as(cls: type[ev.Event], data: bytes | msgspec.Raw) -> Any:
    try:
        return _DECODERS[cls].decode(data)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"invalid {facts.of(cls).subject} payload: {exc}") from None  # as the operator sent it
    except msgspec.DecodeError as exc:
        raise SchemaError(f"payload is not valid JSON: {exc}", RejectCause.NOT_JSON) from None


# -- batches -----------------------------------------------------------------------------------------

# The kinds a batch may hold, with the subject prefix each has alone (in the table's order, which
# a rejection's text lists); a request event's key is its node, a proxy-keyed event's key (a
# refusal's too: it has no node) is the batch's proxy (the item carries null).
BATCHABLE: dict[str, tuple[type[ev.Event], str]] = {
    fact.kind: (_event(fact), fact.subject) for fact in facts.INPUTS if fact.batchable}
_PROXY_KINDS = frozenset(fact.kind for fact in facts.INPUTS if fact.batchable and fact.key is Key.PROXY)
_ITEM = msgspec.json.Decoder(ev.BatchedEvent)


# Names checked once. Every request event and heartbeat names its proxy, pool and boot id
# (``events.Name``), and msgspec checks a Name's pattern with a regex search per field: most of
# such an event's decode. A pool has few of them, so the core's path (``core=True`` of ``decode_batch``
# and ``decode_event``) decodes each batchable kind as a subclass of its struct without the pattern
# (``_unpatterned``) and searches each distinct name once (``_named``); a payload with a name that
# does not match, or any other error, is decoded again by the struct itself, which says why, as before.
_NAME_META: msgspec.Meta = typing.get_args(ev.Name)[1]
_NAME_SEARCH = re.compile(_NAME_META.pattern or "").search  # how msgspec checks a pattern: re.search
_ANY_NAME = Annotated[str, msgspec.Meta(min_length=_NAME_META.min_length, max_length=_NAME_META.max_length)]
_NAMES_MATCHED: set[str] = set()


def _unpatterned(cls: type[ev.Event]) -> tuple[type[ev.Event], tuple[str, ...]]:
    """``cls`` with its Name fields' pattern left out (a subclass: the same fields, in the same
    order, with the same defaults), and those fields."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = [field for field in msgspec.structs.fields(cls) if hints[field.name] in (ev.Name, ev.Name | None)]
    if not fields:
        return cls, ()
    spec = [(f.name, _ANY_NAME if hints[f.name] == ev.Name else _ANY_NAME | None) if f.default is msgspec.NODEFAULT
            else (f.name, _ANY_NAME if hints[f.name] == ev.Name else _ANY_NAME | None, f.default) for f in fields]
    loose = msgspec.defstruct(cls.__name__, spec, bases=(cls,), frozen=True, kw_only=True, module=__name__)
    return typing.cast(type[ev.Event], loose), tuple(f.name for f in fields)


def _named(event: ev.Event, fields: tuple[str, ...]) -> bool:
    """Whether every Name field of ``event`` matches the pattern (each distinct name searched once)."""
    for field in fields:
        name = getattr(event, field)
        if name is None or name in _NAMES_MATCHED:
            continue
        if not _NAME_SEARCH(name):
            return False
        if len(_NAMES_MATCHED) > 10_000:
            _NAMES_MATCHED.clear()
        _NAMES_MATCHED.add(name)
    return True


_ITEM_KINDS: dict[type[Any], str] = {}  # each decoder's item struct -> its kind


def _items_decoder(event_struct: Callable[[type[ev.Event]], type[ev.Event]]) -> msgspec.json.Decoder[Any]:
    """A decoder of a whole ``RequestBatch`` that decodes its events in the same pass: each
    ``[kind, key, event]`` as a tagged array (its tag the kind) with ``event`` decoded as
    ``event_struct(the kind's struct)``. Any error falls back to the event-by-event path."""
    kinds = []
    for kind, (cls, _) in BATCHABLE.items():
        item = msgspec.defstruct(f"_Item_{kind}", [("key", str | None), ("event", event_struct(cls))], frozen=True,
                                 array_like=True, tag=kind, module=__name__)
        _ITEM_KINDS[item] = kind
        kinds.append(item)
    one_of: Any = typing.Union.__getitem__(tuple(kinds))
    events = Annotated[list[one_of], msgspec.Meta(min_length=1, max_length=ev.MAX_BATCH_EVENTS)]
    items = msgspec.defstruct("_Items", [("boot_id", ev.Name | None, None), ("batch", ev.NonNegInt | None, None),
                                         ("events", events)], frozen=True, kw_only=True, module=__name__)
    return msgspec.json.Decoder(items)


_UNPATTERNED = {cls: _unpatterned(cls) for cls, _ in BATCHABLE.values()}
CORE_STRUCTS: dict[type[ev.Event], type[ev.Event]] = {loose: cls for cls, (loose, _) in _UNPATTERNED.items()}
"""The struct of a batchable kind's event on the core's path (``core=True``) -> the kind's own struct."""
_NAME_FIELDS = {loose: fields for loose, fields in _UNPATTERNED.values()}
_ITEMS = _items_decoder(lambda cls: cls)
_CORE_ITEMS = _items_decoder(lambda cls: _UNPATTERNED[cls][0])
_CORE_DECODERS = {loose: msgspec.json.Decoder(loose) for loose in CORE_STRUCTS}


class Unbatched(msgspec.Struct, frozen=True):
    """One event of a batch: the subject and key it would have alone, and the event, or the
    ``SchemaError`` saying why it does not decode (``subject`` None when the item names no
    batchable kind and key)."""

    index: int
    subject: str | None
    key: str | None
    event: ev.Event | None
    error: SchemaError | None


def decode_batch(subject: str, data: bytes, core: bool = False) -> tuple[str, list[Unbatched]]:
    """The proxy and the events of a batch message, as ``unbatch`` gives them; ``SchemaError``
    when the message is not a batch at all (``decode_event``'s reasons). With ``core``, an event
    may be an instance of a subclass of its kind's struct (``CORE_STRUCTS``; the same fields and
    values, not ``==`` to the kind's own instance): the scheduler's path, its names checked once."""
    cls, proxy = event_type(subject)
    if cls is not ev.RequestBatch or proxy is None:
        raise SchemaError(f"{subject!r} is not a batch subject ({sj.REQ_BATCH}.<proxy>)",
                          RejectCause.UNKNOWN_SUBJECT)
    if len(data) <= MAX_PAYLOAD_BYTES:
        try:
            unbatched = []
            for index, item in enumerate((_CORE_ITEMS if core else _ITEMS).decode(data).events):
                event, kind = item.event, _ITEM_KINDS[type(item)]
                if core and not _named(event, _NAME_FIELDS[type(event)]):
                    break
                _, alone, key = _ITEM_KEYS.get((proxy, kind, item.key)) or _item_key(proxy, kind, item.key)
                unbatched.append(Unbatched(index, alone, key, event, None))
            else:
                return proxy, unbatched
        except (msgspec.ValidationError, msgspec.DecodeError, SchemaError):
            pass  # say exactly what is wrong, event by event
    _, batch = decode_event(subject, data)
    return proxy, unbatch(proxy, batch)  # type: ignore[arg-type]


def unbatch(proxy: str, batch: ev.RequestBatch) -> list[Unbatched]:
    """The events of ``batch`` (published on ``lb.req.batch.<proxy>``), in order."""
    return [_unbatch_one(proxy, index, raw) for index, raw in enumerate(batch.events)]


def _unbatch_one(proxy: str, index: int, raw: msgspec.Raw) -> Unbatched:
    try:
        item = _ITEM.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return Unbatched(index, None, None, None, SchemaError(
            f"event {index}: not a [kind, key, event] array: {exc}", RejectCause.INVALID_BATCH_ITEM))
    return _unbatch_item(proxy, index, item)


_ITEM_KEYS: dict[tuple[str, str, str | None], tuple[type[ev.Event], str, str]] = {}  # checked (kind, key)s


def _item_key(proxy: str, kind: str, key: str | None) -> tuple[type[ev.Event], str, str]:
    """The struct, the subject alone and the key of a batch item's kind and key (SchemaError
    when they cannot be one event); remembered, as a pool has few nodes and proxies."""
    given = (proxy, kind, key)
    found = _ITEM_KEYS.get(given)
    if found is not None:
        return found
    cls, prefix = BATCHABLE[kind]
    if kind in _PROXY_KINDS:
        if key is not None:
            raise SchemaError(f"a {kind} event names no key (its proxy is the batch's), got {key!r}",
                              RejectCause.INVALID_BATCH_ITEM)
        key = proxy
    elif key is None:
        raise SchemaError(f"a {kind} event needs its node as key", RejectCause.INVALID_BATCH_ITEM)
    else:
        try:
            sj.check_token(key)
        except sj.SubjectError as exc:
            raise SchemaError(str(exc), RejectCause.INVALID_NAME) from None
    if len(_ITEM_KEYS) > 10_000:
        _ITEM_KEYS.clear()
    found = _ITEM_KEYS[given] = (cls, f"{prefix}.{key}", key)
    return found


def _unbatch_item(proxy: str, index: int, item: ev.BatchedEvent) -> Unbatched:
    if item.kind not in BATCHABLE:
        return Unbatched(index, None, None, None, SchemaError(
            f"event {index}: kind {item.kind!r} cannot be batched (one of {', '.join(BATCHABLE)})",
            RejectCause.INVALID_BATCH_ITEM))
    try:
        cls, subject, key = _item_key(proxy, item.kind, item.key)
    except SchemaError as exc:
        return Unbatched(index, None, None, None, SchemaError(f"event {index} ({item.kind}): {exc}", exc.cause))
    try:
        return Unbatched(index, subject, key, _decode_as(cls, item.event), None)
    except SchemaError as exc:
        return Unbatched(index, subject, key, None, SchemaError(f"event {index} ({subject}): {exc}", exc.cause))


def batch_item(kind: str, key: str | None, data: bytes) -> bytes:
    """One event of a batch on the wire: ``[kind, key, <data>]``, ``data`` the event's own
    payload (``encode(event)``) kept byte for byte."""
    return batch_item_head(kind, key) + data + b"]"


def batch_item_head(kind: str, key: str | None) -> bytes:
    """What precedes an event's payload in ``batch_item`` (a producer may keep it per kind and key)."""
    return b"[" + _ENCODER.encode(kind) + b"," + _ENCODER.encode(key) + b","


def batch_payload(boot_id: str | None, batch: int | None, items: list[bytes]) -> bytes:
    """A ``RequestBatch`` payload from ``batch_item`` bytes: ``{"boot_id", "batch", "events"}``."""
    return (b'{"boot_id":' + _ENCODER.encode(boot_id) + b',"batch":' + _ENCODER.encode(batch)
            + b',"events":[' + b",".join(items) + b"]}")


def publishable(outputs: list[Output], input_subject: str, limit: int) -> list[Output]:
    """``outputs``, each one whose payload is over ``limit`` bytes replaced by a rejection of the
    input that caused it (cause ``unpublishable_output``, subject cut to ``TEXT_MAX_CHARS``),
    which names the output and carries ``limit``. The scheduler service calls this with the
    connection's max payload less a margin for headers, so an output is never retried for ever;
    replay reads ``limit`` back from the recorded rejection (``unpublishable_limit``) and calls
    it again."""
    if all(len(output.data) <= limit for output in outputs):
        return outputs
    kept: list[Output] = []
    rejections = sum(1 for output in outputs if output.subject == sj.OUT_REJECTED)  # a batch's own (their indexes)
    for output in outputs:
        if len(output.data) <= limit:
            kept.append(output)
            continue
        reason = f"unpublishable output: {output.subject} of {len(output.data)} bytes, over the limit of {limit} bytes"
        rejected = Rejected(as_of_seq=output.as_of_seq, subject=clip(input_subject),
                            cause=RejectCause.UNPUBLISHABLE_OUTPUT, reason=reason, limit=limit)
        kept.append(Output(sj.OUT_REJECTED, encode(rejected), output.as_of_seq, index=rejections,
                           cause=RejectCause.UNPUBLISHABLE_OUTPUT))
        rejections += 1
    return kept


_REJECTED = msgspec.json.Decoder(Rejected)


def decode_rejected(data: bytes) -> Rejected:
    """A recorded ``lb.out.rejected`` payload (msgspec errors when it is not one)."""
    return _REJECTED.decode(data)


CoreOutput = WeightSnapshot | PhaseChanged | Rejected | ConfigApplied | RequestsVoided
_OUTPUT_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    fact.subject: _REJECTED if fact.struct is Rejected else msgspec.json.Decoder(fact.struct) for fact in facts.OUTPUTS}


def decode_output(subject: str, data: bytes) -> CoreOutput:
    """An ``lb.out.*`` message as its schema struct (how every reader of outputs reads them);
    ``SchemaError`` for a subject the core does not publish on or a payload that is not its struct."""
    decoder = _OUTPUT_DECODERS.get(sj.split(subject)[0])
    if decoder is None:
        raise SchemaError(f"{subject!r} is not an output subject of the core", RejectCause.UNKNOWN_SUBJECT)
    try:
        decoded: CoreOutput = decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SchemaError(f"invalid output on {subject}: {exc}") from None
    return decoded


_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)


def decode_snapshot(data: bytes) -> WeightSnapshot:
    """A weight snapshot (``lb.out.snapshot.<pool>``, or a pool's entry of LB_WEIGHTS) as its
    struct; ``SchemaError`` when it is not one."""
    try:
        return _SNAPSHOT.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SchemaError(f"not a weight snapshot: {exc}") from None


def unpublishable_limit(data: bytes) -> int | None:
    """The limit of a recorded ``publishable`` rejection, None for any other payload."""
    try:
        rejected = _REJECTED.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return rejected.limit if rejected.cause == RejectCause.UNPUBLISHABLE_OUTPUT else None


def encode(obj: Any) -> bytes:
    """The one encoder for everything published or recorded."""
    return _ENCODER.encode(obj)

