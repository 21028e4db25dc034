"""The prefill-time predictor: fit, non-negativity, online window, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from queue_service.scheduler import PrefillSample, PrefillTimePredictor


def synthetic(a: float, b: float, c: float, n: int = 60, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        L = int(rng.integers(64, 8192))
        d = int(rng.integers(0, L)) if rng.random() < 0.5 else 0
        t = a * (L - d) + b * (L * L - d * d) + c
        samples.append(PrefillSample(L, d, max(0.0, t * (1 + noise * rng.standard_normal()))))
    return samples


def test_fit_recovers_known_coefficients():
    true = (1.2e-3, 8e-8, 0.03)
    predictor = PrefillTimePredictor().fit(synthetic(*true))
    assert predictor.coefficients == pytest.approx(true, rel=1e-6)
    L, d = 4096, 1024
    expected = true[0] * (L - d) + true[1] * (L * L - d * d) + true[2]
    assert predictor.predict(L, d) == pytest.approx(expected, rel=1e-6)


def test_fit_with_noise_is_close():
    true = (1.2e-3, 8e-8, 0.03)
    predictor = PrefillTimePredictor().fit(synthetic(*true, n=200, noise=0.02))
    assert predictor.predict(4096) == pytest.approx(
        PrefillTimePredictor(*true).predict(4096), rel=0.02
    )


# Median prefill times (ms) of bench-llama on this project's 2-core CPU, `tierflow calibrate`'s
# lengths (2026-12-07): the model's three terms fit them within a few per cent for long
# prompts, but not for every length at once.
MEASURED_MS = {16: 27.7, 32: 28.1, 64: 40.1, 128: 56.1, 256: 102.5, 512: 200.0, 1024: 428.8,
               2048: 1010.8, 3072: 1986.1, 4096: 2950.0}  # fmt: skip


def test_the_fit_weighs_a_short_prompts_error_as_much_as_a_long_ones():
    """Fitted in seconds, the long prompts' samples outweighed the short ones' and a 16-token
    prompt was predicted 20 % short; the top tier's prompts are the short ones."""
    samples = [PrefillSample(n, 0, ms / 1000) for n, ms in MEASURED_MS.items()]
    predictor = PrefillTimePredictor().fit(samples)
    for n, ms in MEASURED_MS.items():
        assert predictor.predict(n) * 1000 == pytest.approx(ms, rel=0.1), n


def test_coefficients_are_clamped_non_negative():
    # Data whose unconstrained fit has a negative quadratic term.
    samples = [PrefillSample(L, 0, 1e-3 * L - 5e-8 * L * L + 0.01) for L in range(256, 8192, 256)]
    predictor = PrefillTimePredictor().fit(samples)
    assert all(c >= 0 for c in predictor.coefficients)
    assert predictor.coefficients[1] == 0.0
    assert predictor.predict(100) >= 0


def test_nothing_left_costs_nothing():
    predictor = PrefillTimePredictor(1e-3, 1e-7, 0.5)
    assert predictor.predict(100, 100) == 0.0
    assert predictor.predict(100, 0) > predictor.predict(100, 50) > 0


def test_observe_keeps_a_bounded_window_and_refits_after_min_samples():
    predictor = PrefillTimePredictor(1e-3, 0.0, 0.0, window=10, min_samples=5)
    slow = synthetic(4e-3, 0.0, 0.0, n=30)
    for sample in slow[:4]:
        predictor.observe(sample)
    assert predictor.coefficients == (1e-3, 0.0, 0.0)  # not enough samples yet
    for sample in slow[4:]:
        predictor.observe(sample)
    assert len(predictor.samples) == 10
    assert predictor.samples == tuple(slow[-10:])
    assert predictor.coefficients[0] == pytest.approx(4e-3, rel=1e-6)


def test_json_round_trip(tmp_path):
    predictor = PrefillTimePredictor(window=50, min_samples=3).fit(synthetic(1e-3, 1e-7, 0.02))
    again = PrefillTimePredictor.from_json(predictor.to_json())
    assert again.coefficients == predictor.coefficients
    assert again.samples == predictor.samples[-50:]
    assert (again.window, again.min_samples) == (50, 3)
    path = tmp_path / "sub" / "predictor.json"
    predictor.save(path)
    loaded = PrefillTimePredictor.load(path)
    assert loaded.coefficients == predictor.coefficients
    assert loaded.predict(3000, 100) == predictor.predict(3000, 100)


def test_the_first_calibration_is_kept_as_the_reference_while_the_refit_follows_the_machine():
    predictor = PrefillTimePredictor(window=10, min_samples=5)
    assert predictor.reference_coefficients is None  # the fallback is no measurement
    for sample in synthetic(1e-3, 0.0, 0.0, n=5):
        predictor.observe(sample)
    for sample in synthetic(4e-3, 0.0, 0.0, n=10):  # the machine slows under load
        predictor.observe(sample)
    assert predictor.coefficients[0] == pytest.approx(4e-3, rel=1e-6)
    assert predictor.reference_coefficients[0] == pytest.approx(1e-3, rel=1e-6)
    again = PrefillTimePredictor.from_json(predictor.to_json())
    assert again.reference_coefficients == predictor.reference_coefficients
    # A file written before references were kept: its calibration is the reference.
    old = json.loads(predictor.to_json())
    del old["reference"]
    assert PrefillTimePredictor.from_json(json.dumps(old)).reference_coefficients == (
        predictor.coefficients
    )


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="format"):
        PrefillTimePredictor.from_json('{"a": 1}')
    with pytest.raises(ValueError, match="version"):
        PrefillTimePredictor.from_json('{"format": "tierflow.prefill_predictor", "version": 99}')
    with pytest.raises(ValueError, match="no samples"):
        PrefillTimePredictor().fit([])
    with pytest.raises(ValueError):
        PrefillTimePredictor(a=-1.0)
    with pytest.raises(ValueError):
        PrefillSample(100, 100, 1.0)
