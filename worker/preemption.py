"""The preemption channel: how the control thread tells the layer loop to stop.

The engine reads ``channel.signal`` at every boundary it is configured to check (every layer,
or between the attention and MLP halves, or only at chunk ends for the chunked baseline). That
read must cost well under a microsecond and do no I/O, no allocation and no device
synchronisation, so the channel is one slotted attribute: an attribute load and an ``is``
comparison, about 20-30 ns in CPython. Writers are other threads (the worker's control-stream
reader, the benchmark's scheduler thread); a single attribute store is atomic under the GIL and
becomes visible to the engine thread at its next read.
"""

from __future__ import annotations

import enum


class Signal(enum.Enum):
    PREEMPT = "preempt"  # stop at the next boundary, keep KV cache and activations
    PREEMPT_DROP = "preempt_drop"  # stop and drop the state: the task recomputes later
    CANCEL = "cancel"  # stop and free everything the task holds


class PreemptionChannel:
    """One per engine thread. ``signal is None`` means "keep going"."""

    __slots__ = ("signal",)

    def __init__(self) -> None:
        self.signal: Signal | None = None

    def preempt(self, *, drop_state: bool = False) -> None:
        self.signal = Signal.PREEMPT_DROP if drop_state else Signal.PREEMPT

    def cancel(self) -> None:
        self.signal = Signal.CANCEL

    def clear(self) -> None:
        self.signal = None

    def __repr__(self) -> str:
        return f"PreemptionChannel(signal={self.signal})"
