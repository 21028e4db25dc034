"""The attention of one row block of a first chunk, without a mask (CPU, SDPA).

A row block after the first of a chunk attends to the keys before it and, causally, to its own.
In a first chunk SDPA has no causal path for that (its ``is_causal`` aligns queries to key 0),
so the block would get an explicit mask, and on the CPU SDPA's masked kernel reads the mask and
visits every key block: a 4096-token whole-prompt prefill took 1.21x as long in 25 ms blocks as
unsplit (``engine-bench --blocks``), where chunks of 2048 cost nothing. Here the block's
attention is two unmasked calls of the same flash kernel, one over the keys before the block
and one causal over its own keys, merged by their log-sum-exps: the work and the kernel of the
unsplit causal prefill. The projections, rotary embedding and cache update are the module's
own operations in its order (as ``worker.decode_forward`` does for decode steps); results agree
with the model's forward to float32 rounding (the engine's exactness tests).

Used for Llama-shaped layers under SDPA on the CPU, when the chunk's mask is SDPA's causal fast
path (a first chunk, no sliding window in reach); everything else keeps the module's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.decode_forward import llama_shaped, rotate

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fits_engine(engine) -> bool:
    """Whether ``engine`` (a ``PrefillEngine``) can run first-chunk blocks through here."""
    return (
        _FLASH is not None
        and engine.device.type == "cpu"
        and engine.attn_impl == "sdpa"
        and all(llama_shaped(layer) for layer in engine.layers)
    )


def attend_block(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache,
    past: int,
) -> torch.Tensor:
    """``attn``'s output for the rows ``x`` (1, r, hidden) at positions ``past .. past + r``,
    which see every key before them and their own causally; ``cos``/``sin`` are theirs."""
    b, r, _ = x.shape
    d = attn.head_dim
    query = attn.q_proj(x).view(b, r, -1, d).transpose(1, 2)
    key = attn.k_proj(x).view(b, r, -1, d).transpose(1, 2)
    value = attn.v_proj(x).view(b, r, -1, d).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query, key = rotate(query, cos, sin), rotate(key, cos, sin)
    keys, values = cache.update(key, value, attn.layer_idx)  # positions 0 .. past + r
    heads, kv_heads = query.shape[1], keys.shape[1]
    groups = heads // kv_heads
    # Its own keys, causally: few, so each KV head is repeated for its query heads.
    own, own_lse = _FLASH(
        query,
        keys[:, :, past:].repeat_interleave(groups, 1),
        values[:, :, past:].repeat_interleave(groups, 1),
        0.0,
        True,
        scale=attn.scaling,
    )[:2]
    # The keys before it, all visible: a KV head's query heads as its rows, nothing repeated.
    stacked = query.reshape(b, kv_heads, groups * r, d)
    seen, seen_lse = _FLASH(
        stacked, keys[:, :, :past], values[:, :, :past], 0.0, False, scale=attn.scaling
    )[:2]
    seen, seen_lse = seen.reshape(b, heads, r, d), seen_lse.reshape(b, heads, r)
    # Each part weighs by its share of the softmax's denominator: own's share is
    # e^own / (e^own + e^seen), a sigmoid of the difference; one lerp merges them.
    own_share = torch.sigmoid(own_lse - seen_lse).unsqueeze(-1)
    out = torch.lerp(seen.float(), own.float(), own_share)
    return attn.o_proj(out.to(own.dtype).transpose(1, 2).reshape(b, r, -1))
