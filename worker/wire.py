"""Conversions between the control stream's protobuf messages and the engine's own types.

The one module of the worker that knows both sides: the engine and its runner speak frozen
dataclasses (``worker.request``, ``worker.events``), the control stream speaks
``tierflow.v1.worker_pb2``. Keeping every conversion here keeps protobuf at the edge, and keeps
the wire's conventions (``0`` meaning "unset") out of the engine.
"""

from __future__ import annotations

from tierflow.v1 import worker_pb2
from worker.batch_engine import BatchEngine
from worker.events import (
    Cancelled,
    DecodeRejoined,
    DecodeStepDone,
    Failed,
    Finished,
    FirstToken,
    Preempted,
    Progress,
    RunnerEvent,
    TokenOut,
)
from worker.request import GenerationRequest, SamplingParams
from worker.task import ResumePoint

# ---------------------------------------------------------------- queue service -> engine


def request_from_assign(assign: worker_pb2.Assign) -> GenerationRequest:
    """The engine's request for an ``Assign``.

    proto3 cannot tell an unset scalar from 0, so 0 keeps the meaning the client API gives it:
    ``top_p`` 0 is 1.0 (no nucleus cut) and ``max_new_tokens`` 0 is 1 (the first token only).
    Raises ``InvalidRequestError`` for sampling parameters out of range; the prompt itself is
    validated by the engine (``PrefillEngine.new_task``).
    """
    sampling = assign.sampling  # an unset message reads as all zeros: greedy, seed 0
    params = SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed,
    )
    return GenerationRequest(
        request_id=assign.request_id,
        prompt_ids=tuple(assign.prompt_ids),
        max_new_tokens=assign.max_new_tokens or 1,
        sampling=params,
        stop_at_eos=assign.stop_at_eos,
    )


def tbt_slo_s(assign: worker_pb2.Assign) -> float | None:
    """The request's time-between-tokens target; None (0 on the wire): none."""
    return assign.tbt_slo_s if assign.tbt_slo_s > 0 else None


# ---------------------------------------------------------------- engine -> queue service


def event_message(event: RunnerEvent) -> worker_pb2.WorkerMessage:
    """The wire message for one runner event. Times go up as milliseconds."""
    match event:
        case Progress():
            return worker_pb2.WorkerMessage(
                progress=worker_pb2.Progress(
                    request_id=event.request_id,
                    tokens_done=event.tokens_done,
                    prompt_tokens=event.prompt_tokens,
                    layers_done=event.layers_done,
                    num_layers=event.num_layers,
                    chunk_end=event.chunk_end,
                )
            )
        case FirstToken():
            return worker_pb2.WorkerMessage(
                first_token=worker_pb2.WorkerFirstToken(
                    request_id=event.request_id,
                    token_id=event.token_id,
                    prefill_busy_ms=event.prefill_busy_s * 1000.0,
                    prompt_tokens=event.prompt_tokens,
                    pack_tokens=event.pack_tokens,
                    pack_size=event.pack_size,
                )
            )
        case TokenOut():
            return worker_pb2.WorkerMessage(
                token=worker_pb2.WorkerToken(
                    request_id=event.request_id, token_id=event.token_id, index=event.index
                )
            )
        case DecodeStepDone():
            return worker_pb2.WorkerMessage(decode_step=decode_step_message(event))
        case DecodeRejoined():
            return worker_pb2.WorkerMessage(
                decode_rejoined=worker_pb2.DecodeRejoined(
                    request_id=event.request_id, recomputed_tokens=event.recomputed_tokens
                )
            )
        case Preempted():
            return worker_pb2.WorkerMessage(
                preempted=worker_pb2.Preempted(
                    request_id=event.request_id,
                    resume_point=resume_point_message(event.resume_point),
                    held_bytes=event.held_bytes,
                    state_dropped=event.state_dropped,
                    latency_ms=preemption_latency_ms(event),
                )
            )
        case Finished():
            return worker_pb2.WorkerMessage(
                done=worker_pb2.WorkerDone(
                    request_id=event.request_id,
                    output_ids=event.output_ids,
                    busy_ms=event.busy_s * 1000.0,
                    preemptions=event.preemptions,
                )
            )
        case Cancelled():
            return worker_pb2.WorkerMessage(
                cancelled=worker_pb2.WorkerCancelled(request_id=event.request_id)
            )
        case Failed():
            return worker_pb2.WorkerMessage(
                failed=worker_pb2.WorkerFailed(
                    request_id=event.request_id,
                    error=event.error,
                    invalid_request=event.invalid_request,
                )
            )
    raise TypeError(f"not a runner event: {event!r}")


def decode_step_message(event: DecodeStepDone) -> worker_pb2.DecodeStep:
    tokens = [
        worker_pb2.WorkerToken(request_id=rid, token_id=token, index=index)
        for rid, token, index in zip(event.request_ids, event.tokens, event.indexes, strict=True)
    ]
    return worker_pb2.DecodeStep(
        tokens=tokens, step_ms=event.seconds * 1000.0, slotted=event.slotted
    )


def resume_point_message(point: ResumePoint) -> worker_pb2.ResumePoint:
    return worker_pb2.ResumePoint(
        chunk=point.chunk, layer=point.layer, half=point.half, tokens_done=point.tokens_done
    )


def preemption_latency_ms(event: Preempted) -> float:
    """Preempt received (the flag raised) -> engine stopped at a boundary."""
    return (event.at - event.signalled_at) * 1000.0


def hello(worker_id: str, model_name: str, engine: BatchEngine) -> worker_pb2.WorkerMessage:
    """The first message of every session: what this worker serves, how it preempts, its KV
    slots and decode batch (always at least 1: the queue service refuses 0)."""
    config = engine.config
    return worker_pb2.WorkerMessage(
        hello=worker_pb2.Hello(
            worker_id=worker_id,
            model=model_name,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            num_layers=len(engine.layers),
            max_positions=engine.max_positions,
            chunk_size=config.chunk_size or 0,  # 0 on the wire: the whole prompt is one chunk
            check=config.check,
            memory_cap_bytes=config.memory_cap_bytes,
            kv_slots=engine.pool.num_slots,
            max_batch_size=engine.batch_config.max_batch_size,
            slot_tokens=engine.pool.slot_tokens,
            preempt_budget_ms=(config.preempt_budget_ms or 0) if config.check == "block" else 0,
        )
    )


def heartbeat(suspended_bytes: int, running_request_id: str | None) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        heartbeat=worker_pb2.Heartbeat(
            suspended_bytes=suspended_bytes, running_request_id=running_request_id or ""
        )
    )


def draining() -> worker_pb2.WorkerMessage:
    """The worker is shutting down: the queue service should send it no new request."""
    return worker_pb2.WorkerMessage(draining=worker_pb2.Draining())
