"""`tierflow calibrate`: fit the scheduler's prefill-time predictor on this model and device.

Times whole prefills of several prompt lengths with the engine as the scheduler will run it
(same chunk size) and fits ``PrefillTimePredictor`` (a*(L-d) + b*(L^2-d^2) + c) to them. The
queue service and the policy benchmark load the written JSON; the scheduler keeps refitting it
from live measurements afterwards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from queue_service.scheduler import PredictionErrors, PrefillSample, PrefillTimePredictor
from worker.engine import PrefillEngine, RunStatus
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest

DEFAULT_LENGTHS = (16, 32, 64, 128, 512, 1024, 2048, 3072, 4096)


def measure_prefills(
    engine: PrefillEngine,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    *,
    repeats: int = 2,
    seed: int = 0,
    on_sample: Callable[[], None] = lambda: None,
) -> list[PrefillSample]:
    rng = random.Random(seed)
    limit = engine.max_positions - 1
    lengths = tuple(n for n in lengths if n <= limit) or (limit,)
    for n in (64, min(1024, limit)):  # warm-up: first calls allocate and pick kernels
        warm = tuple(rng.randrange(3, engine.vocab_size) for _ in range(n))
        engine.run(engine.new_task(GenerationRequest("warm", warm)), PreemptionChannel())
    samples = []
    for _ in range(repeats):
        for n in lengths:
            ids = tuple(rng.randrange(3, engine.vocab_size) for _ in range(n))
            task = engine.new_task(GenerationRequest(f"cal-{n}", ids))
            start = time.perf_counter()
            assert engine.run(task, PreemptionChannel()).status is RunStatus.FINISHED
            samples.append(PrefillSample(n, 0, time.perf_counter() - start))
            on_sample()
    return samples


def calibrate(engine: PrefillEngine, **kwargs) -> PrefillTimePredictor:
    samples = measure_prefills(engine, **kwargs)
    return PrefillTimePredictor().fit(samples)


def holdout_error(samples: list[PrefillSample]) -> dict:
    """The predictor's relative error on samples it was not fitted on: fit on the first half
    of the measurements (one pass over the lengths), predict the second."""
    half = len(samples) // 2
    predictor = PrefillTimePredictor().fit(samples[:half])
    errors = PredictionErrors(min_samples=1)
    for s in samples[half:]:
        errors.observe(predictor.predict(s.prompt_tokens, s.tokens_done), s.seconds)
    return errors.summary()


def calibrate_and_report(engine: PrefillEngine, **kwargs) -> tuple[PrefillTimePredictor, dict]:
    """The predictor fitted on every measurement, and its held-out error."""
    samples = measure_prefills(engine, **kwargs)
    return PrefillTimePredictor().fit(samples), holdout_error(samples)
