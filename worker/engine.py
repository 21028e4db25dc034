"""The preemptible prefill engine (FlowPrefill's execution side).

Prefill of a ``transformers`` causal LM runs layer by layer over the prompt in chunks of C
tokens. By default (``check="block"``) each operator (a layer's attention half, its MLP half)
runs over row blocks of the chunk that each fit a time budget (``worker.row_blocks``), and the
engine reads the preemption channel between blocks: a stop comes within the budget, whatever C
and whatever a layer costs. Coarser checks remain for the baselines and ablations: at every
layer boundary (``"layer"``), also between the halves (``"half"``), only at chunk ends
(``"chunk"``, the vLLM/Sarathi-style baseline), or never (``"none"``).

A stopped task keeps its KV cache and the current chunk's activations and context
(``worker.task.ExecutionState``), and, stopped between two row blocks, the operator's output
for the rows done; ``run`` on it again continues at the exact block where it stopped, nothing
is recomputed. Any number of tasks may be suspended and resumed in any order,
up to a memory cap (``worker.memory``); past it, or when asked to (``Signal.PREEMPT_DROP``), a
stopped task's state is dropped and it recomputes later (a decoding task recomputes its prompt
and the tokens it produced, and continues: no token is produced twice).

After prefill the first token is sampled (the TTFT event) and the run ends; decoding is the
batched engine's (``worker.batch_engine.BatchEngine.decode_step``), one step for every request
past its first token.

Supported: models shaped like Llama/Qwen2/Mistral (``model.model.layers`` with rotary
embeddings, decoder layers made of input_layernorm/self_attn/post_attention_layernorm/mlp), with
the ``sdpa`` or ``eager`` attention implementation; Qwen2's per-layer ``layer_types`` (full or
sliding-window attention) are respected.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.block_attention import attend_block, fits_engine
from worker.config import EngineConfig
from worker.kv_cache import LayerwiseKVCache
from worker.memory import SuspendedMemory
from worker.preemption import PreemptionChannel, Signal
from worker.request import GenerationRequest, InvalidRequestError
from worker.row_blocks import ATTENTION, MLP, BlockClock, planner_for
from worker.run_ahead import RunAheadLimiter
from worker.sampling import make_generator, sample_next_token
from worker.task import ChunkContext, ExecutionState, Phase, ResumePoint, Task


class RunStatus(enum.Enum):
    PREEMPTED = "preempted"
    PREFILLED = "prefilled"  # first token out, the task waits to decode
    FINISHED = "finished"
    CANCELLED = "cancelled"


# Called at every boundary of a prefill (layers, halves, row blocks); the batched engine slots
# a decode step in there when one is due. Must be cheap when nothing is.
BetweenLayers = Callable[[], None]


@dataclass(frozen=True)
class RunOutcome:
    status: RunStatus
    resume_point: ResumePoint | None = None  # PREEMPTED: where it will continue
    held_bytes: int = 0  # PREEMPTED with state kept: KV + activations now held
    state_dropped: bool = False  # PREEMPTED: state dropped, prefill restarts from token 0


class EngineListener(Protocol):
    """Progress callbacks, called on the engine thread; keep them cheap."""

    def on_chunk_done(self, task: Task, tokens_done: int) -> None: ...
    def on_layers_done(self, task: Task, chunk: int, layers_done: int) -> None: ...
    def on_first_token(self, task: Task, token_id: int, logits: torch.Tensor) -> None: ...
    def on_token(self, task: Task, token_id: int) -> None: ...


class _NoListener:
    def on_chunk_done(self, task: Task, tokens_done: int) -> None:
        pass

    def on_layers_done(self, task: Task, chunk: int, layers_done: int) -> None:
        pass

    def on_first_token(self, task: Task, token_id: int, logits: torch.Tensor) -> None:
        pass

    def on_token(self, task: Task, token_id: int) -> None:
        pass


_NO_LISTENER = _NoListener()


def _boundary(channel: PreemptionChannel | None, between: BetweenLayers | None) -> bool:
    """At an interruption point: True when the prefill must stop here. The channel is read
    first (``None``: this point is not checked), so a decode step never delays a stop; then
    the hook runs (a decode step slotted in, when one is due), and the channel is read again:
    a signal that came during that step stops here, not one block later."""
    if channel is not None and channel.signal is not None:
        return True
    if between is None:
        return False
    between()
    return channel is not None and channel.signal is not None


class PrefillEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = model.eval()
        backbone = getattr(model, "model", None)
        needed = ("layers", "embed_tokens", "norm", "rotary_emb")
        if backbone is None or not all(hasattr(backbone, n) for n in needed):
            raise ValueError(
                f"{type(model).__name__} is not supported by the layer-wise engine: it needs "
                "model.model.{layers, embed_tokens, norm, rotary_emb} (Llama/Qwen2/Mistral family)"
            )
        self.layers = list(backbone.layers)
        self.embed = backbone.embed_tokens
        self.norm = backbone.norm
        self.rotary = backbone.rotary_emb
        self.lm_head = model.lm_head
        cfg = model.config
        self.attn_impl = cfg._attn_implementation
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self.attn_impl!r} unsupported: use sdpa")
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"])
        if len(self.layer_types) == 1:
            self.layer_types *= len(self.layers)
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        self._has_halves = all(hasattr(layer, p) for layer in self.layers for p in parts)
        if self.config.check in ("half", "block") and not self._has_halves:
            raise ValueError(
                f"check={self.config.check!r} needs decoder layers with attention and MLP halves"
            )
        kv_dim = self.num_kv_heads * self.head_dim
        self.blocks = (
            planner_for(
                self.config.preempt_budget_ms, cfg.hidden_size + kv_dim, self.config.block_rows
            )
            if self._has_halves
            else None
        )
        self._block_clock = BlockClock(self.blocks, str(self.device)) if self.blocks else None
        self._unmasked_blocks = self.blocks is not None and fits_engine(self)
        self.memory = SuspendedMemory(self.config.memory_cap_bytes)
        self.run_ahead = RunAheadLimiter.for_device(
            str(self.device), self.config.max_run_ahead_layers
        )

    # ------------------------------------------------------------------ tasks

    def new_task(self, request: GenerationRequest) -> Task:
        """Validate a request and wrap it in a task. Allocates nothing yet."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if not 1 <= request.max_new_tokens <= self.config.max_new_tokens_limit:
            raise InvalidRequestError(
                f"max_new_tokens must be in [1, {self.config.max_new_tokens_limit}], "
                f"got {request.max_new_tokens}"
            )
        if n + request.max_new_tokens > self.max_positions:
            raise InvalidRequestError(
                f"prompt of {n} tokens + {request.max_new_tokens} new tokens exceeds the "
                f"model's context of {self.max_positions} tokens"
            )
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        return Task(
            request=request, chunks=self.chunks_of(n), generator=make_generator(request.sampling)
        )

    def chunks_of(self, n: int) -> tuple[tuple[int, int], ...]:
        """[start, end) of every prefill chunk of an n-token prefill."""
        size = self.config.chunk_size or n
        return tuple((s, min(s + size, n)) for s in range(0, n, size))

    def cancel(self, task: Task) -> None:
        """Cancel a task that is not running (queued or suspended) and free what it holds."""
        self._free(task)
        task.phase = Phase.CANCELLED

    @property
    def suspended_bytes(self) -> int:
        return self.memory.total_bytes

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def run(
        self,
        task: Task,
        channel: PreemptionChannel,
        listener: EngineListener = _NO_LISTENER,
        *,
        between_layers: BetweenLayers | None = None,
    ) -> RunOutcome:
        """Prefill ``task`` up to its first token (``PREFILLED``, or ``FINISHED`` when that
        token ends the request: the batched engine decodes the others), or until the channel
        stops it at a checked boundary.
        The engine clears the signal it acts on; callers clear stale signals before a run.
        """
        if task.phase in (Phase.FINISHED, Phase.CANCELLED):
            raise ValueError(f"task {task.request_id} is already {task.phase.value}")
        self.memory.release(task.request_id)  # running again: no longer counted as suspended
        try:
            if task.phase is Phase.QUEUED:
                task.state = ExecutionState(cache=self._new_cache(task.request))
                task.phase = Phase.PREFILL
            if task.phase is Phase.PREFILL:
                stopped = self._prefill(task, channel, listener, between_layers)
                if stopped is not None:
                    return stopped
            if self.is_done(task):
                self._free(task)
                task.phase = Phase.FINISHED
                return RunOutcome(RunStatus.FINISHED)
            return RunOutcome(RunStatus.PREFILLED)
        except BaseException:
            self._free(task)
            raise
        finally:
            self.run_ahead.drain()

    def _prefill(
        self,
        task: Task,
        channel: PreemptionChannel,
        listener: EngineListener,
        between_layers: BetweenLayers | None = None,
    ) -> RunOutcome | None:
        state = task.state
        assert state is not None
        n_chunks = len(task.chunks)
        check_chunks = self.config.check != "none"
        while state.chunk < n_chunks:
            if state.context is None:
                start, end = task.chunks[state.chunk]
                ids = torch.tensor([task.prefill_ids[start:end]], device=self.device)
                state.hidden = self.embed(ids)
                state.context = self._chunk_context(start, end, state.hidden)
                if self.blocks is not None and (self.config.check == "block" or between_layers):
                    # The row blocks' masks now, not inside the chunk's first blocks, where
                    # no plan counts them (12 ms for a 2048-token chunk over 4000 keys: with
                    # the block, a stop at a chunk's start took 45-98 ms, not 25). Then an
                    # interruption point: the chunk's set-up is a step of its own.
                    for layer_type in set(self.layer_types):
                        if self._needs_block_mask(state.context, layer_type):
                            state.context.block_mask(layer_type, self._additive_mask)
                    if _boundary(channel if check_chunks else None, None):
                        return self._stop(task, channel)
            chunk = state.chunk

            def report(layers_done: int, chunk: int = chunk) -> None:
                listener.on_layers_done(task, chunk, layers_done)

            h = self._run_layers(state, state.cache, channel, report, between_layers)
            if h is None:
                return self._stop(task, channel)
            # Chunk complete: every layer holds its K/V.
            state.chunk += 1
            state.layer = 0
            state.context = None
            state.hidden = None
            if state.chunk == n_chunks:
                if task.output_ids:  # a decoding request recomputed: its next input is known
                    task.phase = Phase.DECODE
                else:
                    self._emit_first_token(task, h, listener)
                return None
            listener.on_chunk_done(task, task.chunks[state.chunk][0])
            # A chunk end is a layer boundary too.
            if _boundary(channel if check_chunks else None, between_layers):
                return self._stop(task, channel)
        raise AssertionError("unreachable: prefill loop ended without emitting the first token")

    def _run_layers(
        self,
        state: ExecutionState,
        cache,
        channel: PreemptionChannel,
        report: Callable[[int], None],
        between_layers: BetweenLayers | None,
        row_blocks: bool = True,
    ) -> torch.Tensor | None:
        """Run the current chunk (``state.hidden``, ``state.context``) from where ``state``
        stands to the last layer. Returns the last layer's output, or None when the channel
        stopped it at a checked boundary (``state`` then says where it stands).
        ``between_layers`` runs at every boundary (a decode step slotted in, when one is due),
        after the check. Operators run in row blocks when stops are time-bounded
        (``check="block"``) or a hook slots steps in, unless ``row_blocks`` is False (a cache
        that takes a whole chunk per layer at once: a pack's halves run whole)."""
        ctx = state.context
        h = state.hidden
        layers, layer_types = self.layers, self.layer_types
        n_layers = len(layers)
        check = self.config.check
        check_layers = check in ("layer", "half", "block")
        check_halves = check in ("half", "block")
        blocked = row_blocks and (check == "block" or between_layers is not None)
        planner = self.blocks if blocked else None
        stop = channel if check == "block" else None
        split_halves = check_halves or planner is not None
        report_every = self.config.progress_every_layers
        report_gap_s = self.config.progress_interval_ms / 1000
        reported_at = time.perf_counter()
        run_ahead = self.run_ahead
        layer_idx = state.layer
        # The hot loop: one call per operator (or row block), one attribute read per boundary.
        while layer_idx < n_layers:
            layer = layers[layer_idx]
            layer_type = layer_types[layer_idx]
            if split_halves:
                if state.half == 0:
                    out = self._attention_half(
                        layer, h, layer_type, ctx, cache, state, planner, stop, between_layers
                    )
                    if out is None:
                        state.hidden, state.layer = h, layer_idx
                        return None
                    h = out
                    if _boundary(channel if check_halves else None, between_layers):
                        state.hidden, state.layer, state.half = h, layer_idx, 1
                        return None
                out = self._mlp_half(layer, h, state, planner, stop, between_layers)
                if out is None:
                    state.hidden, state.layer, state.half = h, layer_idx, 1
                    return None
                h = out
                state.half = 0
            else:
                h = layer(
                    h,
                    attention_mask=ctx.masks[layer_type],
                    position_ids=ctx.position_ids,
                    cache=cache,
                    use_cache=True,
                    position_embeddings=ctx.rotary,
                )
            layer_idx += 1
            run_ahead.layer_done()
            if layer_idx < n_layers:
                if report_every and layer_idx % report_every == 0:
                    now = time.perf_counter()
                    if now - reported_at >= report_gap_s:
                        report(layer_idx)
                        reported_at = now
                if _boundary(channel if check_layers else None, between_layers):
                    state.hidden, state.layer = h, layer_idx
                    return None
        return h

    def is_done(self, task: Task) -> bool:
        """The task has all its tokens, or its last one is an end-of-sequence it stops at."""
        request = task.request
        if len(task.output_ids) >= request.max_new_tokens:
            return True
        return bool(task.output_ids) and request.stop_at_eos and task.output_ids[-1] in self.eos_ids

    # ------------------------------------------------------------------ operators

    def _attention_half(
        self, layer, h, layer_type, ctx: ChunkContext, cache, state, planner, stop, between
    ) -> torch.Tensor | None:
        # Same operations, in the same order, as the decoder layer's own forward. Over row
        # blocks each block appends its K/V and attends to the keys before it, as a chunk of
        # that size would: every row's result is that of the whole chunk.
        normed = layer.input_layernorm(h)
        cos, sin = ctx.rotary
        mask = ctx.masks[layer_type]

        def block(a: int, b: int) -> torch.Tensor:
            if a and mask is None and self._unmasked_blocks:  # a first chunk's later block
                return attend_block(
                    layer.self_attn, normed[:, a:b], cos[:, a:b], sin[:, a:b], cache, a
                )
            out, _ = layer.self_attn(
                hidden_states=normed[:, a:b],
                attention_mask=self._block_mask(mask, ctx, layer_type, a, b),
                position_ids=ctx.position_ids[:, a:b],
                cache=cache,
                use_cache=True,
                position_embeddings=(cos[:, a:b], sin[:, a:b]),
            )
            return out

        return self._row_blocks(ATTENTION, h, ctx.start, block, state, planner, stop, between)

    def _mlp_half(self, layer, h, state, planner, stop, between) -> torch.Tensor | None:
        normed = layer.post_attention_layernorm(h)

        def block(a: int, b: int) -> torch.Tensor:
            return layer.mlp(normed[:, a:b])

        return self._row_blocks(MLP, h, 0, block, state, planner, stop, between)

    def _row_blocks(
        self,
        operator: str,
        residual: torch.Tensor,
        past_keys: int,
        block: Callable[[int, int], torch.Tensor],
        state: ExecutionState,
        planner,
        stop: PreemptionChannel | None,
        between: BetweenLayers | None,
    ) -> torch.Tensor | None:
        """One operator over the rows of ``residual`` (its input stream), in the blocks
        ``planner`` sizes (whole when it is None), from ``state.rows_done``. Between two
        blocks: ``_boundary`` (``stop``: None when stops are not time-bounded). Returns
        ``residual`` plus the operator's output, or None when stopped; ``state`` then keeps the
        rows done and their sums. Each block adds its rows into the result as it ends: one pass
        over them, not a copy and then a whole-chunk add."""
        rows = residual.shape[1]
        if planner is None:
            return residual + block(0, rows)
        a, out = state.rows_done, state.partial
        entered = a
        clock = self._block_clock
        while a < rows:
            if a > entered and _boundary(stop, between):
                state.rows_done, state.partial = a, out
                return None
            b = a + planner.rows(operator, past_keys + a, rows - a)
            clock.start()
            y = block(a, b)
            clock.stop(operator, b - a, past_keys + b)
            if out is None:
                if b == rows:  # one block: the operator fit the budget
                    return residual + y
                out = torch.empty_like(residual)
            torch.add(residual[:, a:b], y, out=out[:, a:b])
            a = b
        state.rows_done, state.partial = 0, None
        return out

    def _needs_block_mask(self, ctx: ChunkContext, layer_type: str) -> bool:
        """Whether row blocks of this chunk slice an explicit mask: not where the chunk takes
        SDPA's causal fast path and later blocks attend unmasked (``attend_block``), which
        spares a 4096-token prompt a 64 MB mask per layer type."""
        return ctx.masks[layer_type] is not None or not self._unmasked_blocks

    def _block_mask(self, mask, ctx: ChunkContext, layer_type: str, a: int, b: int):
        """The chunk's mask for query rows [a, b) against the keys [0, start + b) they see."""
        if a == 0 and b == ctx.end - ctx.start:
            return mask
        # The causal fast path (a first chunk under SDPA) holds for the first block only: a
        # later one has a past, and SDPA's is_causal would align its queries to key 0.
        if mask is None and a == 0:
            return None
        return ctx.block_mask(layer_type, self._additive_mask)[:, :, a:b, : ctx.start + b]

    def _additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as the float one SDPA would make of it in every call (0 where allowed,
        -inf elsewhere): made once per chunk, the blocks slice it (measured: a block's SDPA call
        with a boolean mask of 4096 keys took up to 1.4x as long)."""
        zeros = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return zeros.masked_fill(~allowed, float("-inf"))

    def _emit_first_token(self, task: Task, h: torch.Tensor, listener: EngineListener) -> None:
        logits = self.lm_head(self.norm(h[:, -1:, :]))[0, -1]
        token = sample_next_token(logits, task.request.sampling, task.generator)
        task.output_ids.append(token)
        task.phase = Phase.DECODE
        listener.on_first_token(task, token, logits)

    # ------------------------------------------------------------------ state

    def _chunk_context(self, start: int, end: int, hidden: torch.Tensor) -> ChunkContext:
        """Masks, positions and rotary embeddings of tokens [start, end) against keys [0, end).

        Built before any layer appends this chunk to the cache. Only a first chunk (no past)
        may use SDPA's causal fast path (mask None); with a past, None would let every query
        see every key. Eager attention has no such fast path (None means no mask at all), so
        it always gets one. A single query may attend to all keys when attention is full.
        """
        position_ids = torch.arange(start, end, device=self.device).unsqueeze(0)
        rotary = self.rotary(hidden, position_ids)
        q_len = end - start
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in set(self.layer_types):
            window = self.sliding_window if layer_type == "sliding_attention" else None
            needs_window = window is not None and end > window
            causal_fast_path = start == 0 and self.attn_impl == "sdpa"
            if not needs_window and (causal_fast_path or q_len == 1):
                masks[layer_type] = None
                continue
            q = position_ids[0].unsqueeze(1)
            k = torch.arange(end, device=self.device).unsqueeze(0)
            allowed = k <= q
            if needs_window:
                allowed = allowed & (q - k < window)
            mask = allowed[None, None]
            if self.attn_impl == "eager":  # eager attention adds the mask to the scores
                mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                    ~mask, torch.finfo(self.dtype).min
                )
            masks[layer_type] = mask
        return ChunkContext(start, end, position_ids, rotary, masks)

    def _new_cache(self, request: GenerationRequest) -> LayerwiseKVCache:
        return LayerwiseKVCache(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            capacity=len(request.prompt_ids) + request.max_new_tokens,
            dtype=self.dtype,
            device=self.device,
        )

    def _stop(self, task: Task, channel: PreemptionChannel) -> RunOutcome:
        signal = channel.signal
        channel.clear()
        if signal is Signal.CANCEL:
            self.cancel(task)
            return RunOutcome(RunStatus.CANCELLED)
        task.preemptions += 1
        held = task.held_bytes()
        if signal is Signal.PREEMPT and self.memory.try_hold(task.request_id, held):
            return RunOutcome(
                RunStatus.PREEMPTED, resume_point=task.resume_point(), held_bytes=held
            )
        # Asked to drop (recompute policy) or over the memory cap: its KV is freed and the next
        # run recomputes it. A decoding request keeps the tokens it produced (they reached the
        # client) and its sampler's state: it recomputes its prompt and those tokens, then
        # decodes on exactly where it stopped, producing none of them twice.
        self._free(task)
        task.phase = Phase.QUEUED
        task.chunks = self.chunks_of(len(task.prefill_ids))
        task.recomputes += 1
        return RunOutcome(RunStatus.PREEMPTED, resume_point=task.resume_point(), state_dropped=True)

    def _free(self, task: Task) -> None:
        task.state = None
        self.memory.release(task.request_id)
