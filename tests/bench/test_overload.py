"""The overload scenario's parts: tenants drawn from the seed, max-min fair shares, the per-key summary."""

from __future__ import annotations

from collections import Counter

import pytest

from laswrr.bench.cli import bench_workload, parse_policies
from laswrr.bench.load import keys_file_text, request_headers
from laswrr.bench.metrics import ClientOutcome, RequestResult, max_min_fair, tenant_summary
from laswrr.bench.scenarios import get_scenario
from laswrr.bench.stack_adapter import split_variant
from laswrr.services.proxy.keys import parse_keys


def test_tenants_offer_10_1_1_1_and_the_mix_is_half_interactive() -> None:
    scenario, requests = bench_workload(get_scenario("overload"), seed=1)
    again = bench_workload(get_scenario("overload"), seed=1)[1]
    assert requests == again  # seeded
    tenants = Counter(r.tenant for r in requests)
    assert tenants["batch-job"] / len(requests) == pytest.approx(10 / 13, abs=0.03)
    for light in ("user-interactive", "user-default", "user-mix"):
        assert tenants[light] / len(requests) == pytest.approx(1 / 13, abs=0.02)
    assert {r.priority for r in requests if r.tenant == "batch-job"} == {"batch"}
    assert {r.priority for r in requests if r.tenant == "user-mix"} == {"interactive", "default"}
    headers = request_headers(requests[0])
    assert headers["Authorization"] == f"Bearer bench-{requests[0].tenant}"
    names = [name for name, _ in parse_keys(keys_file_text([t.name for t in scenario.tenants]))]
    assert names == ["batch-job", "user-interactive", "user-default", "user-mix"]


def test_max_min_fair_shares() -> None:
    assert max_min_fair({"h": 10, "a": 1, "b": 1, "c": 1}, 8) == {"h": 5, "a": 1, "b": 1, "c": 1}
    assert max_min_fair({"h": 10, "a": 1, "b": 1, "c": 1}, 2) == {"h": 0.5, "a": 0.5, "b": 0.5, "c": 0.5}
    assert max_min_fair({"h": 10, "a": 1}, 20) == {"h": 10, "a": 1}  # enough for everyone


def _result(i: int, tenant: str, tokens: int, end: float, ttft: float | None = 0.1, status: int = 200,
            priority: str = "batch") -> RequestResult:
    outcome = ClientOutcome.COMPLETED if status == 200 else ClientOutcome.ERROR
    return RequestResult(index=i, start_s=0.0, end_s=end, ttft_s=ttft, e2e_s=end if status == 200 else None,
                         node="n1", outcome=outcome, status=status, tokens=tokens if status == 200 else 0,
                         tenant=tenant, priority=priority, max_tokens=tokens)


def test_tenant_summary_counts_what_completes_inside_the_window() -> None:
    results = [_result(0, "h", 100, 5.0), _result(1, "h", 100, 5.0), _result(2, "h", 100, 15.0),
               _result(3, "h", 100, 5.0, ttft=None, status=429), _result(4, "a", 50, 9.0, priority="interactive")]
    summary = tenant_summary(results, window_s=10.0)
    assert summary["per_key"]["h"] == {"offered_tps": 40.0, "goodput_tps": 20.0, "fair_tps": 20.0, "ratio": 1.0}
    assert summary["per_key"]["a"]["goodput_tps"] == 5.0 and summary["per_key"]["a"]["fair_tps"] == 5.0
    assert summary["total_goodput_tps"] == 25.0 and summary["jain_of_fair_share"] == 1.0
    assert summary["statuses"] == {"200": 4, "429": 1} and summary["answered_5xx"] == 0
    assert summary["per_priority"]["batch"]["answered_429"] == 1


def test_policy_variants() -> None:
    assert split_variant("la-swrr+flow") == ("la-swrr", ("--flow-control",))
    assert split_variant("la-swrr+cap") == ("la-swrr", ("--inflight-cap-per-capacity", "1"))
    assert split_variant("rr") == ("rr", ())
    assert parse_policies("la_swrr+flow,la-swrr") == ["la-swrr+flow", "la-swrr"]
    with pytest.raises(ValueError, match="unknown variant"):
        parse_policies("la-swrr+fast")
