"""The queue service's record of one request while it is in this instance's hands.

Scheduling state lives in the scheduler; this holds what the service needs to answer the client:
the queued record (prompt, tier, who to reply to), the Kafka delivery to acknowledge when it is
finished, and the timings that end up in ``Done`` and ``GetRequest``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierflow.v1 import queue_pb2, serving_pb2


class Outcome(enum.Enum):
    LIVE = "live"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


@dataclass
class LiveRequest:
    record: queue_pb2.QueuedRequest
    delivery: Any  # the Kafka delivery to mark finished (None when not from Kafka)
    arrived_at: float  # service clock (monotonic seconds)
    ended_at: float | None = None  # when it finished, whatever its end: total_ms stops there
    worker_id: str | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    suspended_since: float | None = None
    suspended_s: float = 0.0
    prefill_busy_ms: float = 0.0
    preemptions: int = 0
    tokens_done: int = 0
    output_ids: list[int] = field(default_factory=list)
    # The gap before each streamed token after the first (time between tokens, as the client
    # saw them leave); a recompute that resends nothing adds nothing.
    token_gaps_s: list[float] = field(default_factory=list)
    last_token_at: float | None = None
    # The text of the tokens streamed so far, one piece per token (incomplete UTF-8 held back);
    # a new one per run from token 0.
    text_step: Callable[[int], str] | None = None
    outcome: Outcome = Outcome.LIVE
    error: str = ""
    shed: bool = False  # rejected for load (not for being invalid)
    unattended_since: float | None = None  # waiting with no worker attached, since then
    state: int = serving_pb2.RequestStatus.QUEUED

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def timings(self, now: float) -> serving_pb2.Timings:
        ttft = (self.first_token_at - self.arrived_at) * 1000 if self.first_token_at else 0.0
        wait = (self.started_at - self.arrived_at) * 1000 if self.started_at else 0.0
        return serving_pb2.Timings(
            queue_wait_ms=wait,
            prefill_ms=self.prefill_busy_ms,
            suspended_ms=self.suspended_s * 1000,
            ttft_ms=ttft,
            total_ms=((self.ended_at if self.ended_at is not None else now) - self.arrived_at)
            * 1000,
            preemptions=self.preemptions,
        )

    def usage(self) -> serving_pb2.Usage:
        return serving_pb2.Usage(
            prompt_tokens=len(self.record.prompt_ids), completion_tokens=len(self.output_ids)
        )
