"""The scheduler's view of one request, and of one worker's slot.

A worker (``worker/batch_engine.py``) runs one prefill at a time while the requests past their
first token decode together: a request holds its worker's prefill until its first token, then
a row of its decode batch, and a KV slot throughout. A suspended
request's KV state lives on ONE worker: it can only resume there, unless the state was dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tierflow.tiers import TierPolicy


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting, no state anywhere: starts from token 0 on any worker
    RUNNING = "running"  # prefilling on its worker
    DECODING = "decoding"  # first token sent, still holding its worker
    PREEMPTING = "preempting"  # Preempt sent, ack not yet received; worker not yet free
    SUSPENDED = "suspended"  # stopped, state kept on its worker; resumable only there
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


ON_WORKER = frozenset({RequestState.RUNNING, RequestState.DECODING, RequestState.PREEMPTING})


@dataclass
class Request:
    request_id: str
    tier: TierPolicy
    arrival_s: float
    prompt_tokens: int
    max_new_tokens: int = 0
    seq: int = 0  # admission order: the tie-break that keeps every ordering total
    # The API key that sent it (its label) and the key's share of its tier (``fairness``).
    key_id: str = ""
    key_weight: float = 1.0
    fair_tag: float = 0.0  # its start tag among the keys of its tier (``fairness``)
    state: RequestState = RequestState.QUEUED
    tokens_done: int = 0  # prompt tokens whose state exists (on worker_id)
    # Within the chunk [tokens_done, chunk_end): the fraction of its layers already computed
    # (per-layer progress reports). 0 when only chunk ends are known.
    chunk_end: int = 0
    chunk_fraction: float = 0.0
    prefilled: bool = False  # first token sent and the state still exists: decoding
    worker_id: str | None = None  # running it, or holding its suspended state
    preemptions: int = 0  # those the bound counts (``planner.Rules``; ``Scheduler._preempt``)
    # When tokens_done was last exact (start, resume, progress): the estimate of what is left
    # subtracts the time spent since, so a silent worker does not freeze the estimate.
    progress_at_s: float = 0.0
    first_token_s: float | None = None
    # The wake-up asked for while it waits on a prediction (SetTimer), and whether it fired: a
    # request whose wake-up fired no longer waits on predictions, it preempts when it may.
    timer_at_s: float | None = None
    due: bool = False
    # Prefill time predicted when it first started, to measure the predictor's error; None
    # once a restart from scratch makes the measured time incomparable.
    predicted_prefill_s: float | None = None
    restarted: bool = False
    # Prefilled in a pack with others (``packing``): every member's id, the first holding the
    # worker's prefill; kept while the pack's state lives (until its first tokens, or a drop).
    pack: tuple[str, ...] = ()
    # The TTFT admission predicted for it on arrival (before the error it adds), in a tier
    # that admission judges: compared with its TTFT to learn that error (``admission_error``).
    admission_ttft_s: float | None = None
    key_over_share: bool = False  # admission found its key over its share (``fairness``)

    # Its TTFT deadline (arrival and tier never change): read on every decision, so kept.
    deadline_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.deadline_s = self.arrival_s + self.tier.ttft_slo_s

    @property
    def waiting(self) -> bool:
        state = self.state  # two identity tests: cheaper than hashing the enum for a set
        return state is RequestState.QUEUED or state is RequestState.SUSPENDED

    def restart_from_scratch(self) -> None:
        """Its state is gone (dropped by the worker, or the worker left): back to the queue."""
        self.state = RequestState.QUEUED
        self.tokens_done = 0
        self.chunk_end = 0
        self.chunk_fraction = 0.0
        self.prefilled = False
        self.worker_id = None
        self.restarted = True
        self.pack = ()


@dataclass
class WorkerSlot:
    worker_id: str
    seq: int  # join order: deterministic tie-break between workers
    active: str | None = None  # request RUNNING, DECODING or PREEMPTING here
    suspended: dict[str, None] = field(default_factory=dict)  # ordered set of request ids
    # While PREEMPTING: the waiting request it is preempted for, so that one does not trigger a
    # second preemption elsewhere before the ack (one preemption per beneficiary).
    reserved_for: str | None = None
    # KV slots for every request it holds (prefilling, decoding, suspended or paused).
    kv_slots: int = 1
    # Requests decoding in its batch. They do not hold ``active``: the worker prefills the
    # next request while they decode.
    decoding: dict[str, None] = field(default_factory=dict)
    # The members of the running packed prefill other than ``active``.
    riders: dict[str, None] = field(default_factory=dict)
    # The learnt time of one decode step (``DecodeStepDone``).
    decode_step_s: float = 0.0
    # Shutting down (``WorkerDraining``): it finishes what it holds and takes nothing new.
    draining: bool = False

    @property
    def free(self) -> bool:
        return self.active is None

    @property
    def held(self) -> int:
        """Requests whose state it holds: prefilling, decoding, suspended or paused."""
        running = len(self.riders) + (self.active is not None)
        return len(self.decoding) + len(self.suspended) + running

    @property
    def has_kv_slot(self) -> bool:
        """Room for one more request's state (a draining worker has none)."""
        return not self.draining and self.held < self.kv_slots
