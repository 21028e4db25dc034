"""The garbage collector in a process that serves: keep its startup heap out of collections.

A full collection walks every object the collector tracks, and CPython runs one whenever
enough objects have survived the younger collections. After its imports and model load a
worker tracks about 430,000 objects (torch, transformers, the model's modules) and a full
collection takes about 200 ms on the development machine; a queue service tracks about 63,000,
20 ms. In a worker that stalls the engine between two interruption points, eight times the
preemption budget; in a queue service, every decision and stream behind it. Those objects live
as long as the process anyway, so once started each process moves them into the permanent
generation (``gc.freeze``), which no collection walks: later collections walk only what was
created since (a scheduler holding 256 live requests: 0.2 ms; ``tierflow bench --scale``
measures it). Each process also times its collections (``time_collections``:
``tierflow_gc_pause_seconds{generation}``), so a pause that remains shows.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram

from tierflow.metrics import DEPLOYMENT_LABEL

_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


def freeze_startup_heap() -> int:
    """Collect once, then keep every object alive now out of all later collections. Call it
    when the process has loaded what it keeps (modules, model, tokenizer), before it serves.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """``freeze_startup_heap`` for a stretch of a process that serves for a while and then
    goes on (a benchmark's run; a test's): the heap is unfrozen after it, so the caller's
    process keeps its own collections. Yields how many objects are frozen."""
    try:
        yield freeze_startup_heap()
    finally:
        gc.unfreeze()


def time_collections(registry: CollectorRegistry, deployment: str) -> Callable[[str, dict], None]:
    """From now on, time every garbage collection of this process, by generation, in
    ``tierflow_gc_pause_seconds`` on ``registry``. Returns the callback (``gc.callbacks``)."""
    pauses = Histogram(
        "tierflow_gc_pause_seconds", "Garbage collections of this process, by generation",
        [DEPLOYMENT_LABEL, "generation"], buckets=_PAUSE_BUCKETS, registry=registry,
    )  # fmt: skip
    return watch_collections(
        lambda generation, seconds: pauses.labels(deployment, str(generation)).observe(seconds)
    )


def watch_collections(on_pause: Callable[[int, float], None]) -> Callable[[str, dict], None]:
    """From now on, call ``on_pause(generation, seconds)`` after every garbage collection of
    this process, in the thread that ran it. Returns the callback: remove it from
    ``gc.callbacks`` to stop."""
    started = [0.0]  # a collection never overlaps another: one start time suffices

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            on_pause(info["generation"], time.perf_counter() - started[0])

    gc.callbacks.append(on_collection)
    return on_collection
