"""The soak's memory verdict: a robust slope (Theil-Sen) and its interval, not one comparison:
noise and spikes around a flat line pass, a steady leak fails, whatever its size."""

from __future__ import annotations

import random

from launch.soak import SoakConfig, trend

MB = 1024 * 1024


def series(slope_mb_per_min: float, *, noise_mb: float, spikes: int = 0, seed: int = 0):
    rng = random.Random(seed)
    points = []
    for i in range(600):  # 10 minutes, one sample a second
        value = 300 * MB + slope_mb_per_min * MB * i / 60 + rng.gauss(0, noise_mb * MB)
        points.append((float(i), value))
    for i in rng.sample(range(600), spikes):  # a GC pause, a long prompt: big, brief
        points[i] = (points[i][0], points[i][1] + 80 * MB)
    return points


def test_a_flat_noisy_series_with_spikes_is_not_growing():
    t = trend("worker-0 rss", series(0.0, noise_mb=3, spikes=30), SoakConfig())
    assert not t.growing and t.low_per_min <= t.tolerance_per_min


def test_a_steady_leak_is_growing_even_under_noise():
    t = trend("worker-0 rss", series(8.0, noise_mb=3, spikes=30), SoakConfig())
    assert t.growing and 6 * MB < t.slope_per_min < 10 * MB


def test_a_one_time_step_up_after_warm_up_is_not_a_leak():
    points = series(0.0, noise_mb=1)
    points = [(t, v + (40 * MB if t > 30 else 0)) for t, v in points]  # caches filled at 30 s
    assert not trend("queue-service rss", points, SoakConfig()).growing


def test_suspended_bytes_that_pile_up_are_growing():
    points = [(float(i), float(i * 200_000)) for i in range(120)]
    assert trend("suspended bytes", points, SoakConfig()).growing
    assert not trend("suspended bytes", [(float(i), 0.0) for i in range(120)], SoakConfig()).growing
