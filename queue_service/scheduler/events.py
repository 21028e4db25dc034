"""Typed messages of the scheduler: events in (what happened), commands out (what to do).

They mirror the worker control stream in ``protos/`` but carry no I/O: the service translates
wire messages into these events and these commands into wire messages. All are frozen so a
command handed to a transport cannot be changed behind the scheduler's back.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------- events in


@dataclass(frozen=True)
class RequestArrived:
    """A client request was admitted by the gateway.

    ``arrival_s``: when it was admitted, on the scheduler's clock; its deadline counts from
    there. A request held in Kafka, or redelivered after a restart, arrives late at the
    scheduler but keeps its original deadline. None: the ``now`` of handle(). A value after
    ``now`` is clamped to ``now``.
    """

    request_id: str
    tier: str
    prompt_tokens: int
    max_new_tokens: int = 0
    arrival_s: float | None = None
    key_id: str = ""  # the API key's label: fair order between the keys of a tier
    key_weight: float = 1.0  # the key's share of its tier (``weight`` in config/keys.toml)
    # The TTFT admission predicted for it (``capacity.judge``, before the error it adds), on
    # the instance that admitted it; None: not judged. Its first token measures that error.
    admission_ttft_s: float | None = None
    # Admission found the key over its share of the tier (``fairness.SentRates``): fair order
    # gives its requests no burst credit.
    key_over_share: bool = False


@dataclass(frozen=True)
class PrefillProgress:
    """How far a running prefill is: ``tokens_done`` prompt tokens through every layer, and
    ``layers_done`` of ``num_layers`` layers through the chunk that ends at ``chunk_end``.

    Sent at chunk ends (``layers_done`` 0) and, from engines that report it, every few layers
    within a chunk, so the estimate of what is left is corrected during a long chunk. Each
    report is a decision point: a request that chose to wait on an older estimate may now need
    a preemption.
    """

    request_id: str
    worker_id: str
    tokens_done: int
    layers_done: int = 0
    num_layers: int = 1
    chunk_end: int = 0


@dataclass(frozen=True)
class PrefillFinished:
    """First token sent; the request decodes on the same worker until RequestDone.

    ``tokens``: prompt tokens prefilled. ``prefill_s``: measured busy seconds to prefill them
    once (time spent suspended, and decode steps of other rows slotted in, excluded: the
    scheduler counts those apart, ``decode_batch``); it refits the prefill-time predictor (0:
    do not, e.g. a dropped decode's recompute, whose first token is long out).
    ``pack_tokens``: it was prefilled in a pack of that many prompt tokens, and ``prefill_s``
    is the pack's time; it teaches the packed-prefill cost instead.
    """

    request_id: str
    worker_id: str
    tokens: int
    prefill_s: float
    pack_tokens: int = 0


@dataclass(frozen=True)
class RequestDone:
    """The worker finished the request (decode included) and freed it."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class PreemptionAcked:
    """The worker stopped the request; it holds its state unless ``state_dropped``.
    ``latency_s``: from the Preempt reaching the worker to the engine stopping (0: unknown);
    it teaches the scheduler how long a preemption takes to act."""

    request_id: str
    worker_id: str
    tokens_done: int
    state_dropped: bool
    latency_s: float = 0.0


@dataclass(frozen=True)
class RequestCancelled:
    """The client went away or cancelled."""

    request_id: str


@dataclass(frozen=True)
class TimerFired:
    """A wake-up the scheduler asked for (``SetTimer``) is due. The dispatcher fires it at or
    after ``SetTimer.at_s``; a timer that was replaced or cancelled meanwhile is ignored."""

    request_id: str


@dataclass(frozen=True)
class DecodeStepDone:
    """A batched worker ran one decode step of ``rows`` requests in ``seconds``; ``slotted``:
    at a layer boundary of a running prefill (which it slowed down by that much)."""

    worker_id: str
    rows: int
    seconds: float
    slotted: bool = False


@dataclass(frozen=True)
class WorkerJoined:
    """A worker with ``kv_slots`` KV slots: it prefills one request while the others decode in
    its batch (1: one request at a time). A worker that says 0 (one from before every worker
    batched) is refused by the queue service; here it is an error."""

    worker_id: str
    kv_slots: int
    # Its preemption budget: the longest a Preempt waits for the running prefill's next
    # interruption point (0: not bounded in time). What the scheduler assumes a preemption
    # takes until it has measured some.
    interruption_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_slots < 1:
            raise ValueError(f"worker {self.worker_id!r} has {self.kv_slots} KV slots: needs >= 1")


@dataclass(frozen=True)
class WorkerLeft:
    """The worker is gone, and with it every state it held."""

    worker_id: str


@dataclass(frozen=True)
class WorkerDraining:
    """The worker is shutting down (its process got SIGTERM): it takes no new request, and
    finishes what it holds (running, decoding, suspended) before it leaves."""

    worker_id: str


Event = (
    RequestArrived
    | PrefillProgress
    | PrefillFinished
    | RequestDone
    | PreemptionAcked
    | RequestCancelled
    | TimerFired
    | DecodeStepDone
    | WorkerJoined
    | WorkerLeft
    | WorkerDraining
)

# ---------------------------------------------------------------------------- commands out


@dataclass(frozen=True)
class Assign:
    """Start the request from its first token on the worker."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class AssignPacked:
    """Prefill these requests together in one forward on the batched worker (``packing``);
    the first holds the worker's prefill. A Preempt or Resume of any member applies to all."""

    request_ids: tuple[str, ...]
    worker_id: str


@dataclass(frozen=True)
class PauseDecode:
    """Take a decoding request out of its batched worker's decode batch between two steps,
    keeping its KV unless ``drop_state`` (it then recomputes when assigned again, without
    sending any token twice). Acknowledged with PreemptionAcked; Resume puts it back."""

    request_id: str
    worker_id: str
    drop_state: bool


@dataclass(frozen=True)
class Preempt:
    """Stop the request at the engine's next checked boundary; drop its state if asked. A
    worker that finds it decoding already (its first token crossed the Preempt) pauses it
    like PauseDecode."""

    request_id: str
    worker_id: str
    drop_state: bool


@dataclass(frozen=True)
class Resume:
    """Continue a suspended request on the worker that holds its state."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Cancel:
    """Stop the request (running or suspended) on the worker and free what it holds."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Drain:
    """The worker will get no new request from now on: once it holds nothing it closes its
    stream and exits (the answer to ``WorkerDraining``)."""

    worker_id: str


@dataclass(frozen=True)
class Reject:
    """The request is not accepted; ``reason`` is meant for the client. ``overload``: refused
    for load (RESOURCE_EXHAUSTED on the wire), otherwise the request itself is invalid."""

    request_id: str
    reason: str
    overload: bool = False


@dataclass(frozen=True)
class SetTimer:
    """Send ``TimerFired(request_id)`` at ``at_s`` (the scheduler's clock), replacing the
    request's previous timer. The scheduler sets one when a request waits on a prediction: at
    the last moment a preemption still saves its deadline, it decides again."""

    request_id: str
    at_s: float


@dataclass(frozen=True)
class CancelTimer:
    """The request's timer is no longer needed (it started, finished or was cancelled)."""

    request_id: str


Command = (
    Assign
    | AssignPacked
    | Preempt
    | PauseDecode
    | Resume
    | Cancel
    | Drain
    | Reject
    | SetTimer
    | CancelTimer
)
