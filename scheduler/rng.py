"""Seeded randomness owned by the caller: SplitMix64 (Steele, Lea, Flood 2014).

The core never reaches for ambient randomness; a policy that needs to break ties or sample
two nodes gets an ``Rng`` whose whole state is one integer, so every decision is reproducible
from the seed and the sequence of calls.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


class Rng:
    __slots__ = ("state",)

    def __init__(self, seed: int = 0) -> None:
        self.state = seed & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform in [0, n) (n > 0); the modulo bias is below 2^-50 for any pool size."""
        return self.next_u64() % n
