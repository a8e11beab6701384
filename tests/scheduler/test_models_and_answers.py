"""The core's part in model ids and error answers (docs/wire.md, "Model ids").

* ``lb.metrics.models.<node>`` puts the engine's model ids in the node's ``NodeView.models``;
  a new list emits the pool's snapshot, the same list again emits nothing; a node never listed
  has no ``models`` key, so its snapshot keeps the bytes it had before the field existed.
* ``lb.req.refused.<proxy>`` (a request the proxy answered itself) changes no state and emits
  nothing, alone or in a batch; a bad cause is a recorded rejection.
* An ``engine_error`` attempt (a 4xx answered whole) is an answer: it resets the consecutive
  failure count instead of adding to it, so a client's bad requests never eject a node, while
  5xx (``upstream_error``) still do.
"""

from __future__ import annotations

import msgspec

import json

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload

from tests.scheduler.sched_feed import Feed, decoded, rejections, warm_pool


def test_model_ids_reach_the_snapshot_and_only_a_change_emits_one() -> None:
    feed = warm_pool("n1", "n2")
    assert "models" not in feed.view("n1")  # never listed: the snapshot's bytes as before the field
    outputs = feed.send(sj.metrics_models("n1"), {"models": ["Qwen/Qwen2.5-7B"]})
    assert [s for s, _ in decoded(outputs)] == [sj.out_snapshot("default")]
    assert feed.view("n1")["models"] == ["Qwen/Qwen2.5-7B"]
    assert "models" not in feed.view("n2")
    assert feed.send(sj.metrics_models("n1"), {"models": ["Qwen/Qwen2.5-7B"]}) == []
    outputs = feed.send(sj.metrics_models("n1"), {"models": ["Qwen/Qwen2.5-7B", "lora-a"]})
    assert decoded(outputs)[0][1]["nodes"][0]["models"] == ["Qwen/Qwen2.5-7B", "lora-a"]
    restored = Feed(scheduler=type(feed.scheduler).restore(feed.checkpoint()))
    assert restored.view("n1")["models"] == ["Qwen/Qwen2.5-7B", "lora-a"]


def test_model_ids_of_an_unknown_node_or_not_a_list_are_rejected() -> None:
    feed = warm_pool("n1")
    assert rejections(feed.send(sj.metrics_models("ghost"), {"models": ["m"]}))[0].startswith("unknown node")
    assert "Expected `array`" in rejections(feed.send(sj.metrics_models("n1"), {"models": "m"}))[0]
    assert "length >= 1" in rejections(feed.send(sj.metrics_models("n1"), {"models": [""]}))[0]


def _refusal(cause: str = "unknown_model", status: int = 404) -> dict[str, object]:
    return {"request_id": "p1-b1-7", "proxy": "p1", "status": status, "cause": cause, "model": "nope",
            "error": "The model `nope` does not exist", "boot_id": "b1"}


def test_a_refusal_changes_nothing_alone_or_in_a_batch() -> None:
    feed = warm_pool("n1")
    before = feed.checkpoint()
    assert feed.send(sj.req_refused("p1"), _refusal()) == []
    batch = batch_payload("b1", 1, [batch_item("req.refused", None, json.dumps(_refusal()).encode()),
                                    batch_item("req.refused", None, json.dumps(_refusal("no_snapshot", 503)).encode())])
    assert feed.send(sj.req_batch("p1"), batch) == []
    after = feed.scheduler.state
    assert (after.nodes, after.open_requests, after.proxies) == (
        type(feed.scheduler).restore(before).state.nodes, {}, type(feed.scheduler).restore(before).state.proxies)


def test_a_refusal_with_an_unknown_cause_is_rejected() -> None:
    feed = warm_pool("n1")
    assert "Invalid enum value 'exploded'" in rejections(feed.send(sj.req_refused("p1"), _refusal("exploded")))[0]


def test_engine_errors_never_eject_a_node_and_5xx_still_do() -> None:
    feed = warm_pool("n1", "n2", "n3")
    threshold = feed.scheduler.config.consecutive_failures
    for _ in range(threshold * 3):  # a client sending bad requests: every one answered 4xx
        feed.finish("n1", feed.start("n1"), outcome="engine_error")
    assert feed.phase("n1") == "active" and feed.node("n1").consecutive_failures == 0
    for _ in range(threshold - 1):
        feed.finish("n1", feed.start("n1"), outcome="upstream_error")
    feed.finish("n1", feed.start("n1"), outcome="engine_error")  # the engine answered: the run of 5xx ends
    assert feed.node("n1").consecutive_failures == 0
    for _ in range(threshold):
        feed.finish("n1", feed.start("n1"), outcome="upstream_error")
    assert feed.phase("n1") == "ejected"


def test_every_refusal_cause_has_one_answer_and_old_words_still_read() -> None:
    from laswrr.schemas.events import RequestRefused
    from laswrr.schemas.refusals import ANSWERS
    from laswrr.schemas.words import RefusalCause

    assert set(ANSWERS) == set(RefusalCause)
    # the log's word is the code clients get for the three that differed (CHANGELOG.md)
    for cause in (RefusalCause.INVALID_JSON, RefusalCause.REQUEST_TOO_LARGE, RefusalCause.INVALID_HEADER):
        assert ANSWERS[cause].code == cause.value
    for old, new in (("bad_json", "invalid_json"), ("body_too_large", "request_too_large"),
                     ("bad_flow_header", "invalid_header")):
        event = msgspec.json.decode(msgspec.json.encode({"request_id": "r", "proxy": "p", "status": 400, "cause": old,
                                                         "error": "x"}), type=RequestRefused)
        assert event.cause is RefusalCause(new)