"""The shared words and the subjects are spelled in schemas/ only (wire contract v1).

Python outside schemas/ uses the enums and ``schemas.subjects``; a scan of every module's string
literals finds no word of any enum of ``schemas/words.py`` and no subject, except the words that
also mean something else (``HOMONYMS``) and the places listed in ``KEPT`` (each with why). The two places that cannot import Python spell words the enums define, and are
checked here word by word: the analyst views (replay/views.sql) and the dashboard's script.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from enum import StrEnum
from pathlib import Path

import msgspec

from laswrr.schemas import codec, events, facts, outputs, words
from laswrr.schemas import subjects as sj
from laswrr.services.dashboard.board import PHASE_MARKS

ROOT = Path(__file__).resolve().parents[2]
ENUMS: list[type[StrEnum]] = [value for value in vars(words).values()
                              if isinstance(value, type) and issubclass(value, StrEnum) and value is not StrEnum]
# Words of the enums that are also something else, so a literal of them says nothing: never checked.
HOMONYMS = {
    "": "DrainCause.NONE and EjectCause.NONE: the empty string",
    "capacity": "DrainCause.CAPACITY, and the field of lb.admin.capacity, NodeView, the nodes file, the sim engine",
    "default": "Band.DEFAULT, and the default pool's name (events.NodeRegistered.pool)",
    "vllm": "PdProtocol.VLLM, and an engine's name (events.EngineName, the sim engine's flavour)",
    "sglang": "PdProtocol.SGLANG, and an engine's name (events.EngineName)",
    "drain": "Trigger.DRAIN, and a command's name (laswrr drain), a subject token, a dashboard mark",
    "undrain": "Trigger.UNDRAIN, and a command's name (laswrr undrain), a subject token",
    "remove": "DrainCause.REMOVE, and a command's name (laswrr remove), a subject token",
    "operator": "DrainCause.OPERATOR, and the NATS account of the operator CLI (services/accounts.py)",
    "npu": "DrainCause.NPU and EjectCause.NPU, and the collector's NPU sampling (a log or column name)",
}
CHECKED = {member.value for enum in ENUMS for member in enum} - set(HOMONYMS)
SUBJECTS = {value for name, value in vars(sj).items() if name.isupper() and isinstance(value, str)
            and value.startswith("lb.")}

# (file, literal): why it stays a literal.
KEPT = {
    ("scheduler/swrr.py", "active"): "a __slots__ name of the SWRR state, not a phase",
    ("scheduler/core.py", "registered"): "the phase reason of a registration: text for people",
    ("scheduler/state.py", "registered"): "the default phase reason: text for people",
    ("services/dashboard/board.py", "active"): "a dashboard mark kind (MARK_COLORS in dashboard.js), checked below",
    ("services/dashboard/board.py", "ejected"): "a dashboard mark kind (MARK_COLORS in dashboard.js), checked below",
    ("services/dashboard/board.py", "removed"): "a dashboard mark kind (MARK_COLORS in dashboard.js), checked below",
    ("bench/micro.py", "lb."): "the prefix cut from a subject to name an event kind in a benchmark table",
    ("bench/bus_bench.py", "both"): "a --mode choice (backlog, live or both), not a node role",
    ("bench/event_cpu.py", "batch"): "a results column (events per batch), not a band",
    ("services/sim_engine/openai_api.py", "completed"): "the OpenAI Responses API's status of an answer",
    ("services/proxy/app.py", "stopping"): "a /ready status word (also a RefusalCause)",
    ("services/proxy/app.py", "no_snapshot"): "a /ready status word (also a RefusalCause)",
    ("services/proxy/app.py", "no_routable_node"): "a /ready status word (also a RefusalCause)",
    ("services/proxy/answers.py", "upstream_error"): "the error type of an SSE error event sent to the client",
    ("services/sim_engine/app.py", "invalid_json"): "the simulated engine's own error code (an engine's answer)",
    ("services/up.py", "no_snapshot"): "the proxy's /ready status word read back (also a RefusalCause)",
    **{("bench/conversations.py", word): "a word of the generated chat texts' vocabulary (prose, not an enum's)"
       for word in ("batch", "decode", "prefill", "eject", "new")},
}
KEPT_PREFIXES = {("laswrr/command_help.py", "lb."): "help text for people naming the subject a command publishes"}


def _literals(path: Path) -> list[tuple[int, str]]:
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if token.type != tokenize.STRING:
            continue
        try:
            value = ast.literal_eval(token.string)
        except (ValueError, SyntaxError):
            continue  # an f-string: its parts are names
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            found.append((token.start[0], value))
    return found


def _is_word(rel: str, value: str) -> bool:
    if (rel, value) in KEPT:
        return False
    if value.startswith("lb."):
        return not any(rel == kept and value.startswith(prefix) for kept, prefix in KEPT_PREFIXES)
    return value in CHECKED


def test_no_phase_health_cause_or_subject_literal_outside_schemas() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".venv/", "tests/", "schemas/", "build/")) or "/." in rel:
            continue
        found += [f"{rel}:{line}: {value!r}" for line, value in _literals(path) if _is_word(rel, value)]
    assert not found, "spell these with schemas.words / schemas.subjects:\n" + "\n".join(found)


def test_every_homonym_is_a_word_of_the_enums() -> None:
    assert set(HOMONYMS) <= {member.value for enum in ENUMS for member in enum}
    assert words.Band in ENUMS and words.HoldCause in ENUMS and words.RefusalCause in ENUMS


def test_every_kept_literal_is_still_there() -> None:
    """The list above is exact: a place that no longer spells its word leaves the list."""
    for (rel, value), _why in {**KEPT, **KEPT_PREFIXES}.items():
        literals = [v for _, v in _literals(ROOT / rel)]
        assert any(v == value or v.startswith(value) for v in literals), (rel, value)


# -- replay/views.sql -------------------------------------------------------------------------------

# The views' own words (codes of columns the views define, DuckDB's names, the default pool).
VIEW_WORDS = {
    "engine_cut", "proxy_gone", "open_at_proxy_stop", "open_at_end", "router_aborted",  # interruptions.reason
    "node_absent", "not_routable", "zero_weight",  # admissions_to_draining.verdict
    "deadline", "inflight",  # drains.drained_by
    "engine", "router", "HTTP ",  # error_answers.answered_by, and its cause for an engine's status
    "none", "xx",  # status_class: 'none' (no answer) or the status // 100 and 'xx'
    "retried",  # continuations.kind (with "continued", a RequestOutcome)
    "default",  # the default pool (events.NodeRegistered.pool)
    "dispatched",  # queued.ended: a held request that was started (else its refusal cause)
    "phase", "rejected", "capacity",  # node_timeline.kind
    "ARRAY",  # DuckDB's json_type
    ".", r"^(.*)\.[^.]+$",  # rebuilding a batched event's subject, a subject's family
}


# A word or a subject pattern; other literals are text the views build for people (node_timeline).
WORD = re.compile(r"^[A-Za-z_][\w.%>]*$")


def _sql() -> str:
    text = (ROOT / "replay/views.sql").read_text(encoding="utf-8")
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def _fields() -> set[str]:
    names: set[str] = set()
    for module in (events, outputs):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct):
                names |= {f.encode_name for f in msgspec.structs.fields(value)}
    return names


def test_the_views_read_only_fields_the_structs_define() -> None:
    keys = {key for key in re.findall(r"->>?\s*'([^']*)'", _sql()) if WORD.match(key)}
    assert keys and not keys - _fields(), keys - _fields()


def test_the_views_spell_only_words_the_enums_and_subjects_define() -> None:
    sql = re.sub(r"->>?\s*'[^']*'", "", _sql())
    literals = {text for text in re.findall(r"'([^']*)'", sql) if WORD.match(text)}
    defined = ({m.value for enum in ENUMS for m in enum} | SUBJECTS | {s + ".%" for s in SUBJECTS}
               | set(codec.BATCHABLE) | {key.word for key in facts.Key} | {sj.EVENTS_STREAM, sj.OUT_STREAM}
               | VIEW_WORDS)
    assert not literals - defined, literals - defined
    assert {words.Phase.DRAINING, words.Phase.DRAINED, words.PhaseCause.DRAIN_DEADLINE} <= literals


# -- the dashboard's script ---------------------------------------------------------------------------


def _js_keys(name: str) -> set[str]:
    script = (ROOT / "services/dashboard/static/dashboard.js").read_text(encoding="utf-8")
    match = re.search(rf"const {name} = \{{(.*?)\}};", script, re.S)
    assert match, name
    return {key.strip('"') for key in re.findall(r'("[^"]+"|\w+)\s*:', match.group(1))}


def test_the_dashboard_colours_every_phase_and_mark() -> None:
    assert _js_keys("PHASE_COLORS") == {p.value for p in words.Phase} - {words.Phase.NEW}
    assert set(PHASE_MARKS) == {p for p in words.Phase} - {words.Phase.NEW}
    assert _js_keys("MARK_COLORS") == set(PHASE_MARKS.values()) | {"capacity", "rejected", "admin"}
