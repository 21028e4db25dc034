"""The batched engine: a shared KV pool, one decode step for the whole batch, packed prefills.

Built on the preemptible prefill engine (``worker.engine``), whose layer loop, preemption
checks and exact resume it keeps; what it adds:

- every request's KV lives in a slot of one pool (``worker.kv_pool``); a request gets its slot
  when its prefill starts and gives it back when it finishes, fails or is cancelled;
- the decode batch is the requests in slots ``0 .. B-1``; ``decode_step`` is one forward over
  their B new tokens, one call per layer, rows of different lengths kept apart by the mask;
  requests ``join`` after their first token and ``leave`` when done, cancelled or paused,
  between steps; each row samples with its own request's parameters and seeded generator;
  a step may decode some rows only (``decode_step(rows=...)``: a step slotted into a critical
  prefill for the critical rows does not make it wait for the batch tier's rows too);
- ``prefill`` runs one request's prefill (chunked, preemptible) and stops after its first
  token, so the caller joins it to the batch; ``between_layers`` lets the caller slot decode
  steps in at layer boundaries (``worker.decode_slotting``);
- ``run_packed`` prefills several whole prompts in one forward (``worker.packed_prefill``);
- ``pause`` takes a decoding request out of the batch keeping its KV (counted against the
  memory cap like a suspended prefill); past the cap its state is dropped and it recomputes
  its prompt and the tokens it produced, without producing any token again.

All of it runs on one thread (the runner's engine thread), like ``PrefillEngine``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.config import BatchConfig, EngineConfig
from worker.decode_forward import DecodeLayers
from worker.engine import (
    _NO_LISTENER,
    BetweenLayers,
    EngineListener,
    PrefillEngine,
    RunOutcome,
    RunStatus,
)
from worker.kv_pool import DecodeStepCache, KVPool, SlotCache
from worker.packed_linear import decode_products
from worker.packed_prefill import PackedPrefill, finish_pack, start_pack
from worker.preemption import PreemptionChannel, Signal
from worker.request import GenerationRequest, InvalidRequestError
from worker.sampling import sample_next_token
from worker.task import Phase, Task


class BatchFullError(RuntimeError):
    """The decode batch already has ``max_batch_size`` rows."""


@dataclass(frozen=True)
class StepResult:
    """One decode step: row ``i`` of ``logits`` produced ``tokens[i]`` for ``tasks[i]``."""

    tasks: tuple[Task, ...]
    tokens: tuple[int, ...]
    logits: torch.Tensor  # (B, vocab)
    finished: tuple[Task, ...]  # done after this step; they left the batch and freed their slot
    seconds: float = 0.0  # this call's time, set by whoever timed it (``worker.decode_slotting``)
    slotted: bool = False  # run at a layer boundary of a running prefill
    step_seconds: float = 0.0  # the whole step's: a stopped step's parts together


@dataclass
class _StepInProgress:
    """A decode step's rows and activations, up to layer ``next_layer``. Rows that join the
    batch meanwhile take slots after the step's (it reads its rows' slots only, all below the
    batch's size when it started), so a join leaves it valid; a leave moves slots, so it
    abandons the step (``abandon_step``)."""

    rows: tuple[Task, ...]
    lengths: list[int]
    h: torch.Tensor
    position_ids: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    masks: list[torch.Tensor]  # one per layer
    cache: DecodeStepCache
    next_layer: int = 0


class BatchEngine(PrefillEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        batch: BatchConfig | None = None,
    ) -> None:
        super().__init__(model, config)
        self.batch_config = batch or BatchConfig()
        self.pool = KVPool(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_slots=self.batch_config.pool_slots,
            slot_tokens=self.batch_config.slot_tokens or self.max_positions,
            preallocate=self.batch_config.preallocate,
            dtype=self.dtype,
            device=self.device,
        )
        # The decode step's own layer forward (worker.decode_forward), where the model fits it,
        # and packed weights (worker.packed_linear), for a batch of more than one row. Both
        # hold copies of the weights (on a CPU, about one more copy of the layer weights:
        # docs/design.md, "The batched engine"); a worker of batch size 1 serves one request
        # at a time and decodes through the model's own layers, holding no more than a
        # per-request engine would.
        self.fast_decode = self.batch_config.max_batch_size > 1
        self.decode_layers = DecodeLayers.of(self) if self.fast_decode else None
        self.rows: list[Task] = []  # the decode batch: rows[i] owns slot i
        self._pending_step: _StepInProgress | None = None  # stopped mid-step (``decode_step``)

    # ------------------------------------------------------------------ requests

    def new_task(self, request: GenerationRequest) -> Task:
        task = super().new_task(request)
        needed = task.prompt_len + request.max_new_tokens
        if needed > self.pool.slot_tokens:
            raise InvalidRequestError(
                f"request of {needed} tokens (prompt + max_new_tokens) is larger than a KV "
                f"slot of the pool ({self.pool.slot_tokens} tokens)"
            )
        return task

    def prefill(self, task: Task, channel, listener=_NO_LISTENER, between_layers=None):
        """Prefill ``task`` up to its first token (``RunStatus.PREFILLED``), or until stopped."""
        return self.run(task, channel, listener, between_layers=between_layers)

    def cancel(self, task: Task) -> None:
        if self.in_batch(task):
            self._retire(task)
        super().cancel(task)

    @property
    def held_bytes(self) -> int:
        """KV memory owned by requests (all slots in use), running or not."""
        return self.pool.used_bytes

    # ------------------------------------------------------------------ packed prefill

    @torch.inference_mode()
    def run_packed(
        self,
        pack: PackedPrefill,
        channel: PreemptionChannel,
        listener: EngineListener = _NO_LISTENER,
        between_layers: BetweenLayers | None = None,
    ) -> RunOutcome:
        """Prefill every prompt of ``pack`` in one forward, up to each one's first token
        (``PREFILLED``; members whose first token ends them are FINISHED), or until stopped."""
        if pack.state is None:
            start_pack(self, pack)
        for task in pack.tasks:
            self.memory.release(task.request_id)
        state = pack.state
        assert state is not None

        def report(layers_done: int) -> None:
            for task in pack.tasks:
                listener.on_layers_done(task, 0, layers_done)

        try:
            # No row blocks: a pack's cache splits each layer's whole packed row by segment.
            h = self._run_layers(
                state, state.cache, channel, report, between_layers, row_blocks=False
            )
            if h is None:
                return self._stop_pack(pack, channel)
            finish_pack(self, pack, h, listener)
        except BaseException:
            pack.state = None
            for task in pack.tasks:
                self._free(task)
            raise
        finally:
            self.run_ahead.drain()
        return RunOutcome(RunStatus.PREFILLED)

    def _stop_pack(self, pack: PackedPrefill, channel: PreemptionChannel) -> RunOutcome:
        signal = channel.signal
        channel.clear()
        if signal is Signal.CANCEL:
            pack.state = None
            for task in pack.tasks:
                self.cancel(task)
            return RunOutcome(RunStatus.CANCELLED)
        for task in pack.tasks:
            task.preemptions += 1
        held = pack.held_bytes()
        if signal is Signal.PREEMPT and self.memory.try_hold_all(held):
            return RunOutcome(
                RunStatus.PREEMPTED, resume_point=pack.resume_point(), held_bytes=sum(held.values())
            )
        pack.state = None
        for task in pack.tasks:
            self._free(task)
            task.phase = Phase.QUEUED
            task.recomputes += 1
        return RunOutcome(RunStatus.PREEMPTED, resume_point=pack.resume_point(), state_dropped=True)

    # ------------------------------------------------------------------ the batch

    def in_batch(self, task: Task) -> bool:
        return any(row is task for row in self.rows)

    @property
    def pending_rows(self) -> tuple[Task, ...]:
        """The rows of the step stopped at a layer boundary (none when no step is stopped)."""
        return () if self._pending_step is None else self._pending_step.rows

    def join(self, task: Task) -> None:
        """Add a request that has its first token (or was paused) to the decode batch."""
        if task.phase is not Phase.DECODE or task.state is None:
            raise ValueError(f"task {task.request_id} is {task.phase.value}, not ready to decode")
        if self.in_batch(task):
            raise ValueError(f"task {task.request_id} is already in the batch")
        if len(self.rows) >= self.batch_config.max_batch_size:
            raise BatchFullError(f"the decode batch is full ({len(self.rows)} rows)")
        self.pool.swap(self._slot(task), len(self.rows))
        self.rows.append(task)
        self.memory.release(task.request_id)  # decoding again: no longer counted as paused

    def leave(self, task: Task) -> None:
        """Take ``task`` out of the batch; it keeps its slot. The last row fills the gap."""
        self._close_gap(self._row_of(task))

    def _retire(self, task: Task) -> None:
        """Take a row that is done with its K/V (finished, cancelled) out of the batch. Its
        slot is freed first, so the last row's K/V is moved into it one way: nothing of the
        leaver's is copied, and nothing is allocated, in a part of the step that no boundary
        can stop (docs/design.md, "The batched engine")."""
        row = self._row_of(task)
        self._free(task)
        self._close_gap(row)

    def _row_of(self, task: Task) -> int:
        row = self._slot(task)
        if row >= len(self.rows) or self.rows[row] is not task:
            raise ValueError(f"task {task.request_id} is not in the decode batch")
        return row

    def _close_gap(self, row: int) -> None:
        last = len(self.rows) - 1
        self.abandon_step()
        self.pool.swap(row, last)
        self.rows[row] = self.rows[last]
        self.rows.pop()

    def pause(self, task: Task, *, drop_state: bool = False) -> bool:
        """Stop decoding ``task`` for now. True: its KV is kept (resume with ``join``). False:
        asked to, or over the memory cap, its state was dropped; ``prefill`` recomputes its
        prompt and tokens so far (producing none of them again), then ``join``."""
        if self.in_batch(task):
            self.leave(task)
        task.preemptions += 1
        if not drop_state and self.memory.try_hold(task.request_id, task.held_bytes()):
            return True
        self.memory.release(task.request_id)
        self._free(task)
        task.phase = Phase.QUEUED
        task.chunks = self.chunks_of(len(task.prefill_ids))
        task.recomputes += 1
        return False

    @property
    def step_pending(self) -> bool:
        """A decode step stopped at a layer boundary waits to be finished (``decode_step``)."""
        return self._pending_step is not None

    @torch.inference_mode()
    def decode_step(
        self,
        listener: EngineListener = _NO_LISTENER,
        stop: Callable[[], bool] | None = None,
        rows: Sequence[Task] | None = None,
    ) -> StepResult | None:
        """One token for every row of the batch (or for ``rows``, some of its rows, in batch
        order), in one forward. A stopped step is finished with the rows it started with,
        whatever ``rows`` says. ``stop`` is asked at every
        layer boundary (after at least one layer, so every call makes progress): when it says
        so, the step keeps its activations and returns None, and the next call goes on from
        that layer. That bounds the wait for a prefill that arrives mid-step by one layer of
        the step, not the whole step (``worker.batch_runner``)."""
        stepped = tuple(self.rows) if rows is None else tuple(rows)
        if self._pending_step is None and not stepped:
            return StepResult((), (), torch.empty(0), ())
        step = self._pending_step or self._start_step(stepped)
        self._pending_step = None
        products = decode_products() if self.fast_decode else contextlib.nullcontext()
        with products:  # a few rows against every weight: worker.packed_linear
            for index in range(step.next_layer, len(self.layers)):
                if index > step.next_layer and stop is not None and stop():
                    step.next_layer, self._pending_step = index, step
                    return None
                step.h = self._decode_layer(index, step)
            logits = self.lm_head(self.norm(step.h))[:, -1]
        return self._sample_step(step, logits, listener)

    def _start_step(self, rows: tuple[Task, ...]) -> _StepInProgress:
        if not all(self.in_batch(t) for t in rows) or len({id(t) for t in rows}) < len(rows):
            raise ValueError("a decode step's rows must be distinct rows of the batch")
        slots = [self._slot(t) for t in rows]
        lengths = [self._cache(t).length for t in rows]
        positions = torch.tensor(lengths, device=self.device)
        kv_len = max(lengths) + 1
        last = torch.tensor([[t.output_ids[-1]] for t in rows], device=self.device)
        h = self.embed(last)
        position_ids = positions.unsqueeze(1)
        masks = self._step_masks(positions, kv_len)
        return _StepInProgress(
            rows, lengths, h, position_ids, self.rotary(h, position_ids),
            [masks[layer_type] for layer_type in self.layer_types],
            DecodeStepCache(self.pool, positions, kv_len, slots),
        )  # fmt: skip

    def _decode_layer(self, index: int, step: _StepInProgress) -> torch.Tensor:
        if self.decode_layers is not None:  # fused products, few operators
            layer = self.decode_layers.layers[index]
            return layer(step.h, *step.rotary, step.masks[index], step.cache)
        return self.layers[index](
            step.h,
            attention_mask=step.masks[index],
            position_ids=step.position_ids,
            cache=step.cache,
            use_cache=True,
            position_embeddings=step.rotary,
        )

    def _sample_step(self, step: _StepInProgress, logits, listener) -> StepResult:
        tokens = []
        for i, task in enumerate(step.rows):
            self._cache(task).filled = [step.lengths[i] + 1] * len(self.layers)
            token = sample_next_token(logits[i], task.request.sampling, task.generator)
            task.output_ids.append(token)
            tokens.append(token)
            listener.on_token(task, token)
        finished = tuple(t for t in step.rows if self.is_done(t))
        for task in finished:
            self._retire(task)
            task.phase = Phase.FINISHED
        return StepResult(step.rows, tuple(tokens), logits, finished)

    # ------------------------------------------------------------------ internals

    def abandon_step(self) -> None:
        """Drop a stopped step (its rows are about to move, or a caller wants a step of other
        rows first). What it wrote (each row's K/V at
        its next position, in the layers it ran) lies past the row's length, so the mask hides
        it, and the row's next step writes that position again before attending to it."""
        self._pending_step = None

    def _step_masks(self, positions: torch.Tensor, kv_len: int) -> dict[str, torch.Tensor]:
        """Row i's query (at ``positions[i]``) sees keys 0 .. positions[i], within the window."""
        keys = torch.arange(kv_len, device=self.device).unsqueeze(0)
        query = positions.unsqueeze(1)
        masks = {}
        for layer_type in set(self.layer_types):
            allowed = keys <= query
            window = self.sliding_window if layer_type == "sliding_attention" else None
            if window is not None:
                allowed = allowed & (query - keys < window)
            masks[layer_type] = self._as_attention_mask(allowed[:, None, None, :])
        return masks

    def _as_attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """Added to the scores. Eager attention's own minimum; for SDPA -inf, what it turns a
        boolean mask into itself in every layer (once per step here; measured ~15 % of an
        8-row step's attention). Every row sees at least its own new token."""
        lowest = torch.finfo(self.dtype).min if self.attn_impl == "eager" else float("-inf")
        zeros = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return zeros.masked_fill(~allowed, lowest)

    def _new_cache(self, request: GenerationRequest) -> SlotCache:
        return self.pool.allocate(request.request_id, self._tokens_of(request))

    @staticmethod
    def _tokens_of(request: GenerationRequest) -> int:
        """Positions a request's KV may need: its prompt and every token it may produce."""
        return len(request.prompt_ids) + request.max_new_tokens

    def _free(self, task: Task) -> None:
        if task.state is not None and isinstance(task.state.cache, SlotCache):
            self.pool.free(task.state.cache)
        super()._free(task)

    @staticmethod
    def _cache(task: Task) -> SlotCache:
        assert task.state is not None
        cache = task.state.cache
        assert isinstance(cache, SlotCache)
        return cache

    def _slot(self, task: Task) -> int:
        return self._cache(task).slot
