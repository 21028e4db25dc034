"""Linear layers packed for oneDNN: the same products as nn.Linear, wherever a model goes."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from worker.models import LoadedModel, load_model
from worker.packed_linear import PackedLinear, can_pack, pack_linears


def _linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 40, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (8, 96), (2, 37, 96)])
@torch.inference_mode()
def test_a_packed_linear_multiplies_like_the_linear_it_packs(bias, shape):
    plain = _linear(bias)
    packed = PackedLinear.of(plain)
    x = torch.randn(shape)
    assert packed.weight is plain.weight and packed.bias is plain.bias
    torch.testing.assert_close(packed(x), plain(x), rtol=0, atol=1e-5)


@torch.no_grad()  # not inference_mode: its tensors keep no version counter
def test_an_edited_weight_is_repacked_and_another_dtype_is_served_plainly():
    plain = _linear(True)
    packed = PackedLinear.of(plain)
    x = torch.randn(4, 96)
    plain.weight.mul_(2)  # the same Parameter: the packed copy is now stale
    torch.testing.assert_close(packed(x), plain(x), rtol=0, atol=1e-5)
    packed.double()
    torch.testing.assert_close(packed(x.double()), plain.double()(x.double()), rtol=0, atol=0)


def test_only_float32_on_a_cpu_is_packed():
    assert can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)


@torch.inference_mode()
def test_load_model_packs_every_linear_and_the_logits_stay_those_of_nn_linear():
    packed = load_model("tiny-qwen2", device="cpu").model
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    plain = copy.deepcopy(packed)
    for parent in list(plain.modules()):  # back to nn.Linear, over the same weights
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                restored = nn.Linear(child.in_features, child.out_features, bias=False)
                restored.weight, restored.bias = child.weight, child.bias
                setattr(parent, name, restored)
    ids = torch.arange(3, 53).unsqueeze(0)
    torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=0, atol=1e-4)


def test_a_bfloat16_model_keeps_plain_linears():
    model = load_model("tiny-llama", device="cpu", dtype=torch.bfloat16).model
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@torch.inference_mode()
def test_copies_and_saved_modules_pack_their_own_weights(tiny_llama: LoadedModel):
    model = tiny_llama.model
    ids = torch.arange(3, 40).unsqueeze(0)
    expected = model(ids).logits
    copied = copy.deepcopy(model)
    assert type(copied.lm_head) is PackedLinear
    assert copied.lm_head.weight is not model.lm_head.weight
    torch.testing.assert_close(copied(ids).logits, expected, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model.model.layers[0].mlp, buffer)
    buffer.seek(0)
    mlp = torch.load(buffer, weights_only=False)
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(mlp(x), model.model.layers[0].mlp(x), rtol=0, atol=0)


def test_packing_keeps_the_state_dict_and_tied_weights():
    model = nn.ModuleDict({"embed": nn.Embedding(50, 16), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = model["embed"].weight  # tied, as SmolLM2's are
    keys = set(model.state_dict())
    assert pack_linears(model) == 1
    assert type(model["head"]) is PackedLinear
    assert model["head"].weight is model["embed"].weight
    assert set(model.state_dict()) == keys
    assert pack_linears(model) == 0  # already packed: nothing left to replace
