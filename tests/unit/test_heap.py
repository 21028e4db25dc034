"""``tierflow.heap``: a serving process keeps its startup heap out of garbage collections."""

import gc
import weakref

from prometheus_client import CollectorRegistry

from tierflow.heap import freeze_startup_heap, time_collections


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_startup_heap_is_out_of_collections_and_later_garbage_is_not():
    startup = _Cycle()
    frozen_ref = weakref.ref(startup)
    try:
        assert freeze_startup_heap() == gc.get_freeze_count() > 0
        del startup
        gc.collect()
        assert frozen_ref() is not None  # frozen: no collection walks it
        later = weakref.ref(_Cycle())  # garbage made after the freeze is still collected
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_ref() is None


def test_every_collection_is_timed_by_generation():
    registry = CollectorRegistry()
    callback = time_collections(registry, "primary")
    try:
        gc.collect()  # a full collection: the oldest generation
        gc.collect(0)
    finally:
        gc.callbacks.remove(callback)
    gc.collect()  # no longer timed

    def count(generation: str) -> float:
        labels = {"deployment": "primary", "generation": generation}
        return registry.get_sample_value("tierflow_gc_pause_seconds_count", labels) or 0.0

    assert count("2") >= 1 and count("0") >= 1
    total = registry.get_sample_value(
        "tierflow_gc_pause_seconds_sum", {"deployment": "primary", "generation": "2"}
    )
    assert total > 0
