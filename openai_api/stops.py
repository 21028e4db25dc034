"""OpenAI's ``stop``: the completion ends before the first stop string, which is not returned.

Tokens arrive one at a time and a stop string may span several, so a streamed answer holds back
the tail that could still be the start of one; the rest is safe to send at once.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hit = False  # a stop string was found: the completion is over
        self._pending = ""

    def feed(self, piece: str) -> str:
        """The text that can be sent now, given the next piece of the completion."""
        if not self.stops:
            return piece
        text = self._pending + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self._pending = ""
            return text[: min(found)]
        keep = self._longest_stop_prefix_suffix(text)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the completion ended without a stop string."""
        rest, self._pending = self._pending, ""
        return rest

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        for size in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
