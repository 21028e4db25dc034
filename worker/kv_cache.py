"""A preallocated, per-layer KV cache that the transformers attention modules write into.

Why not ``transformers.DynamicCache``: its ``update`` concatenates, so prefilling a prompt in
many chunks copies the whole cache once per chunk (quadratic in the number of chunks). Here every
layer owns one buffer sized for the whole request (prompt + new tokens), ``update`` writes the new
keys/values in place and returns views of the filled prefix.

Each layer keeps its own fill level. A task preempted in the middle of a chunk leaves the cache
uneven (early layers already hold the chunk, later ones do not); that is exactly the state to
resume from, which is also why the engine never asks this cache for "the" sequence length.
Attention modules of the supported families (Llama, Qwen2, Mistral) only call ``update``.
"""

from __future__ import annotations

import torch


class LayerwiseAppend:
    """What every per-request cache here shares: one fill level per layer, and an ``update``
    that writes a chunk's K/V in place after it and returns views of the layer's filled prefix.
    A subclass says where a layer's buffers are (``buffers``) and how many positions they hold
    (``capacity``)."""

    filled: list[int]
    capacity: int

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This request's (keys, values) of one layer, shaped (1, heads, capacity, head_dim)."""
        raise NotImplementedError

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        **_: object,  # transformers passes its attention kwargs; none matter here
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this chunk's K/V (batch 1) for one layer; return all K/V of that layer so far."""
        start = self.filled[layer_idx]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow at layer {layer_idx}: {end} > {self.capacity}")
        keys, values = self.buffers(layer_idx)
        keys[:, :, start:end].copy_(key_states)
        values[:, :, start:end].copy_(value_states)
        self.filled[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]


class LayerwiseKVCache(LayerwiseAppend):
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.filled = [0] * num_layers
        self.capacity = capacity

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
