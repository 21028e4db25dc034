"""The worker's log line per engine event of interest (never per chunk or per token)."""

from __future__ import annotations

from typing import Any

from worker import wire
from worker.events import Cancelled, Failed, Finished, FirstToken, Preempted, RunnerEvent


def log_event(log: Any, event: RunnerEvent) -> None:
    """``log``: a bound structlog logger."""
    match event:
        case FirstToken():
            log.info(
                "first token",
                request_id=event.request_id,
                prefill_busy_ms=round(event.prefill_busy_s * 1000, 3),
                prompt_tokens=event.prompt_tokens,
            )
        case Preempted():
            point = event.resume_point
            log.info(
                "preempted",
                request_id=event.request_id,
                latency_ms=round(wire.preemption_latency_ms(event), 3),
                chunk=point.chunk,
                layer=point.layer,
                half=point.half,
                tokens_done=point.tokens_done,
                held_bytes=event.held_bytes,
                state_dropped=event.state_dropped,
            )
        case Finished():
            log.info(
                "finished",
                request_id=event.request_id,
                output_tokens=len(event.output_ids),
                busy_ms=round(event.busy_s * 1000, 3),
                preemptions=event.preemptions,
            )
        case Cancelled():
            log.info("cancelled", request_id=event.request_id)
        case Failed():
            log.warning(
                "failed",
                request_id=event.request_id,
                error=event.error,
                invalid_request=event.invalid_request,
            )
