"""CPU steal: the share between two readings, the sampler, and the mean over a wait."""

import threading
import time
from collections import namedtuple

import pytest

from bench.cpu_steal import StealSampler, mean_over, steal_share


def test_cpu_steal_is_the_stolen_share_of_all_cpu_time_between_two_readings():
    Times = namedtuple("Times", "user system idle steal")
    assert steal_share(Times(10, 5, 80, 5), Times(40, 10, 130, 25)) == pytest.approx(20 / 105)
    NoSteal = namedtuple("NoSteal", "user idle")  # a platform that does not report it
    assert steal_share(NoSteal(1, 1), NoSteal(2, 3)) == 0.0


def test_the_mean_over_a_wait_weights_each_sample_by_its_overlap():
    samples = [(1.0, 1.0, 0.0), (2.0, 1.0, 0.4), (3.0, 1.0, 0.1)]  # (ended at, seconds, share)
    assert mean_over(samples, 1.5, 2.0) == pytest.approx(0.4)  # inside the second one
    # 0.5 s of the second (40 %) and 0.25 s of the third (10 %)
    assert mean_over(samples, 1.5, 2.25) == pytest.approx((0.5 * 0.4 + 0.25 * 0.1) / 0.75)
    assert mean_over(samples, 3.5, 4.0) is None  # after the last sample
    assert mean_over([], 0.0, 1.0) is None


def test_the_sampler_records_a_share_each_interval_until_stopped():
    got: list[tuple[float, float]] = []
    three = threading.Event()

    def record(share: float, seconds: float) -> None:
        got.append((share, seconds))
        if len(got) >= 3:
            three.set()

    sampler = StealSampler(record, interval_s=0.01)
    assert three.wait(timeout=30)
    sampler.stop()
    count = len(got)
    time.sleep(0.05)  # five intervals more
    assert len(got) == count  # nothing after stop
    assert all(0.0 <= share <= 1.0 and seconds >= 0.01 for share, seconds in got)
