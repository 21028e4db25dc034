"""Which offset of a partition to commit when requests finish in any order: a pure ledger.

The priority consumer (``queue_service.broker.priority_consumer``) commits a request's offset
only when the request is finished, and requests finish in any order. Per partition, this
ledger tracks the offsets read since the last commit point and which of them are finished;
the commit point is the lowest offset not yet finished, and the commit's metadata lists the
finished offsets above it (as distances), so that a consumer restarting in the same group
skips exactly those (``parse_metadata``). No Kafka here: the unit tests drive it directly.
"""

from __future__ import annotations

from collections import deque

import structlog

log = structlog.get_logger("queue_service.broker.offset_ledger")

# Commit metadata: "tf1:" and the finished offsets above the committed one, as distances from it.
# The broker's default offset.metadata.max.bytes is 4096; offsets that do not fit are left out
# (such requests would be re-delivered after a restart, never lost).
METADATA_PREFIX = "tf1:"
METADATA_MAX_CHARS = 4000


class Ledger:
    """The offsets of one partition read since its last commit point, in order, and which are
    finished: what to commit, and what to skip when the partition is read again."""

    def __init__(self, committed: int | None, prefinished: set[int]) -> None:
        self.offsets: deque[int] = deque()
        self.done: dict[int, bool] = {}
        self.end = committed  # the offset after the last one read (or the committed one)
        self.prefinished = prefinished  # finished before a restart (from the commit metadata)
        self.last_commit: tuple[int, str] | None = None

    def add(self, offset: int, done: bool) -> bool:
        """Track a record just read; False when it is one already tracked or committed."""
        if self.end is not None and offset < self.end:
            return False
        self.offsets.append(offset)
        self.done[offset] = done
        self.end = offset + 1
        return True

    def mark_done(self, offset: int) -> bool:
        if self.done.get(offset) is False:
            self.done[offset] = True
            return True
        return False

    def forget_from(self, offset: int) -> None:
        """The partition was rewound to ``offset``: what was read from there on is read again."""
        while self.offsets and self.offsets[-1] >= offset:
            del self.done[self.offsets.pop()]
        self.end = offset

    def commit_point(self) -> tuple[int, str] | None:
        """(offset to commit, metadata listing the finished offsets above it)."""
        while self.offsets and self.done[self.offsets[0]]:
            del self.done[self.offsets.popleft()]
        if self.offsets:
            watermark = self.offsets[0]
        elif self.end is not None:
            watermark = self.end
        else:
            return None
        self.prefinished = {o for o in self.prefinished if o >= watermark}
        above = [o - watermark for o in self.offsets if self.done[o]]
        metadata = METADATA_PREFIX + ",".join(map(str, above)) if above else ""
        while len(metadata) > METADATA_MAX_CHARS:
            metadata = metadata[: metadata.rindex(",")]
        return watermark, metadata


def parse_metadata(committed: int, metadata: str) -> set[int]:
    if not metadata.startswith(METADATA_PREFIX):
        return set()
    try:
        return {committed + int(d) for d in metadata[len(METADATA_PREFIX) :].split(",") if d}
    except ValueError:
        log.warning("unreadable commit metadata ignored", metadata=metadata[:80])
        return set()
