"""The chat workload of the cache scenarios (bench/conversations.py) and the pure parts around it:
shared system prompts, turns that extend the previous turn's messages, the second proxy's share,
the request body it becomes, the engine flags the real bench derives from a scenario, and the
prefix-cache counters of an engine restarted during a run."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from laswrr.bench.cli import bench_workload
from laswrr.bench.conversations import WORDS, ChatSpec, generate_chat
from laswrr.bench.load import request_body
from laswrr.bench.real_bench import engine_groups, engine_options, real_scenario_names
from laswrr.bench.runner import counter_deltas
from laswrr.bench.scenarios import REAL_CACHE, REAL_CACHE_PLAIN, REAL_SCENARIOS

SPEC = ChatSpec(duration_s=120.0, second_entry_share=0.3)


def test_same_seed_same_requests_other_seed_other() -> None:
    assert generate_chat(SPEC, 1) == generate_chat(SPEC, 1)
    assert generate_chat(SPEC, 1) != generate_chat(SPEC, 2)


def test_every_turn_resends_the_previous_turn_of_its_conversation() -> None:
    requests = generate_chat(SPEC, 3)
    assert [r.index for r in requests] == list(range(len(requests)))
    assert [r.offset_s for r in requests] == sorted(r.offset_s for r in requests)
    assert all(0 <= r.offset_s < SPEC.duration_s for r in requests)
    by_history = {r.messages: r for r in requests}
    later = [r for r in requests if len(r.messages) > 2]
    assert later, "some conversations have a second turn"
    for r in later:
        roles = [role for role, _ in r.messages]
        assert roles == ["system"] + ["user", "assistant"] * ((len(roles) - 2) // 2) + ["user"]
        previous = by_history.get(r.messages[:-2])  # this turn without the last answer and question
        if previous is not None:  # the previous turn was sent (not after the end of the run)
            assert previous.offset_s + SPEC.think_min_s <= r.offset_s
    turns = Counter(len(r.messages) // 2 for r in requests)
    assert set(turns) <= set(range(1, SPEC.turns_max + 1)) and turns[1] > turns[SPEC.turns_max]


def test_conversations_share_few_system_prompts_and_nothing_else() -> None:
    requests = generate_chat(SPEC, 4)
    systems = {r.messages[0] for r in requests}
    assert len(systems) == SPEC.system_prompts
    assert all(role == "system" and len(text.split()) == SPEC.system_words for role, text in systems)
    first_questions = [r.messages[1] for r in requests if len(r.messages) == 2]
    assert len(set(first_questions)) == len(first_questions)  # conversations share only their system prompt
    assert all(word in WORDS for r in requests for _, text in r.messages for word in text.split())
    assert all(r.max_tokens == SPEC.max_tokens and r.cancel_after_s is None for r in requests)


def test_a_share_of_the_requests_enters_through_the_second_proxy() -> None:
    requests = generate_chat(replace(SPEC, duration_s=600.0), 5)
    second = sum(r.entry == 1 for r in requests) / len(requests)
    assert {r.entry for r in requests} == {0, 1} and 0.25 < second < 0.35
    assert {r.entry for r in generate_chat(replace(SPEC, second_entry_share=0.0), 5)} == {0}


def test_the_request_body_sends_the_conversation() -> None:
    spec = generate_chat(SPEC, 6)[-1]
    body = request_body(spec, "tiny-llama")
    assert body["messages"] == [{"role": role, "content": text} for role, text in spec.messages]
    assert body["max_tokens"] == SPEC.max_tokens and body["model"] == "tiny-llama"


def test_bad_specs_are_refused() -> None:
    for bad in (replace(SPEC, turns_min=3, turns_max=2), replace(SPEC, system_prompts=0),
                replace(SPEC, second_entry_share=1.5), replace(SPEC, think_s=0.0)):
        with pytest.raises(ValueError):
            generate_chat(bad, 1)


def test_the_cache_scenarios_share_their_workload_and_engines() -> None:
    _, events = bench_workload(REAL_CACHE, 1)
    _, plain = bench_workload(REAL_CACHE_PLAIN, 1)
    assert events == plain and any(r.entry == 1 for r in events)
    assert REAL_CACHE.proxies == 2 and REAL_CACHE_PLAIN.proxies == 1
    assert [a.kind for a in REAL_CACHE.actions] == ["restart"] and not REAL_CACHE_PLAIN.actions
    assert engine_options(REAL_CACHE) == engine_options(REAL_CACHE_PLAIN) == {"num_blocks": 28, "kv_events": True}
    groups = engine_groups(["heterogeneous", "cache", "announced-drop", "cache-plain"])
    assert [names for _, names in groups] == [["heterogeneous", "announced-drop"], ["cache", "cache-plain"]]
    assert engine_options(REAL_SCENARIOS["heterogeneous"]) == {"num_blocks": None, "kv_events": False}


def test_a_restarted_engine_keeps_what_it_counted_before_its_restart() -> None:
    before = {"a": (100.0, 40.0), "b": (10.0, 0.0)}
    after = {"a": (30.0, 5.0), "b": (60.0, 20.0)}  # a restarted: its counters began again from 0
    deltas = counter_deltas(before, after, {"a": (150.0, 70.0)})
    assert deltas == {"a": {"queried_tokens": 80.0, "hit_tokens": 35.0},
                      "b": {"queried_tokens": 50.0, "hit_tokens": 20.0}}
    assert counter_deltas(before, after)["b"] == deltas["b"]


def test_the_real_bench_takes_a_list_of_scenarios() -> None:
    assert real_scenario_names("cache,cache-plain") == ["cache", "cache-plain"]
    assert real_scenario_names("all") == list(REAL_SCENARIOS)
    with pytest.raises(ValueError, match="not 'cache,nope'"):
        real_scenario_names("cache,nope")


def test_the_summary_states_the_chat_workload() -> None:
    from laswrr.bench.report import scenario_summary

    summary = scenario_summary(REAL_CACHE, [], 1, 1.0)
    assert summary["workload"]["chat"]["duration_s"] == REAL_CACHE.duration_s
    assert summary["workload"]["chat"]["second_entry_share"] == 0.3
