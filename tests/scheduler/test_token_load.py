"""Token-aware occupancy: a request that carries its size (lb.req.started prompt_tokens and
max_tokens) weighs its tokens against the pool's mean in flight; without sizes the core counts
requests (each request counts one)."""

from __future__ import annotations

from sched_feed import idle_pool, rejections

from laswrr.schemas import subjects as sj


def test_one_long_prompt_weighs_its_tokens_not_one_request() -> None:
    # n1: one request of 100k + 900 tokens; n2: four of 100 + 900. Pool mean = 104 900 / 5 = 20 980,
    # so n1 holds 100 900 / 20 980 = 4.81 requests' worth, n2 4 000 / 20 980 = 0.19.
    feed = idle_pool("n1", "n2")
    feed.start("n1", prompt_tokens=100_000, max_tokens=900)
    for _ in range(4):
        feed.start("n2", prompt_tokens=100, max_tokens=900)
    feed.tick()
    assert feed.view("n1")["load"]["running"] == round(100_900 / 20_980 / 10, 3) == 0.481
    assert feed.view("n2")["load"]["running"] == round(4_000 / 20_980 / 10, 3) == 0.019
    assert feed.view("n1")["target_weight"] < feed.view("n2")["target_weight"]
    assert (feed.view("n1")["inflight"], feed.view("n2")["inflight"]) == (1, 4)  # counts stay counts


def test_equal_sizes_count_as_requests() -> None:
    sized, plain = idle_pool("n1", "n2"), idle_pool("n1", "n2")
    for _ in range(3):
        sized.start("n1", prompt_tokens=500, max_tokens=100)
        plain.start("n1")
    sized.start("n2", prompt_tokens=500, max_tokens=100)
    plain.start("n2")
    sized.tick()
    plain.tick()
    assert sized.snap()["nodes"] == plain.snap()["nodes"]


def test_finish_and_proxy_expiry_release_the_tokens() -> None:
    feed = idle_pool("n1", "n2")
    rid = feed.start("n1", prompt_tokens=1000)
    feed.start("n1", proxy="p2", prompt_tokens=3000, max_tokens=10)
    feed.start("n2", prompt_tokens=50)
    assert (feed.node("n1").sized_inflight, feed.node("n1").inflight_tokens) == (2, 4010)
    feed.finish("n1", rid)
    assert (feed.node("n1").sized_inflight, feed.node("n1").inflight_tokens) == (1, 3010)
    feed.send(sj.proxy_stopped("p2"), {})
    assert (feed.node("n1").inflight, feed.node("n1").sized_inflight, feed.node("n1").inflight_tokens) == (0, 0, 0)


def test_unsized_and_sized_requests_mix() -> None:
    # n1: two unsized (one each) + one of 300 tokens against a pool mean of (300 + 100) / 2 = 200
    feed = idle_pool("n1", "n2")
    feed.start("n1")
    feed.start("n1")
    feed.start("n1", prompt_tokens=300)
    feed.start("n2", prompt_tokens=100)
    feed.tick()
    assert feed.view("n1")["load"]["running"] == round((2 + 300 / 200) / 10, 3)
    assert feed.view("n2")["load"]["running"] == round((100 / 200) / 10, 3)


def test_bad_sizes_are_rejected() -> None:
    feed = idle_pool("n1")
    outputs = feed.send(sj.req_started("n1"), {"request_id": "x", "proxy": "p1", "prompt_tokens": -5})
    assert rejections(outputs) and feed.node("n1").inflight == 0
