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
measures it).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then keep every object alive now out of all later collections. Call it
    when the process has loaded what it keeps (modules, model, tokenizer), before it serves.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
