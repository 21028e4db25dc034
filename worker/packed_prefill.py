"""Several waiting prompts prefilled in one forward (FlowPrefill's prefill batching).

The prompts are concatenated into one row of T tokens; a block-diagonal causal mask keeps each
prompt to its own keys, and each prompt's positions start at 0. No padding: the MLPs, which
dominate short prefills, run over exactly the real tokens. Each prompt's K/V go straight into
its own pool slot (``worker.kv_pool.PackedPrefillCache``). The packed forward is one unit of
work for the layer loop: it is checked at the same boundaries as any prefill, and a stop keeps
its hidden states and context (``ExecutionState``) so it resumes at the exact operator.

Packing takes whole prompts (one chunk each): it is for short prompts, where one forward per
prompt wastes the machine; a long prompt is prefilled alone, in chunks. Whether a pack meets
its members' deadlines is the scheduler's decision (it predicts the packed cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.kv_pool import PackedPrefillCache, PoolFullError, SlotCache
from worker.sampling import sample_next_token
from worker.task import ChunkContext, ExecutionState, Phase, ResumePoint, Task


@dataclass(eq=False)
class PackedPrefill:
    tasks: tuple[Task, ...]
    state: ExecutionState | None = None  # the packed row's activations and context
    offsets: list[int] = field(default_factory=list)  # segment i is [offsets[i], offsets[i+1])

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(t.request_id for t in self.tasks)

    def resume_point(self) -> ResumePoint:
        s = self.state
        if s is None:
            return ResumePoint(chunk=0, layer=0, half=0, tokens_done=0)
        return ResumePoint(chunk=0, layer=s.layer, half=s.half, tokens_done=0)

    def held_bytes(self) -> dict[str, int]:
        """Per request: its slot; the first one also carries the packed activations."""
        assert self.state is not None
        hidden, context = self.state.hidden, self.state.context
        activations = (hidden.numel() * hidden.element_size() if hidden is not None else 0) + (
            context.nbytes() if context is not None else 0
        )
        return {
            t.request_id: t.held_bytes() + (activations if i == 0 else 0)
            for i, t in enumerate(self.tasks)
        }


def start_pack(engine, pack: PackedPrefill) -> None:
    """Give every member its slot and embed the packed row (nothing runs yet). Members
    cancelled since the pack was formed (or dropped) are left out."""
    pack.tasks = tuple(t for t in pack.tasks if t.phase is not Phase.CANCELLED)
    for task in pack.tasks:
        if task.phase is not Phase.QUEUED or task.output_ids:
            raise ValueError(f"task {task.request_id} cannot be packed: it is {task.phase.value}")
    if engine.pool.free_slots < len(pack.tasks):
        raise PoolFullError(
            f"a pack of {len(pack.tasks)} needs as many free KV slots; "
            f"{engine.pool.free_slots} are free"
        )
    caches: list[SlotCache] = []
    for task in pack.tasks:
        tokens = task.prompt_len + task.request.max_new_tokens
        task.state = ExecutionState(cache=engine.pool.allocate(task.request_id, tokens))
        task.phase = Phase.PREFILL
        caches.append(task.state.cache)
    lengths = [t.prompt_len for t in pack.tasks]
    pack.offsets = [0]
    for n in lengths:
        pack.offsets.append(pack.offsets[-1] + n)
    ids = [i for t in pack.tasks for i in t.request.prompt_ids]
    hidden = engine.embed(torch.tensor([ids], device=engine.device))
    pack.state = ExecutionState(
        cache=PackedPrefillCache(caches, pack.offsets),
        hidden=hidden,
        context=packed_context(engine, lengths, hidden),
    )


def packed_context(engine, lengths: list[int], hidden: torch.Tensor) -> ChunkContext:
    """Positions restart at 0 for each prompt; a query sees only its own prompt's earlier
    keys (and only the window of them on sliding-window layers)."""
    device = engine.device
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    segment = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    position_ids = positions.unsqueeze(0)
    q, k = positions.unsqueeze(1), positions.unsqueeze(0)
    same = segment.unsqueeze(1) == segment.unsqueeze(0)
    masks: dict[str, torch.Tensor | None] = {}
    for layer_type in set(engine.layer_types):
        allowed = same & (k <= q)
        window = engine.sliding_window if layer_type == "sliding_attention" else None
        if window is not None:
            allowed = allowed & (q - k < window)
        masks[layer_type] = engine._as_attention_mask(allowed[None, None])
    total = int(positions.shape[0])
    return ChunkContext(0, total, position_ids, engine.rotary(hidden, position_ids), masks)


def finish_pack(engine, pack: PackedPrefill, h: torch.Tensor, listener) -> None:
    """Every member's first token from its last position; the pack's activations go."""
    ends = torch.tensor(pack.offsets[1:], device=engine.device) - 1
    logits = engine.lm_head(engine.norm(h[0, ends]))
    pack.state = None
    for i, task in enumerate(pack.tasks):
        if task.state is None:  # cancelled while the pack was suspended
            continue
        task.state.chunk = len(task.chunks)  # every prompt token is in the cache
        token = sample_next_token(logits[i], task.request.sampling, task.generator)
        task.output_ids.append(token)
        task.phase = Phase.DECODE
        listener.on_first_token(task, token, logits[i])
        if engine.is_done(task):
            engine._free(task)
            task.phase = Phase.FINISHED
