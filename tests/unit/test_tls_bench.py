"""The summary of ``tierflow bench --tls`` (``launch/tls_bench.py``): the increment of mTLS over
plaintext at p50 and p99, with bootstrap intervals. The stacks themselves run in the bench."""

from __future__ import annotations

import random

import pytest

from launch.tls_bench import summarise


def test_the_increment_is_the_difference_of_the_percentiles_and_its_interval_holds_it():
    rng = random.Random(0)
    plain = [20.0 + rng.random() for _ in range(400)]
    mtls = [x + 1.5 for x in plain]  # exactly 1.5 ms slower, request for request
    result = summarise({"mtls": mtls, "plaintext": plain})
    assert result["mtls"]["n"] == result["plaintext"]["n"] == 400
    p50 = result["increment_p50_ms"]
    assert p50["value"] == pytest.approx(1.5)
    low, high = p50["ci95"]
    assert low < 1.5 < high and high - low < 0.5
    assert result["increment_p99_ms"]["value"] == pytest.approx(1.5)


def test_no_increment_when_the_samples_are_alike():
    rng = random.Random(1)
    samples = {mode: [20.0 + rng.random() for _ in range(400)] for mode in ("mtls", "plaintext")}
    low, high = summarise(samples)["increment_p50_ms"]["ci95"]
    assert low < 0 < high
