"""``RecentMap``: the last N keys put in, with their values; the oldest falls out first.

The queue service remembers recently finished request ids in three places (the scheduler, the
service core and the Kafka consumer), each so that a request delivered again after it finished
is recognised and not run twice. Memory must stay bounded, and "recently" means "among the last
N finished", so insertion order decides what is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentMap(Generic[K, V]):
    """A mapping of at most ``capacity`` entries in insertion order; putting a key again makes
    it the newest. ``capacity`` 0 remembers nothing."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        if self.capacity == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def add(self, key: K) -> None:
        """Remember ``key`` alone (set-like use: the value is None)."""
        self[key] = None  # type: ignore[assignment]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        """Oldest first."""
        return iter(self._items)

    def items(self) -> Iterator[tuple[K, V]]:
        """(key, value) pairs, oldest first."""
        return iter(self._items.items())

    def newest_first(self) -> Iterator[tuple[K, V]]:
        """(key, value) pairs, the most recently put first."""
        return reversed(self._items.items())
