"""The queue service's scheduler: a pure, event-driven state machine.

    scheduler = Scheduler(make_policy("flowprefill"), load_tiers(), PrefillTimePredictor())
    commands = scheduler.handle(RequestArrived("r1", "critical", 120), now=clock())

Events in (``events``), commands out; ``policies`` hold the ordering and preemption rules,
``predictor`` the fitted prefill-time model, ``planner`` the rules shared by every policy.
"""

from queue_service.scheduler.events import (
    Assign,
    AssignPacked,
    Cancel,
    CancelTimer,
    Command,
    DecodeStepDone,
    Drain,
    Event,
    PauseDecode,
    Preempt,
    PreemptionAcked,
    PrefillFinished,
    PrefillProgress,
    Reject,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    Resume,
    SetTimer,
    TimerFired,
    WorkerDraining,
    WorkerJoined,
    WorkerLeft,
)
from queue_service.scheduler.policies import (
    POLICIES,
    Chunked,
    EngineCheck,
    Fifo,
    FlowPrefill,
    Outlook,
    Priority,
    Recompute,
    SchedulingPolicy,
    make_policy,
)
from queue_service.scheduler.prediction_error import PredictionErrors
from queue_service.scheduler.predictor import PrefillSample, PrefillTimePredictor
from queue_service.scheduler.request import Request, RequestState
from queue_service.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "POLICIES",
    "Assign",
    "AssignPacked",
    "Cancel",
    "CancelTimer",
    "Chunked",
    "Command",
    "DecodeStepDone",
    "Drain",
    "EngineCheck",
    "Event",
    "Fifo",
    "FlowPrefill",
    "Outlook",
    "PauseDecode",
    "PredictionErrors",
    "Preempt",
    "PreemptionAcked",
    "PrefillFinished",
    "PrefillProgress",
    "PrefillSample",
    "PrefillTimePredictor",
    "Priority",
    "Recompute",
    "Reject",
    "Request",
    "RequestArrived",
    "RequestCancelled",
    "RequestDone",
    "RequestState",
    "Resume",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SetTimer",
    "TimerFired",
    "WorkerDraining",
    "WorkerJoined",
    "WorkerLeft",
    "make_policy",
]
