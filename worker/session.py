"""One control stream (``WorkerControl.Attach``) of the worker: what it sends, and its call.

Messages to the queue service are queued here from any thread (the engine thread's events, the
heartbeat thread, the control thread) and drained by the stream's request iterator, which gRPC
runs on its own thread. ``Hello`` is queued first, before anything else can be.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from queue import SimpleQueue
from typing import Any

from tierflow.v1 import worker_pb2

# After a drain the worker half-closes its side and waits for the queue service to end the
# stream; a queue service that never does is cut off after this long.
DRAIN_CLOSE_GRACE_S = 5.0


class Session:
    """One Attach stream: the outgoing queue its request iterator drains, and the call."""

    def __init__(self, hello: worker_pb2.WorkerMessage) -> None:
        self._out: SimpleQueue[worker_pb2.WorkerMessage | None] = SimpleQueue()
        self._out.put(hello)  # queued before anything else can be: Hello is always first
        self._lock = threading.Lock()
        self._half_closed = False
        self._drain_timer: threading.Timer | None = None
        self.ended = threading.Event()
        self.call: Any = None  # grpc's stream-stream call: an iterator with cancel()
        self.started = time.monotonic()
        self.received = 0

    def outgoing(self) -> Iterator[worker_pb2.WorkerMessage]:
        while (message := self._out.get()) is not None:
            yield message

    def send(self, message: worker_pb2.WorkerMessage) -> None:
        with self._lock:
            if not self._half_closed:
                self._out.put(message)

    def close_after_drain(self) -> None:
        """Half-close once everything queued is sent; cut the call if it is not ended soon."""
        with self._lock:
            if self._half_closed:
                return
            self._half_closed = True
            self._out.put(None)
            self._drain_timer = threading.Timer(DRAIN_CLOSE_GRACE_S, self.cancel)
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def end(self) -> None:
        self.ended.set()
        with self._lock:
            self._half_closed = True
            if self._drain_timer is not None:
                self._drain_timer.cancel()
        # Releases gRPC's thread blocked in ``outgoing`` (it reads until the iterator ends).
        self._out.put(None)
