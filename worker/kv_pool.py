"""A shared KV pool of slots, and the cache views the attention modules write into.

Every admitted request owns one slot: per layer, a region of positions in one tensor of shape
``(slots, num_kv_heads, tokens, head_dim)``. The tensors grow as slots are taken, never ahead
of need: ``slots`` doubles (up to ``num_slots``) when a request finds none free, ``tokens``
grows to the largest request held (prompt + new tokens, at most ``slot_tokens``; while slots
are held it at least doubles, so widenings are few). A pool of one slot goes back to nothing
when it is freed (growing it again copies nothing); a pool of several keeps what it grew, since
growing again would copy the held slots and stall the engine (a demo run had a critical
request's 38-token prefill take 1.3 s while its pool grew behind a 2580-token document). So a
worker of one slot holds what one request needs, as a per-request cache would, and an idle one
holds no KV. Growing means a
new tensor per layer and a copy of the old one into it (at a request's start, never per step):
the decode step needs the batch's slots contiguous in one tensor. That copy stalls the engine
thread for the request that makes the pool grow (on the 2-core machine 0.3-3.5 ms per MiB of
the grown pool, by its load: docs/design.md); ``preallocate`` allocates the full pool at start
instead, as it always was before.

Slots, not pages, because the decode batch is kept in slots ``0 .. B-1``: one decode step then
attends to ``keys[:B, :, :longest]``, a *view* of the pool, with rows of different lengths
masked. Pages
would need a gather of every row's pages into a batch tensor on every step (a copy of all
caches), which plain ``torch`` attention cannot avoid without a paged kernel. The price of slots
is internal fragmentation (a slot is sized for the longest request) and a copy of one request's
filled K/V when the batch is compacted (``swap``) on join, leave or pause, never per step.

Memory accounting is per request: a request holds its whole slot (``slot_bytes``, at the
pool's current width) from its first layer until it is freed; ``worker.memory`` caps what
suspended and paused ones hold.

The pool is zero-filled: masked positions are multiplied by an attention weight of 0, and a
NaN from uninitialised memory would survive that product.
"""

from __future__ import annotations

import torch

from worker.kv_cache import LayerwiseAppend


class PoolFullError(RuntimeError):
    """No free slot: the caller must wait for one, pause or drop a request first."""


class SlotCache(LayerwiseAppend):
    """One request's slot, written by the attention modules during its own prefill.

    Each layer keeps its own fill level (a prefill stopped mid-chunk leaves it uneven), exactly
    like ``worker.kv_cache.LayerwiseKVCache``: both append through ``LayerwiseAppend.update``.
    """

    def __init__(self, pool: KVPool, slot: int, owner: str, tokens: int) -> None:
        self.pool = pool
        self.slot = slot  # changes when the pool compacts the decode batch
        self.owner = owner
        self.filled = [0] * pool.num_layers
        self.capacity = tokens  # what it reserved: the pool is at least this wide while it lives

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slot
        return self.pool.keys[layer_idx][s : s + 1], self.pool.values[layer_idx][s : s + 1]

    @property
    def nbytes(self) -> int:
        return self.pool.slot_bytes

    @property
    def length(self) -> int:
        """Tokens held in every layer (the decode position of the next token)."""
        return min(self.filled)


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        slot_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        preallocate: bool = False,
    ) -> None:
        if num_slots <= 0 or slot_tokens <= 0:
            raise ValueError(
                f"pool needs at least one slot of at least one token, got {num_slots} slots "
                f"of {slot_tokens} tokens"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots  # at most
        self.slot_tokens = slot_tokens  # at most, per slot
        self._dims = (num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        element = torch.empty((), dtype=dtype).element_size()
        self._token_bytes = 2 * num_layers * num_kv_heads * head_dim * element  # K and V
        self._caches: list[SlotCache | None] = [None] * num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.preallocated = preallocate  # full size from the start, never grown or shrunk
        self._resize(*((num_slots, slot_tokens) if preallocate else (0, 0)))

    @property
    def slots_allocated(self) -> int:
        """Slots the tensors hold now (``num_slots`` is the most they may grow to)."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def tokens_allocated(self) -> int:
        """Positions per slot the tensors hold now."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def slot_bytes(self) -> int:
        """One slot's K/V at the pool's current width."""
        return self.tokens_allocated * self._token_bytes

    @property
    def allocated_bytes(self) -> int:
        """What the pool's tensors take now."""
        return self.slots_allocated * self.slot_bytes

    @property
    def used_slots(self) -> int:
        return sum(c is not None for c in self._caches)

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.used_slots

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.slot_bytes

    def allocate(self, owner: str, tokens: int) -> SlotCache:
        """A slot of at least ``tokens`` positions: the highest free one the tensors hold (the
        decode batch grows from slot 0, so a new request rarely sits where the batch will need
        to grow next), else one of the slots the pool grows by."""
        if not 0 < tokens <= self.slot_tokens:
            raise ValueError(f"a slot holds 1 to {self.slot_tokens} tokens, asked {tokens}")
        slot = self._highest_free()
        if slot is None:
            if self.used_slots >= self.num_slots:
                raise PoolFullError(f"all {self.num_slots} KV slots are in use")
            grown = min(self.num_slots, max(1, 2 * self.slots_allocated))
            self._resize(grown, self._tokens_for(tokens))
            slot = self._highest_free()
            assert slot is not None
        elif tokens > self.tokens_allocated:
            self._resize(self.slots_allocated, self._tokens_for(tokens))
        cache = SlotCache(self, slot, owner, tokens)
        self._caches[slot] = cache
        return cache

    def _tokens_for(self, tokens: int) -> int:
        """The width to hold ``tokens``: at least double the current one when slots are held
        (each widening copies the whole pool and stalls the engine, so they are few: a
        logarithmic number over a worker's life), exactly ``tokens`` from empty (a fresh
        allocation copies nothing)."""
        if tokens <= self.tokens_allocated:
            return self.tokens_allocated
        if not self.used_slots:
            return tokens
        return min(self.slot_tokens, max(tokens, 2 * self.tokens_allocated))

    def free(self, cache: SlotCache) -> None:
        if cache.slot >= 0 and self._caches[cache.slot] is cache:
            self._caches[cache.slot] = None
            if self.used_slots == 0 and self.num_slots == 1 and not self.preallocated:
                self._resize(0, 0)  # a one-slot worker idle holds no KV: regrowing copies nothing
        cache.slot = -1  # a freed cache owns nothing: a suspended pack's write to it is skipped

    def _highest_free(self) -> int | None:
        for slot in range(self.slots_allocated - 1, -1, -1):
            if self._caches[slot] is None:
                return slot
        return None

    def _resize(self, slots: int, tokens: int) -> None:
        """New zeroed tensors of ``slots`` x ``tokens``, the old contents copied in (both
        dimensions only grow while a slot is held), one layer at a time to keep the peak low."""
        old_slots, old_tokens = self.slots_allocated, self.tokens_allocated
        keep_slots, keep_tokens = min(slots, old_slots), min(tokens, old_tokens)
        shape = (slots, self._dims[0], tokens, self._dims[1])
        # Normal tensors even when grown inside an engine run (inference mode): the batch is
        # compacted (``swap``) outside one, and an inference tensor cannot be written there.
        with torch.inference_mode(False):
            self._copy_into(shape, keep_slots, keep_tokens)

    def _copy_into(self, shape: tuple[int, ...], keep_slots: int, keep_tokens: int) -> None:
        for tensors in (self.keys, self.values):
            for i in range(self.num_layers):
                grown = torch.zeros(shape, dtype=self._dtype, device=self._device)
                if keep_slots and keep_tokens:
                    grown[:keep_slots, :, :keep_tokens].copy_(
                        tensors[i][:keep_slots, :, :keep_tokens]
                    )
                if i < len(tensors):
                    tensors[i] = grown
                else:
                    tensors.append(grown)

    def owner_of(self, slot: int) -> SlotCache | None:
        return self._caches[slot]

    def swap(self, a: int, b: int) -> None:
        """Exchange the contents and owners of two slots (either may be free)."""
        if a == b:
            return
        ca, cb = self._caches[a], self._caches[b]
        n = max(max(c.filled) if c is not None else 0 for c in (ca, cb))
        if n:
            for tensors in (self.keys, self.values):
                for t in tensors:
                    held = t[a, :, :n].clone()
                    t[a, :, :n].copy_(t[b, :, :n])
                    t[b, :, :n].copy_(held)
        self._caches[a], self._caches[b] = cb, ca
        if ca is not None:
            ca.slot = b
        if cb is not None:
            cb.slot = a


class DecodeStepCache:
    """The cache one decode step of the batch in slots ``0 .. B-1`` writes into.

    Row ``i`` writes its new token's K/V at ``positions[i]`` of slot ``i`` and attends to a view
    of the first ``kv_len`` positions of slots ``0 .. B-1``; the step's mask hides each row's
    positions past its own length.
    """

    def __init__(self, pool: KVPool, positions: torch.Tensor, kv_len: int) -> None:
        self.pool = pool
        self.positions = positions
        self.rows = torch.arange(positions.shape[0], device=positions.device)
        self.kv_len = kv_len

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys[self.rows, :, self.positions] = key_states[:, :, 0]
        values[self.rows, :, self.positions] = value_states[:, :, 0]
        b = self.rows.shape[0]
        return keys[:b, :, : self.kv_len], values[:b, :, : self.kv_len]


class PackedPrefillCache:
    """The cache of a packed prefill: several prompts concatenated into one row.

    Segment ``i`` (tokens ``offsets[i] .. offsets[i+1]`` of the row) is request ``i``'s whole
    prompt; its K/V go to that request's slot. Attention runs over the packed K/V as computed
    (a block-diagonal causal mask keeps the segments apart), so nothing is gathered.
    """

    def __init__(self, caches: list[SlotCache], offsets: list[int]) -> None:
        self.caches = caches
        self.offsets = offsets

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for i, cache in enumerate(self.caches):
            if cache.slot < 0:  # that member was cancelled while the pack was suspended
                continue
            lo, hi = self.offsets[i], self.offsets[i + 1]
            cache.update(key_states[:, :, lo:hi], value_states[:, :, lo:hi], layer_idx)
        return key_states, value_states
