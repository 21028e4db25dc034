"""The benchmark's timeline records the process's long garbage collections, and the misses
report counts them in a request's wait; a run keeps its startup heap out of collections."""

from __future__ import annotations

import gc
import time

from bench.event_log import EventLog, read
from bench.misses import waits
from tierflow.heap import frozen_heap, watch_collections


def test_a_long_collection_is_logged_and_counted_in_the_waits_it_falls_in(tmp_path):
    log = EventLog(tmp_path / "run.jsonl")
    try:
        start = time.perf_counter()
        log.arrival("c1", "critical", 50, due_at=start)
        log._on_collection(2, 0.005)
        log._on_collection(0, 0.0002)  # a young, short one: not logged
        log._write("event", event="FirstToken", request_id="c1", at=time.perf_counter(),
                   prefill_busy_s=0.001)  # fmt: skip
    finally:
        log.close()
    records = read(tmp_path / "run.jsonl")
    collections = [r for r in records if r["kind"] == "gc"]
    assert [c["generation"] for c in collections] == [2]
    assert collections[0]["seconds"] >= 0.005
    (wait,) = waits(records, "critical")
    assert wait.gc_s == collections[0]["seconds"]
    assert log._watch not in gc.callbacks  # closed: no longer called


def test_every_collection_is_reported_with_its_generation_and_time():
    pauses: list[tuple[int, float]] = []
    watch = watch_collections(lambda generation, seconds: pauses.append((generation, seconds)))
    try:
        gc.collect(1)
    finally:
        gc.callbacks.remove(watch)
    assert pauses and pauses[-1][0] == 1 and pauses[-1][1] >= 0
    seen = len(pauses)
    gc.collect(1)
    assert len(pauses) == seen  # removed: no longer called


def test_a_run_keeps_the_heap_it_started_with_out_of_collections_and_gives_it_back():
    assert gc.get_freeze_count() == 0
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0
