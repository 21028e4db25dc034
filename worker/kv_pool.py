"""A shared KV pool of slots, and the cache views the attention modules write into.

Every admitted request owns one slot: per layer, a region of positions in one tensor of shape
``(slots, num_kv_heads, tokens, head_dim)``. The tensors are full size from the start and never
resized, so nothing is ever copied to make room: an earlier pool that grew as slots were taken
copied itself on each growth and stalled the engine thread for seconds (16 to 24 slots of
bench-llama: 3 s on the 2-core machine), and a critical request waited behind that stall (a
sustained run had a Preempt acknowledged 4.6 s late). On a CPU, memory still follows use: the
tensors are views of anonymous private memory maps, which the OS commits page by page as they
are first written and which read as zeros before (``mmap(2)``: an anonymous mapping is
zero-initialised), and a freed slot's pages are handed back (``MADV_DONTNEED``; they read as
zeros again) once the engine is idle (``release_free``, called by ``worker.batch_runner``).
Not at once: compacting the batch copies a request's K/V into another slot, and a copy into
pages the OS has not committed yet faults on every 4 KiB page. On the 2-core machine, moving
5000 positions of bench-llama took 245 ms into fresh pages against 7.5 ms into committed ones,
and that copy runs inside a decode step (a row that finishes leaves the batch) which a critical
prefill waits for. So a busy worker keeps the pages its requests wrote, an idle one holds no
KV, and a worker of one slot holds what one request needs, as a per-request cache would. On other
devices (a GPU, whose memory is not committed lazily) the pool is allocated, zeroed, at start,
as serving systems do. ``preallocate`` commits a CPU pool's memory at start too (it fails at
start, not mid-run, when the machine lacks it).

Slots, not pages, because the decode batch is kept in slots ``0 .. B-1``: one decode step then
attends to ``keys[:B, :, :longest]``, a *view* of the pool, with rows of different lengths
masked. Pages would need a gather of every row's pages into a batch tensor on every step (a
copy of all caches), which plain ``torch`` attention cannot avoid without a paged kernel. The
price of slots is reserved address space (a slot spans the longest request; untouched pages
cost no memory) and a copy of one request's filled K/V when the batch is compacted (``swap``)
on join, leave or pause, never per step.

Memory accounting is per request: a request holds what it reserved (prompt + new tokens) from
its first layer until it is freed; ``worker.memory`` caps what suspended and paused ones hold.

Masked positions must hold finite numbers: they are multiplied by an attention weight of 0, and
a NaN would survive that product. Never-written and handed-back pages read as zeros, and a
reused slot holds its last owner's finite K/V.
"""

from __future__ import annotations

import mmap

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
        self.capacity = tokens  # what it reserved

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slot
        return self.pool.keys[layer_idx][s : s + 1], self.pool.values[layer_idx][s : s + 1]

    @property
    def nbytes(self) -> int:
        """What it reserved: the most its K/V can take."""
        return self.capacity * self.pool.token_bytes

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
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens  # per slot
        self._element = torch.empty((), dtype=dtype).element_size()
        self.token_bytes = 2 * num_layers * num_kv_heads * head_dim * self._element  # K and V
        self._caches: list[SlotCache | None] = [None] * num_slots
        # Free slots whose pages may still be committed: positions written, handed back by
        # ``release_free`` (a lazy pool only).
        self._retained: dict[int, int] = {}
        shape = (num_slots, num_kv_heads, slot_tokens, head_dim)
        self.lazy = torch.device(device).type == "cpu" and not preallocate
        self._maps: list[mmap.mmap] = []  # a lazy pool's memory, one map per tensor
        self.keys = [self._tensor(shape, dtype, device) for _ in range(num_layers)]
        self.values = [self._tensor(shape, dtype, device) for _ in range(num_layers)]

    def _tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        if not self.lazy:
            return torch.zeros(shape, dtype=dtype, device=device)
        size = torch.Size(shape).numel() * self._element
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous: reads as zeros
        self._maps.append(memory)
        return torch.frombuffer(memory, dtype=dtype).view(shape)

    @property
    def slot_bytes(self) -> int:
        """The most one slot's K/V can take."""
        return self.slot_tokens * self.token_bytes

    @property
    def allocated_bytes(self) -> int:
        """KV memory the pool holds now: the whole pool when it is not lazy, else what the
        live requests reserved and what freed slots wrote until it is handed back."""
        if not self.lazy:
            return self.num_slots * self.slot_bytes
        return self.used_bytes + sum(self._retained.values()) * self.token_bytes

    @property
    def retained_slots(self) -> int:
        """Free slots whose memory ``release_free`` has still to hand back."""
        return len(self._retained)

    @property
    def used_slots(self) -> int:
        return sum(c is not None for c in self._caches)

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.used_slots

    @property
    def used_bytes(self) -> int:
        return sum(c.nbytes for c in self._caches if c is not None)

    def allocate(self, owner: str, tokens: int) -> SlotCache:
        """A slot for ``tokens`` positions: the highest free one (the decode batch grows from
        slot 0, so a new request rarely sits where the batch will need to grow next)."""
        if not 0 < tokens <= self.slot_tokens:
            raise ValueError(f"a slot holds 1 to {self.slot_tokens} tokens, asked {tokens}")
        slot = next((s for s in reversed(range(self.num_slots)) if self._caches[s] is None), None)
        if slot is None:
            raise PoolFullError(f"all {self.num_slots} KV slots are in use")
        cache = SlotCache(self, slot, owner, tokens)
        self._caches[slot] = cache
        self._retained.pop(slot, None)  # its pages are the new owner's
        return cache

    def free(self, cache: SlotCache) -> None:
        """Free the cache's slot; its memory stays committed until ``release_free``."""
        if cache.slot >= 0 and self._caches[cache.slot] is cache:
            self._caches[cache.slot] = None
            self._retain(cache.slot, max(cache.filled, default=0))
        cache.slot = -1  # a freed cache owns nothing: a suspended pack's write to it is skipped

    def release_free(self) -> None:
        """Hand every free slot's memory back to the OS (a lazy pool; the engine is idle)."""
        for slot in self._retained:
            self._hand_back(slot)
        self._retained.clear()

    def _retain(self, slot: int, positions: int) -> None:
        if self.lazy and positions:
            self._retained[slot] = max(self._retained.get(slot, 0), positions)

    def _hand_back(self, slot: int) -> None:
        """Return a free slot's memory to the OS: its pages read as zeros again and are
        committed anew when the next owner writes them. Only whole pages inside the slot's
        region: its first and last page may be shared with a neighbour."""
        span = len(self._maps[0]) // self.num_slots  # every map holds num_slots equal slots
        page = mmap.PAGESIZE
        start = -(-slot * span // page) * page
        end = (slot + 1) * span // page * page
        if end > start:
            for memory in self._maps:
                memory.madvise(mmap.MADV_DONTNEED, start, end - start)

    def owner_of(self, slot: int) -> SlotCache | None:
        return self._caches[slot]

    def swap(self, a: int, b: int) -> None:
        """Exchange the contents and owners of two slots (either may be free). With one free,
        the owned one's K/V is moved into it: one copy of what it wrote, nothing allocated."""
        if a == b:
            return
        ca, cb = self._caches[a], self._caches[b]
        n = max(max(c.filled) if c is not None else 0 for c in (ca, cb))
        both_owned = ca is not None and cb is not None
        # Else a one-way move into the free slot: its stale contents matter to no one (finite,
        # and masked until its next owner overwrites them).
        source, target = (a, b) if cb is None else (b, a)
        for t in (*self.keys, *self.values) if n else ():
            if both_owned:
                held = t[a, :, :n].clone()
                t[a, :, :n].copy_(t[b, :, :n])
                t[b, :, :n].copy_(held)
            else:
                t[target, :, :n].copy_(t[source, :, :n])
        self._caches[a], self._caches[b] = cb, ca
        if ca is not None:
            ca.slot = b
        if cb is not None:
            cb.slot = a
        for slot in (a, b):  # a free one now holds what the other held; an owned one is its
            if self._caches[slot] is None:
                self._retain(slot, n)
            else:
                self._retained.pop(slot, None)


class DecodeStepCache:
    """The cache one decode step of rows of the batch writes into.

    Row ``i`` writes its new token's K/V at ``positions[i]`` of slot ``slots[i]`` and attends to
    the first ``kv_len`` positions of those slots; the step's mask hides each row's positions
    past its own length. The whole batch (slots ``0 .. B-1``) is a view of the pool; some of its
    rows (a step slotted into a prefill for the rows as tight as it) are gathered, a copy of
    their ``kv_len`` positions per layer (about 1.4 ms a step for three rows of 900 positions of
    bench-llama, against about 3.5 ms a step for each row more, and nothing on a join or leave).
    """

    def __init__(
        self, pool: KVPool, positions: torch.Tensor, kv_len: int, slots: list[int] | None = None
    ) -> None:
        self.pool = pool
        self.positions = positions
        b = positions.shape[0]
        slots = list(range(b)) if slots is None else slots
        self.prefix = slots == list(range(b))  # the whole batch: a view
        self.rows = torch.tensor(slots, device=positions.device)
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
        if self.prefix:
            b = self.rows.shape[0]
            return keys[:b, :, : self.kv_len], values[:b, :, : self.kv_len]
        n, rows = self.kv_len, self.rows
        return keys[:, :, :n].index_select(0, rows), values[:, :, :n].index_select(0, rows)


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
