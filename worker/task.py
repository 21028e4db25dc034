"""One request inside the engine, and the exact point where its computation stands.

A task moves QUEUED -> PREFILL -> DECODE -> FINISHED (or CANCELLED). While it is in PREFILL or
DECODE it owns an ``ExecutionState``: the KV cache plus, when it was stopped inside a chunk, that
chunk's hidden states and the context every remaining layer of the chunk needs (attention masks,
position ids, rotary embeddings). Those are computed once per chunk, before the first layer
appends the chunk to the cache, and kept here: after a mid-chunk stop the cache is uneven across
layers, so they could not be rebuilt from it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker.kv_cache import LayerwiseKVCache
from worker.request import GenerationRequest


class Phase(enum.Enum):
    QUEUED = "queued"  # no state yet (new, or its state was dropped for recompute)
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped task continues. ``half`` 1 means: the attention half of ``layer`` ran,
    its MLP half did not. ``rows_done``: that many rows of the chunk went through the half
    it stopped in (a stop between row blocks). ``tokens_done`` counts prompt tokens that went
    through every layer."""

    chunk: int
    layer: int
    half: int
    tokens_done: int
    rows_done: int = 0


@dataclass
class ChunkContext:
    """Everything the layers of one chunk share; built once, before the chunk's first layer."""

    start: int
    end: int
    position_ids: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    masks: dict[str, torch.Tensor | None]  # layer type -> mask (None: causal fast path)
    # Layer type -> the chunk's mask as the additive float mask that row blocks slice; made on
    # first use (``block_mask``).
    block_masks: dict[str, torch.Tensor] = field(default_factory=dict)

    def block_mask(
        self, layer_type: str, additive: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The whole chunk's mask (rows against keys [0, end)) in ``additive`` form; a mask of
        None (SDPA's causal fast path) made explicit."""
        made = self.block_masks.get(layer_type)
        if made is None:
            mask = self.masks[layer_type]
            if mask is None:
                queries = self.position_ids[0].unsqueeze(1)
                keys = torch.arange(self.end, device=queries.device).unsqueeze(0)
                mask = (keys <= queries)[None, None]
            made = additive(mask) if mask.dtype == torch.bool else mask
            self.block_masks[layer_type] = made
        return made

    def nbytes(self) -> int:
        tensors = [
            self.position_ids,
            *self.rotary,
            *(m for m in self.masks.values() if m is not None),
            *self.block_masks.values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ExecutionState:
    cache: LayerwiseKVCache
    chunk: int = 0  # index into Task.chunks (prefill) - unused in decode
    layer: int = 0
    half: int = 0
    hidden: torch.Tensor | None = None  # activations between two operators of the current chunk
    context: ChunkContext | None = None
    # Stopped inside an operator, between two row blocks (worker.row_blocks): the rows done
    # and, for them, the operator's input plus its output (rows past ``rows_done`` are not
    # written yet).
    rows_done: int = 0
    partial: torch.Tensor | None = None

    def nbytes(self) -> int:
        held = self.cache.nbytes
        for tensor in (self.hidden, self.partial):
            if tensor is not None:
                held += tensor.numel() * tensor.element_size()
        if self.context is not None:
            held += self.context.nbytes()
        return held


@dataclass(eq=False)
class Task:
    request: GenerationRequest
    chunks: tuple[tuple[int, int], ...]  # [start, end) of every prefill chunk
    phase: Phase = Phase.QUEUED
    state: ExecutionState | None = None
    output_ids: list[int] = field(default_factory=list)
    preemptions: int = 0
    recomputes: int = 0  # times its state was dropped and prefill restarted from token 0
    generator: torch.Generator | None = None  # sampling RNG, seeded from the request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """The tokens a prefill puts in the cache: the prompt, plus, for a decoding request
        whose state was dropped, every token it produced but the last (the next decode input)."""
        if len(self.output_ids) <= 1:
            return self.request.prompt_ids
        return self.request.prompt_ids + tuple(self.output_ids[:-1])

    @property
    def tokens_done(self) -> int:
        """Prompt tokens that have been through every layer."""
        if self.phase in (Phase.DECODE, Phase.FINISHED):
            return self.prompt_len
        if self.state is None:
            return 0
        return (
            self.chunks[self.state.chunk][0]
            if self.state.chunk < len(self.chunks)
            else self.prompt_len
        )

    def resume_point(self) -> ResumePoint:
        s = self.state
        if s is None:
            return ResumePoint(chunk=0, layer=0, half=0, tokens_done=0)
        return ResumePoint(s.chunk, s.layer, s.half, self.tokens_done, s.rows_done)

    def held_bytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()
