"""Bounding how far the host runs ahead of the GPU.

On CUDA, kernel launches are asynchronous: the Python layer loop can be several layers ahead of
what the GPU has executed. The preemption flag is read by the host, so without a bound a
preemption observed "at layer i" would still leave every queued layer to run on the GPU, and the
GPU would stay busy long after the engine reported the stop. ``RunAheadLimiter`` records one CUDA
event per layer in a ring and, once more than ``max_layers`` are outstanding, waits for the
oldest. So when the host stops at a boundary, at most ``max_layers`` layers remain on the GPU and
the preemption latency is bounded by about ``max_layers + 1`` layer times, while the GPU never
idles waiting for the host (``max_layers`` >= 1 keeps a layer queued ahead). The events are
created once and reused, so the hot loop allocates nothing. On the CPU every call is a no-op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol


class _Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class RunAheadLimiter:
    def __init__(self, max_layers: int, event_factory: Callable[[], _Event] | None) -> None:
        """``event_factory`` None disables the limiter (CPU: work is synchronous already)."""
        self.enabled = event_factory is not None and max_layers > 0
        self.max_layers = max_layers
        self._free: deque[_Event] = deque()
        self._outstanding: deque[_Event] = deque()
        if self.enabled:
            assert event_factory is not None
            self._free.extend(event_factory() for _ in range(max_layers + 1))

    @classmethod
    def for_device(cls, device: str, max_layers: int) -> RunAheadLimiter:
        if str(device).startswith("cuda"):
            import torch

            return cls(max_layers, lambda: torch.cuda.Event(blocking=False))
        return cls(max_layers, None)

    def layer_done(self) -> None:
        if not self.enabled:
            return
        event = self._free.popleft()
        event.record()
        self._outstanding.append(event)
        if len(self._outstanding) > self.max_layers:
            oldest = self._outstanding.popleft()
            oldest.synchronize()
            self._free.append(oldest)

    def drain(self) -> None:
        """Wait until the GPU has caught up (called when the engine stops or finishes)."""
        while self._outstanding:
            event = self._outstanding.popleft()
            event.synchronize()
            self._free.append(event)
