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
    # Engine time spent on this prefill, summed over its runs, less the decode steps of other
    # rows slotted into them: the prefill's own time, which the scheduler's predictor learns.
    prefill_busy_s: float
    prompt_tokens: int
    # Prefilled in a pack (``worker.packed_prefill``): the pack's prompt tokens and members;
    # ``prefill_busy_s`` is then the pack's. 0: prefilled alone.
    pack_tokens: int = 0
    pack_size: int = 0


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    token_id: int
    at: float
    index: int = 0  # position in the request's output; the first token is 0


@dataclass(frozen=True)
class DecodeStepDone:
    """One decode step of a batched worker: row ``i`` produced ``tokens[i]``, the
    ``indexes[i]``-th token of ``request_ids[i]``. ``slotted``: run at a layer boundary of a
    running prefill. ``seconds``: the whole step's time (a step stopped for a prefill and
    finished later, its parts together), what the scheduler learns a step costs. Carries every
    row's token, so a step is one event, not B."""

    request_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    indexes: tuple[int, ...]
    seconds: float
    slotted: bool
    at: float

    @property
    def request_id(self) -> str:
        """Not one request's event: empty (loggers and metrics key events by request)."""
        return ""


@dataclass(frozen=True)
class DecodeRejoined:
    """A decoding request whose state was dropped recomputed ``recomputed_tokens`` tokens
    (prompt + output so far but the last) and decodes again; no token is produced twice."""

    request_id: str
    recomputed_tokens: int
    at: float


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


RunnerEvent = (
    Progress
    | FirstToken
    | TokenOut
    | DecodeStepDone
    | DecodeRejoined
    | Preempted
    | Finished
    | Cancelled
    | Failed
)
