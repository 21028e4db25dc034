"""What an engine runner reports, one frozen dataclass per event.

These mirror the worker side of the control stream (Progress / Preempted / FirstToken / Token /
Done / Failed) without depending on protobuf or on the scheduler: the in-process benchmark turns
them into scheduler events directly, the worker process turns them into wire messages.
Timestamps are ``time.perf_counter()`` values taken on the engine thread, at the moment the
thing happened, so a slow consumer does not distort TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.task import ResumePoint


@dataclass(frozen=True)
class Progress:
    """``tokens_done`` prompt tokens went through every layer; within the chunk that ends at
    ``chunk_end``, ``layers_done`` of ``num_layers`` layers ran (0 at a chunk end)."""

    request_id: str
    tokens_done: int
    prompt_tokens: int
    at: float
    layers_done: int = 0
    num_layers: int = 1
    chunk_end: int = 0


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    token_id: int
    at: float
    prefill_busy_s: float  # engine time spent on this prefill, summed over its runs
    prompt_tokens: int


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    token_id: int
    at: float
    index: int = 0  # position in the request's output; the first token is 0


@dataclass(frozen=True)
class Preempted:
    request_id: str
    resume_point: ResumePoint
    held_bytes: int
    state_dropped: bool
    at: float
    signalled_at: float  # when the preemption was asked for: at - signalled_at is its latency


@dataclass(frozen=True)
class Finished:
    request_id: str
    output_ids: tuple[int, ...]
    busy_s: float  # engine time spent on the request, all runs together
    preemptions: int
    at: float


@dataclass(frozen=True)
class Cancelled:
    request_id: str
    at: float


@dataclass(frozen=True)
class Failed:
    request_id: str
    error: str
    invalid_request: bool  # True: the request itself is bad (INVALID_ARGUMENT), not the worker
    at: float


RunnerEvent = Progress | FirstToken | TokenOut | Preempted | Finished | Cancelled | Failed
