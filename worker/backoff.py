"""The worker's redial schedule after its control stream to the queue service breaks."""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with jitter: min, 2*min, 4*min ... up to max, each drawn from
    [d/2, d] so that workers that lost the same queue service do not redial in lockstep."""

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.max_s, self.min_s * 2 ** min(self._attempt, 32))
        self._attempt += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0
