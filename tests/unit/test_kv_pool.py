"""The KV pool grows as slots are taken and keeps what its slots hold while it grows."""

from __future__ import annotations

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


def test_an_idle_one_slot_pool_holds_nothing_and_one_request_holds_only_its_own_tokens():
    kv = pool(slots=1)
    assert kv.allocated_bytes == 0
    cache = kv.allocate("a", 30)
    assert (kv.slots_allocated, kv.tokens_allocated) == (1, 30)
    assert kv.allocated_bytes == 30 * TOKEN_BYTES == kv.used_bytes
    kv.free(cache)
    assert kv.allocated_bytes == 0 and kv.used_slots == 0


def test_growing_slots_and_tokens_keeps_every_slot_contents():
    kv = pool()
    a = kv.allocate("a", 10)
    fill(a, 10, 1.0)
    b = kv.allocate("b", 40)  # a second slot, and wider: both dimensions grow
    fill(b, 25, 2.0)
    c = kv.allocate("c", 5)  # slots double: 2 -> 4
    fill(c, 5, 3.0)
    assert (kv.slots_allocated, kv.tokens_allocated) == (4, 40)
    for cache, n, value in ((a, 10, 1.0), (b, 25, 2.0), (c, 5, 3.0)):
        for layer in range(LAYERS):
            keys, values = cache.buffers(layer)
            assert torch.equal(keys[:, :, :n], torch.full((1, HEADS, n, HEAD_DIM), value))
            assert torch.equal(values[:, :, :n], -keys[:, :, :n])
            assert not keys[:, :, n:].any()  # zero past what it wrote
    kv.swap(a.slot, 0)  # compacting the batch still works on grown tensors
    assert kv.owner_of(0) is a


def test_the_pool_grows_to_its_limit_and_refuses_past_it():
    kv = pool(slots=3, slot_tokens=50)
    caches = [kv.allocate(name, 20) for name in "abc"]
    assert kv.slots_allocated == 3 and kv.free_slots == 0
    with pytest.raises(PoolFullError, match="KV slots are in use"):
        kv.allocate("d", 20)
    with pytest.raises(ValueError, match="1 to 50 tokens"):
        kv.allocate("e", 51)
    grown = kv.allocated_bytes
    for cache in caches:
        kv.free(cache)
    # A pool of several slots keeps what it grew: growing again would copy and stall.
    assert kv.allocated_bytes == grown and kv.used_slots == 0


def test_a_preallocated_pool_is_full_size_from_the_start_and_stays_so():
    kv = pool(slots=3, slot_tokens=50, preallocate=True)
    full = 3 * 50 * TOKEN_BYTES
    assert kv.allocated_bytes == full
    caches = [kv.allocate(name, 10) for name in "ab"]
    fill(caches[0], 10, 1.0)
    assert kv.allocated_bytes == full  # nothing grows
    for cache in caches:
        kv.free(cache)
    assert kv.allocated_bytes == full and kv.used_slots == 0  # nor shrinks
