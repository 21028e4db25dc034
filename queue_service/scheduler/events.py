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
    """A client request was admitted by the gateway. Its arrival time is the ``now`` of handle()."""

    request_id: str
    tier: str
    prompt_tokens: int
    max_new_tokens: int = 0


@dataclass(frozen=True)
class PrefillProgress:
    """A worker finished a chunk. Informational: updates the estimate, decides nothing."""

    request_id: str
    worker_id: str
    tokens_done: int


@dataclass(frozen=True)
class PrefillFinished:
    """First token sent; the request decodes on the same worker until RequestDone.

    ``tokens``: prompt tokens prefilled. ``prefill_s``: measured busy seconds to prefill them
    once (time spent suspended excluded); it refits the prefill-time predictor.
    """

    request_id: str
    worker_id: str
    tokens: int
    prefill_s: float


@dataclass(frozen=True)
class RequestDone:
    """The worker finished the request (decode included) and freed it."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class PreemptionAcked:
    """The worker stopped the request; it holds its state unless ``state_dropped``."""

    request_id: str
    worker_id: str
    tokens_done: int
    state_dropped: bool


@dataclass(frozen=True)
class RequestCancelled:
    """The client went away or cancelled."""

    request_id: str


@dataclass(frozen=True)
class WorkerJoined:
    worker_id: str


@dataclass(frozen=True)
class WorkerLeft:
    """The worker is gone, and with it every state it held."""

    worker_id: str


Event = (
    RequestArrived
    | PrefillProgress
    | PrefillFinished
    | RequestDone
    | PreemptionAcked
    | RequestCancelled
    | WorkerJoined
    | WorkerLeft
)

# ---------------------------------------------------------------------------- commands out


@dataclass(frozen=True)
class Assign:
    """Start the request from its first token on the worker."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Preempt:
    """Stop the request at the engine's next checked boundary; drop its state if asked."""

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
class Reject:
    """The request is not accepted; ``reason`` is meant for the client. ``overload``: refused
    for load (RESOURCE_EXHAUSTED on the wire), otherwise the request itself is invalid."""

    request_id: str
    reason: str
    overload: bool = False


Command = Assign | Preempt | Resume | Cancel | Reject
