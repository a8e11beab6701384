"""The fact table (schemas/facts.py) is the one statement of kind, struct, subject, key and
batchable: the subjects, the codec, the views and docs/wire.md say what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import duckdb
import msgspec
import pytest

from laswrr.replay import store
from laswrr.schemas import codec, events, facts, outputs
from laswrr.schemas import subjects as sj
from laswrr.schemas.facts import Key

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"<!-- generated: facts -->\n(?P<body>.*?)<!-- end generated -->", re.DOTALL)


def _kinds(module: object) -> set[type[msgspec.Struct]]:
    return {value for value in vars(module).values() if isinstance(value, type) and issubclass(value, msgspec.Struct)
            and isinstance(value.__dict__.get("KIND"), str) and value is not events.Event}


def test_every_struct_with_a_kind_is_one_row() -> None:
    assert {f.struct for f in facts.INPUTS} == _kinds(events)
    assert {f.struct for f in facts.OUTPUTS} == _kinds(outputs)
    assert len(facts.FACTS) == len(_kinds(events)) + len(_kinds(outputs))


def test_the_subjects_are_the_tables() -> None:
    constants = {value for name, value in vars(sj).items() if name.isupper() and isinstance(value, str)}
    for fact in facts.FACTS:
        assert fact.subject in constants, fact
        if fact.key is Key.NONE:
            assert sj.split(fact.subject) == (fact.subject, None)
            continue
        assert sj.split(f"{fact.subject}.x1") == (fact.subject, "x1")
        builders = [f for name, f in vars(sj).items() if callable(f) and name.islower() and not name.startswith("_")
                    and f.__doc__ and f"``{fact.pattern}``" in f.__doc__]
        assert len(builders) == 1, fact
        assert builders[0]("x1") == f"{fact.subject}.x1"
        with pytest.raises(sj.SubjectError, match=f"invalid {fact.key.what} "):
            builders[0]("a.b")


def test_the_codec_reads_what_the_table_says() -> None:
    for fact in facts.INPUTS:
        subject = fact.subject if fact.key is Key.NONE else f"{fact.subject}.x1"
        assert codec.event_type(subject) == (fact.struct, None if fact.key is Key.NONE else "x1")
    assert list(codec.BATCHABLE) == [f.kind for f in facts.INPUTS if f.batchable]
    assert {kind for kind, (cls, prefix) in codec.BATCHABLE.items()
            if facts.BY_KIND[kind] != facts.of(cls) or prefix != facts.of(cls).subject} == set()
    snapshot = outputs.WeightSnapshot(pool="p", as_of_seq=1, tick=0, ts_ns=0, panic=False, nodes=[])
    assert codec.decode_output(sj.out_snapshot("p"), codec.encode(snapshot)) == snapshot


def test_a_batch_item_takes_its_key_from_the_table() -> None:
    """A proxy-keyed kind names no key (the batch's proxy is its key); a node-keyed kind names its node."""
    heartbeat = codec.batch_item(events.ProxyHeartbeat.KIND, None, codec.encode(events.ProxyHeartbeat(inflight=1)))
    started = codec.batch_item(events.RequestStarted.KIND, "n1",
                               codec.encode(events.RequestStarted(request_id="r", proxy="p1")))
    _, items = codec.decode_batch(sj.req_batch("p1"), codec.batch_payload(None, 1, [heartbeat, started]))
    assert [(item.subject, item.key) for item in items] == [(sj.proxy_heartbeat("p1"), "p1"), (sj.req_started("n1"), "n1")]


def test_the_views_fact_kinds_is_the_table() -> None:
    con = duckdb.connect(":memory:")
    store.create_schema(con)
    rows = con.execute("SELECT kind, struct, family, key, batchable, output FROM fact_kinds").fetchall()
    assert rows == [(f.kind, f.struct.__name__, f.subject, f.key.word, f.batchable, f in facts.OUTPUTS)
                    for f in facts.FACTS]
    assert con.execute(f"SELECT count(*) FROM (SELECT 'lb.out.snapshot.p' AS subject) "
                       f"WHERE {store.core_outputs_filter()}").fetchone() == (1,)


def test_docs_wire_md_holds_the_generated_table() -> None:
    page = ROOT / "docs" / "wire.md"
    match = SECTION.search(page.read_text(encoding="utf-8"))
    assert match is not None, "docs/wire.md has no <!-- generated: facts --> section"
    assert match["body"] == facts.markdown(), "regenerate: python -m laswrr.docgen"


def test_the_generator_prints_a_row_per_fact_with_its_fields() -> None:
    printed = subprocess.run([sys.executable, "-m", "laswrr.schemas.facts", "--markdown"], capture_output=True,
                             text=True, check=True).stdout
    assert printed == facts.markdown()
    rows = [line for line in printed.splitlines() if line.startswith("| `")]
    assert len(rows) == len(facts.FACTS)
    started = next(row for row in rows if row.startswith(f"| `{events.RequestStarted.KIND}`"))
    assert "`lb.req.started.<node>` | node | yes |" in started and "`request_id`: str" in started
    assert "`role`: NodeRole (absent)" in started
