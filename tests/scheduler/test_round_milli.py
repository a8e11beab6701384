"""``weights.round_milli`` is ``round(x, 3)`` without most of its cost: it must give the very same
float (bits, sign of a zero) or int for every input, including the values next to a half, where
its float arithmetic could go the other way (it hands those to ``round``)."""

from __future__ import annotations

import math
import random
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.scheduler.weights import round_milli


def _same(value: float) -> None:
    expected, got = round(value, 3), round_milli(value)
    assert type(got) is type(expected), value
    if isinstance(expected, float):
        assert struct.pack("<d", got) == struct.pack("<d", expected) or (math.isnan(got) and math.isnan(expected)), value
    else:
        assert got == expected, value


@settings(max_examples=3000)
@given(st.one_of(st.floats(), st.floats(-5_000, 5_000), st.floats(0, 1), st.integers(-10**6, 10**6)))
def test_round_milli_is_round_to_3_digits(value: float) -> None:
    _same(value)


def test_the_edges() -> None:
    for value in (0.0, -0.0, 0.0625, -0.0625, 0.0005, -0.0004999, 2.5e-324, 1e9, 1e9 - 0.0001, 1e12 / 1000 + 0.1,
                  math.inf, -math.inf, math.nan, 1e308, True, 0, -3):
        _same(value)




def test_the_values_next_to_every_half_thousandth() -> None:
    """Each tie k + 0.5 thousandths, and the floats a few steps on either side of it."""
    for k in range(-20_000, 20_000):
        tie = (k + 0.5) / 1000
        for value in (tie, math.nextafter(tie, 0), math.nextafter(tie, math.inf), math.nextafter(tie, -math.inf)):
            _same(value)
            for steps in range(4):
                value = math.nextafter(value, math.inf)
                _same(value)


def test_a_million_random_signals_and_weights() -> None:
    rng = random.Random(7)
    for _ in range(500_000):
        _same(rng.random())
        _same(rng.uniform(0, 4096))
    for _ in range(100_000):
        _same(rng.randint(0, 4_096_000) / 1000 + rng.choice([0.0, 1e-9, -1e-9, 5e-4, -5e-4]))
