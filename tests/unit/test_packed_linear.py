"""Linear layers packed for oneDNN: the same products as nn.Linear, wherever a model goes, and
the packed path taken by a batched decode step only."""

from __future__ import annotations

import copy
import io
import subprocess
import sys

import pytest
import torch
from torch import nn

from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.models import LoadedModel, load_model
from worker.packed_linear import (
    PACKED_MAX_ROWS,
    PackedLinear,
    can_pack,
    decode_products,
    pack_linears,
)
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest


def _linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 40, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (8, 96), (2, 9, 96), (2, 37, 96)])
@torch.inference_mode()
def test_a_packed_linear_multiplies_like_the_linear_it_packs(bias, shape):
    plain = _linear(bias)
    packed = PackedLinear.of(plain)
    x = torch.randn(shape)
    assert packed.weight is plain.weight and packed.bias is plain.bias
    with decode_products():
        torch.testing.assert_close(packed(x), plain(x), rtol=0, atol=1e-5)


@torch.no_grad()  # not inference_mode: its tensors keep no version counter
def test_an_edited_weight_is_repacked_and_another_dtype_is_served_plainly():
    plain = _linear(True)
    packed = PackedLinear.of(plain)
    x = torch.randn(4, 96)
    plain.weight.mul_(2)  # the same Parameter: the packed copy is now stale
    with decode_products():
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
    ids = torch.arange(3, 3 + PACKED_MAX_ROWS).unsqueeze(0)  # rows the packed path takes
    with decode_products():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=0, atol=1e-4)


def test_a_bfloat16_model_keeps_plain_linears():
    model = load_model("tiny-llama", device="cpu", dtype=torch.bfloat16).model
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@torch.inference_mode()
def test_copies_and_saved_modules_pack_their_own_weights(tiny_llama: LoadedModel):
    model = tiny_llama.model
    ids = torch.arange(3, 20).unsqueeze(0)
    copied = copy.deepcopy(model)
    assert type(copied.lm_head) is PackedLinear
    assert copied.lm_head.weight is not model.lm_head.weight
    buffer = io.BytesIO()
    torch.save(model.model.layers[0].mlp, buffer)
    buffer.seek(0)
    mlp = torch.load(buffer, weights_only=False)
    x = torch.randn(3, model.config.hidden_size)
    with decode_products():
        torch.testing.assert_close(copied(ids).logits, model(ids).logits, rtol=0, atol=0)
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


_MANY_SHAPES = """
import torch
from torch import nn
from worker.packed_linear import PACKED_MAX_ROWS, PackedLinear, decode_products

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

layer = PackedLinear.of(nn.Linear(512, 512))
others = [PackedLinear.of(nn.Linear(512, 64 + 8 * i)) for i in range(12)]
with torch.inference_mode():
    with decode_products():
        for rows in range(1, PACKED_MAX_ROWS + 1):  # every decode batch size: cached, bounded
            layer(torch.randn(rows, 512))
    before = rss_mb()
    with decode_products():
        for rows in range(PACKED_MAX_ROWS + 1, PACKED_MAX_ROWS + 601):  # more rows than a batch
            layer(torch.randn(rows, 512))
    for other in others:  # outside a decode step (prefills of up to 32 tokens, say)
        for rows in range(1, PACKED_MAX_ROWS + 1):
            other(torch.randn(rows, 512))
print(rss_mb() - before)
"""


def test_only_decode_steps_leave_per_shape_state_behind():
    # oneDNN keeps a primitive (~0.65 MB) per input shape: 600 row counts past a batch, or 384
    # prompt-sized shapes outside a decode step, through the packed path would grow the process
    # by ~400 or ~250 MB; the 60 s soak once showed such growth.
    out = subprocess.run(
        [sys.executable, "-c", _MANY_SHAPES], capture_output=True, text=True, check=True
    )
    growth_mb = float(out.stdout.strip().splitlines()[-1])
    assert growth_mb < 50, growth_mb
    assert PACKED_MAX_ROWS >= 16  # the batched worker's default batch still takes the packed path


def test_the_batched_decode_step_runs_on_the_packed_copies(tiny_llama: LoadedModel):
    model = tiny_llama.model
    engine = BatchEngine(
        model,
        EngineConfig(chunk_size=16),
        BatchConfig(max_batch_size=4, pool_slots=5, slot_tokens=64),
    )
    for i in range(3):
        task = engine.new_task(
            GenerationRequest(f"r{i}", tuple(range(3, 12 + i)), max_new_tokens=8)
        )
        engine.prefill(task, PreemptionChannel())
        engine.join(task)
    with torch.profiler.profile() as prefill_profile:
        engine.prefill(engine.new_task(GenerationRequest("p", (5, 6, 7))), PreemptionChannel())
    with torch.profiler.profile() as step_profile:
        engine.decode_step()
    packed = "mkldnn::_linear_pointwise"
    step_ops = [e.name for e in step_profile.events()]
    # Every product of the step, packed: per layer q/k/v fused, o, gate/up fused and down
    # (worker.decode_forward), then the LM head; none through a plain linear.
    assert step_ops.count(packed) == 4 * len(model.model.layers) + 1
    assert "aten::linear" not in step_ops
    assert packed not in [e.name for e in prefill_profile.events()]  # a prefill: plain
