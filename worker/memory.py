"""Accounting for the memory that suspended tasks hold, with a hard cap.

A preempted task keeps its KV cache and partial activations so it can resume without
recomputation. That memory is not free: the engine registers each suspended task's bytes here
and, when a preemption would push the total over the cap, drops the task's state instead (the
task then recomputes its prefill from the start, and the caller is told so).
"""

from __future__ import annotations


class SuspendedMemory:
    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._held: dict[str, int] = {}

    @property
    def total_bytes(self) -> int:
        return sum(self._held.values())

    def try_hold(self, task_id: str, nbytes: int) -> bool:
        """Register a suspended task's bytes if they fit under the cap."""
        if self.total_bytes + nbytes > self.cap_bytes:
            return False
        self._held[task_id] = nbytes
        return True

    def try_hold_all(self, held: dict[str, int]) -> bool:
        """Register several tasks' bytes together (a packed prefill), or none of them."""
        if self.total_bytes + sum(held.values()) > self.cap_bytes:
            return False
        self._held.update(held)
        return True

    def release(self, task_id: str) -> None:
        self._held.pop(task_id, None)
