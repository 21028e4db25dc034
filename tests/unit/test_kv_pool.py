"""The KV pool: full size from the start, committed as written, handed back when freed."""

from __future__ import annotations

import mmap

import pytest
import torch

from worker.kv_pool import KVPool, PoolFullError

LAYERS, HEADS, HEAD_DIM = 2, 3, 4
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 4  # K and V of one position, float32


def pool(slots: int = 4, slot_tokens: int = 100, preallocate: bool = False) -> KVPool:
    return KVPool(
        preallocate=preallocate,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        num_slots=slots,
        slot_tokens=slot_tokens,
        dtype=torch.float32,
        device="cpu",
    )


def fill(cache, n: int, value: float) -> None:
    for layer in range(LAYERS):
        kv = torch.full((1, HEADS, n, HEAD_DIM), value)
        cache.update(kv, -kv, layer)


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_an_idle_pool_holds_nothing_and_a_request_holds_what_it_reserved():
    kv = pool(slots=3)
    assert kv.allocated_bytes == 0 and kv.lazy
    a, b = kv.allocate("a", 30), kv.allocate("b", 70)
    assert kv.allocated_bytes == 100 * TOKEN_BYTES == kv.used_bytes
    kv.free(a)
    assert kv.allocated_bytes == 70 * TOKEN_BYTES
    kv.free(b)
    assert kv.allocated_bytes == 0 and kv.used_slots == 0


def test_slots_are_zero_until_written_and_keep_their_contents_beside_each_other():
    kv = pool()
    a, b, c = kv.allocate("a", 10), kv.allocate("b", 40), kv.allocate("c", 5)
    for cache, n, value in ((a, 10, 1.0), (b, 25, 2.0), (c, 5, 3.0)):
        fill(cache, n, value)
    for cache, n, value in ((a, 10, 1.0), (b, 25, 2.0), (c, 5, 3.0)):
        for layer in range(LAYERS):
            keys, values = cache.buffers(layer)
            assert torch.equal(keys[:, :, :n], torch.full((1, HEADS, n, HEAD_DIM), value))
            assert torch.equal(values[:, :, :n], -keys[:, :, :n])
            assert not keys[:, :, n:].any()  # zero past what it wrote
    kv.swap(a.slot, 0)  # compacting the batch
    assert kv.owner_of(0) is a and torch.equal(
        a.buffers(0)[0][:, :, :10], torch.ones(1, HEADS, 10, HEAD_DIM)
    )


def test_a_freed_slot_keeps_its_memory_until_released_then_reads_as_zeros():
    """Large enough that a slot spans many pages: resident memory rises by about the slot
    when it is written, stays when it is freed (the busy engine may copy a row into it
    without faulting its pages in again), and falls back when the pool is released."""
    kv = KVPool(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, num_slots=2,
        slot_tokens=100_000, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    slot_bytes = 100_000 * TOKEN_BYTES  # 19 MiB
    before = resident_bytes()
    cache = kv.allocate("a", 100_000)
    fill(cache, 100_000, 1.0)
    written = resident_bytes()
    assert written - before > 0.8 * slot_bytes
    kv.free(cache)
    assert abs(written - resident_bytes()) < 0.2 * slot_bytes
    assert kv.retained_slots == 1 and kv.allocated_bytes == slot_bytes
    kv.release_free()
    assert written - resident_bytes() > 0.8 * slot_bytes
    assert kv.retained_slots == 0 and kv.allocated_bytes == 0
    again = kv.allocate("b", 10)
    edge = 2 * mmap.PAGESIZE // 4  # floats of the two pages a slot may share with neighbours
    for layer in range(LAYERS):
        for tensor in again.buffers(layer):
            assert 0 < tensor.numel() - edge <= int((tensor == 0).sum())


def test_a_free_slot_a_row_was_moved_out_of_counts_until_released():
    """Compacting moves a request's K/V out of its slot into a free one: the slot left
    behind holds what was moved, and the pool counts it until it hands it back."""
    kv = pool(slots=3)
    row = kv.allocate("row", 40)
    fill(row, 30, 1.0)
    kv.swap(row.slot, 0)  # joining the batch at row 0
    assert row.slot == 0 and kv.retained_slots == 1
    assert kv.allocated_bytes == (40 + 30) * TOKEN_BYTES
    kv.free(row)
    assert kv.retained_slots == 2 and kv.allocated_bytes == 2 * 30 * TOKEN_BYTES
    assert kv.allocate("next", 10).slot == 2  # an owned slot is no longer counted as freed
    assert kv.allocated_bytes == (10 + 30) * TOKEN_BYTES
    kv.release_free()
    assert kv.allocated_bytes == 10 * TOKEN_BYTES and kv.retained_slots == 0


def test_the_pool_refuses_past_its_slots_and_width():
    kv = pool(slots=3, slot_tokens=50)
    caches = [kv.allocate(name, 20) for name in "abc"]
    assert kv.free_slots == 0
    with pytest.raises(PoolFullError, match="KV slots are in use"):
        kv.allocate("d", 20)
    with pytest.raises(ValueError, match="1 to 50 tokens"):
        kv.allocate("e", 51)
    kv.free(caches[1])
    assert kv.allocate("d", 20).slot == 1  # a freed slot serves the next request


def test_a_preallocated_pool_holds_its_whole_size_from_the_start():
    kv = pool(slots=3, slot_tokens=50, preallocate=True)
    full = 3 * 50 * TOKEN_BYTES
    assert kv.allocated_bytes == full and not kv.lazy
    caches = [kv.allocate(name, 10) for name in "ab"]
    fill(caches[0], 10, 1.0)
    for cache in caches:
        kv.free(cache)
    assert kv.allocated_bytes == full and kv.used_slots == 0
