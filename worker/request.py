"""What the engine is asked to do: a tokenised prompt and how to continue it.

Protobuf types stay at the edges: the worker's control-stream code converts wire messages into
these frozen dataclasses before they reach the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """The request can never be served as given (maps to INVALID_ARGUMENT on the wire)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. ``seed`` makes sampling reproducible per request."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 1  # the first token is always produced: it is the TTFT event
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_at_eos: bool = True
