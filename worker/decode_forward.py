"""The batched decode step's own forward of a decoder layer: fused products, few operators.

Why: a decode step runs every layer over B rows of one token each, so the work per operator is
small and the overhead per operator is not. Through the ``transformers`` modules a layer of
bench-llama is ~55 tensor operators and ~25 module calls, and on the 2-core development
machine everything but the weight products and attention took about a third of an 8-row step
(profile: 16 ms products, 6 ms attention, 7 ms other operators and ~5 ms of Python, in 36 ms).
``DecodeLayer`` computes the same layer (Llama/Qwen2/Mistral shape, SDPA attention) with:

- q, k and v in one product, and gate and up in one product: their weights concatenated once
  (``FusedProduct``: packed for oneDNN like ``worker.packed_linear`` where that applies);
- rotary embedding applied to the q and k heads together, on a view of the fused product;
- grouped-query attention by SDPA with the query heads of one KV head as that head's rows (a
  single query token), as ``transformers`` does for one token, so no K/V is repeated;
- RMSNorm by ``torch.nn.functional.rms_norm`` (one call instead of six in Python).

The operations and their order are the layer's own; the results agree to float32 rounding
(the engine's exactness tests hold them to 1e-4 against ``generate``). A fused copy is made
from the weights as they are; a later in-place edit of one of them (its version counter moves)
rebuilds it. Models or settings it does not cover (eager attention, other layer shapes) keep
the ``transformers`` layers (``DecodeLayers.of`` returns None).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from worker.packed_linear import PACKED_MAX_ROWS, can_pack, weight_version

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class FusedProduct:
    """``x @ cat(W_1 .. W_n).T + cat(b_1 .. b_n)`` for the linears given, in one product."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self._build()

    def _versions(self) -> tuple[int, ...]:
        tensors = [t for lin in self.linears for t in (lin.weight, lin.bias) if t is not None]
        return tuple(weight_version(t) for t in tensors)

    def _build(self) -> None:
        linears, first = self.linears, self.linears[0].weight
        with torch.no_grad():
            biased = any(lin.bias is not None for lin in linears)
            self.bias = torch.cat([_bias(lin) for lin in linears]) if biased else None
            self.packed = (
                torch.ops.mkldnn._reorder_linear_weight(self._concatenated(), None)
                if can_pack(first.device, first.dtype)
                else None
            )
        self._plain = None  # the weight of a plain product, made when one needs it
        self.built_from = self._versions()

    def _concatenated(self) -> torch.Tensor:
        return torch.cat([lin.weight.detach() for lin in self.linears])

    def _plain_weight(self) -> torch.Tensor:
        if self._plain is None:
            one = len(self.linears) == 1
            self._plain = self.linears[0].weight if one else self._concatenated()
        return self._plain

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._versions() != self.built_from:
            self._build()
        if (
            self.packed is not None
            and x.numel() // x.shape[-1] <= PACKED_MAX_ROWS
            and x.dtype == self.packed.dtype
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self._plain_weight(), self.bias)


def _bias(linear: nn.Linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias.detach()
    return torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)


class DecodeLayer:
    """One decoder layer's forward for a decode step: B rows, one new token each."""

    def __init__(self, layer: nn.Module, layer_idx: int, num_kv_heads: int, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = layer_idx
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv = FusedProduct([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = FusedProduct([attn.o_proj])
        self.gate_up = FusedProduct([mlp.gate_proj, mlp.up_proj])
        self.down = FusedProduct([mlp.down_proj])
        self.act = mlp.act_fn
        self.scaling = attn.scaling
        self.kv_heads, self.head_dim = num_kv_heads, head_dim
        self.q_heads = attn.q_proj.out_features // head_dim
        self.intermediate = mlp.gate_proj.out_features

    def __call__(self, h: torch.Tensor, cos, sin, mask: torch.Tensor, cache) -> torch.Tensor:
        """``h``: (B, 1, hidden); ``cos``/``sin``: (B, 1, head_dim); ``mask``: (B, 1, 1, L)."""
        b, d, kv, q = h.shape[0], self.head_dim, self.kv_heads, self.q_heads
        qkv = self.qkv(_rms_norm(h, self.input_norm))
        qk = rotate(qkv[..., : (q + kv) * d].view(b, q + kv, d), cos, sin)
        query = qk[:, :q].view(b, kv, q // kv, d)  # a KV head's query heads as its rows
        keys, values = cache.update(
            qk[:, q:].view(b, kv, 1, d),
            qkv[..., (q + kv) * d :].view(b, kv, 1, d),
            self.layer_idx,
        )
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scaling
        )
        h = h + self.o(attn.reshape(b, 1, q * d))
        gate, up = self.gate_up(_rms_norm(h, self.post_norm)).split(self.intermediate, dim=-1)
        return h + self.down(self.act(gate) * up)


def llama_shaped(layer: nn.Module) -> bool:
    """A Llama-shaped decoder layer: linear q/k/v/o, gate/up/down MLP, RMSNorms, no q/k norm."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (
        all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTENTION)
        and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP)
        and hasattr(mlp, "act_fn")
        and hasattr(attn, "scaling")
        and not any(hasattr(attn, n) for n in ("q_norm", "k_norm"))
        and all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms)
    )


def _rms_norm(h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return F.rms_norm(h, norm.weight.shape, norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of every head of ``x`` (..., d), as ``apply_rotary_pos_emb``; ``cos``
    and ``sin`` broadcast against it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# One set per model: engines over the same model (a benchmark builds several) share the fused
# copies instead of each holding its own.
_OF_MODEL: weakref.WeakKeyDictionary[nn.Module, DecodeLayers] = weakref.WeakKeyDictionary()


class DecodeLayers:
    """Every layer of a model as a ``DecodeLayer``, when the model's layers all fit."""

    def __init__(self, layers: list[DecodeLayer]) -> None:
        self.layers = layers

    @classmethod
    def of(cls, engine) -> DecodeLayers | None:
        """For ``engine`` (a ``PrefillEngine``): None unless every layer has the Llama shape,
        attention is SDPA and the norms are RMSNorms. Engines over one model share one."""
        if engine.model in _OF_MODEL:
            return _OF_MODEL[engine.model]
        if engine.attn_impl != "sdpa" or not all(llama_shaped(layer) for layer in engine.layers):
            return None
        layers = cls(
            [
                DecodeLayer(layer, i, engine.num_kv_heads, engine.head_dim)
                for i, layer in enumerate(engine.layers)
            ]
        )
        _OF_MODEL[engine.model] = layers
        return layers
