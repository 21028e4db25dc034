"""A worker's Prometheus metrics (served with ``--metrics-port``), labelled ``deployment`` and
``worker``:

* ``tierflow_engine_busy_seconds_total``: engine time spent running a request; its ``rate()`` is
  the engine's busy fraction (also sampled as ``tierflow_engine_busy_fraction`` over the last
  window);
* ``tierflow_batch_size``: requests in the engine's current step (an unbatched engine runs one
  request at a time: 0 or 1; a batched one, its prefill plus its decode batch),
  ``tierflow_worker_requests_held``: assigned and not finished (running, queued or suspended);
* ``tierflow_layer_seconds``: the time of one decoder layer over one chunk, from the engine's
  per-layer progress reports;
* ``tierflow_worker_suspended_bytes``: what suspended requests hold on this worker;
* ``tierflow_decode_step_rows``: the rows (requests) of each decode step of a batched engine,
  counted as each step ends (how full the batch runs; not sampled).

A thread of its own reads the runner's busy total (``worker.busy_clock``: the runner times every
run, so a run shorter than the sampling period counts too) and its tables every ``SAMPLE_S``:
nothing is added to the engine's layer loop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierflow.metrics import DEPLOYMENT_LABEL
from worker.events import (
    Cancelled,
    DecodeStepDone,
    Failed,
    Finished,
    Preempted,
    Progress,
    RunnerEvent,
)

SAMPLE_S = 0.05
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_LAYER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LABELS = [DEPLOYMENT_LABEL, "worker"]


class WorkerMetrics:
    def __init__(self, deployment: str, worker_id: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = (deployment, worker_id)
        self.busy_s = Counter(
            "tierflow_engine_busy_seconds", "Engine time spent on requests", _LABELS, registry=r
        ).labels(*labels)
        self.busy_fraction = Gauge(
            "tierflow_engine_busy_fraction", "Share of the last second the engine was busy",
            _LABELS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.batch_size = Gauge(
            "tierflow_batch_size", "Requests in the engine's current step", _LABELS, registry=r
        ).labels(*labels)
        self.held = Gauge(
            "tierflow_worker_requests_held", "Requests assigned and not finished",
            _LABELS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.layer_s = Histogram(
            "tierflow_layer_seconds", "One decoder layer over one chunk",
            _LABELS, buckets=_LAYER_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.suspended = Gauge(
            "tierflow_worker_suspended_bytes", "Bytes held by suspended requests",
            _LABELS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.decode_rows = Histogram(
            "tierflow_decode_step_rows", "Rows in one decode step of a batched engine",
            _LABELS, buckets=_ROW_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self._last_layer: dict[str, Progress] = {}  # engine thread only
        self._stop = threading.Event()

    def observe(self, event: RunnerEvent) -> None:
        """Called on the engine thread for each event."""
        if isinstance(event, DecodeStepDone):
            self.decode_rows.observe(len(event.request_ids))
            return
        rid = event.request_id
        if isinstance(event, Progress) and event.layers_done > 0:
            prev = self._last_layer.get(rid)
            if (
                prev is not None
                and prev.chunk_end == event.chunk_end
                and prev.layers_done == event.layers_done - 1
            ):
                self.layer_s.observe(event.at - prev.at)
            self._last_layer[rid] = event
        elif isinstance(event, Preempted | Finished | Cancelled | Failed | Progress):
            # A chunk end, a stop or an end: the next layer report starts a new interval.
            self._last_layer.pop(rid, None)

    def start_sampling(
        self,
        running: Callable[[], str | None],
        busy_seconds: Callable[[], float],
        suspended_bytes: Callable[[], int],
        held: Callable[[], int],
        window_s: float = 1.0,
        decoding: Callable[[], int] = lambda: 0,
    ) -> None:
        """Sample every ``SAMPLE_S`` on a thread of its own (see ``sampler``)."""
        sample = self.sampler(running, busy_seconds, suspended_bytes, held, window_s, decoding)

        def loop() -> None:
            while not self._stop.wait(SAMPLE_S):
                sample()

        threading.Thread(target=loop, name="worker-metrics", daemon=True).start()

    def sampler(
        self,
        running: Callable[[], str | None],
        busy_seconds: Callable[[], float],
        suspended_bytes: Callable[[], int],
        held: Callable[[], int],
        window_s: float = 1.0,
        decoding: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> Callable[[], None]:
        """One sample per call. ``busy_seconds``: the runner's engine time so far
        (``worker.busy_clock``); ``decoding``: rows of the engine's decode batch;
        ``clock``: a parameter so that a test can drive the samples without sleeping."""
        # (when, busy seconds) over the last window, oldest first.
        span = max(2, round(window_s / SAMPLE_S) + 1)
        readings = deque([(clock(), busy_seconds())], maxlen=span)

        def sample() -> None:
            last_busy = readings[-1][1]
            busy = max(busy_seconds(), last_busy)  # a counter never goes back
            self.busy_s.inc(busy - last_busy)
            readings.append((clock(), busy))
            (t0, b0), (t1, b1) = readings[0], readings[-1]
            self.busy_fraction.set(min(1.0, (b1 - b0) / (t1 - t0)))
            self.batch_size.set(int(running() is not None) + decoding())
            self.held.set(held())
            # RuntimeError: the engine changed its table mid-read; the next sample reads it.
            with contextlib.suppress(RuntimeError):
                self.suspended.set(suspended_bytes())

        return sample

    def stop(self) -> None:
        self._stop.set()
