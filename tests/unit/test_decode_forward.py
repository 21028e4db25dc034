"""The decode step's own layer forward (worker.decode_forward) against the model's layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.attention import model_with_attention
from worker.batch_engine import BatchEngine
from worker.config import BatchConfig, EngineConfig
from worker.decode_forward import DecodeLayers, FusedProduct
from worker.packed_linear import PACKED_MAX_ROWS
from worker.preemption import PreemptionChannel
from worker.request import GenerationRequest


def _linears(*, bias: tuple[bool, ...]) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(24, 8 * (i + 1), bias=b) for i, b in enumerate(bias)]


@pytest.mark.parametrize("rows", [1, 8, PACKED_MAX_ROWS + 8])  # packed, and plain past the cap
def test_a_fused_product_is_the_products_side_by_side(rows):
    linears = _linears(bias=(True, False, True))
    fused = FusedProduct(linears)
    x = torch.randn(rows, 1, 24)
    with torch.no_grad():
        expected = torch.cat([lin(x) for lin in linears], dim=-1)
        torch.testing.assert_close(fused(x), expected, atol=1e-5, rtol=0)
        linears[1].weight.mul_(2.0)  # an in-place edit: the fused copy is rebuilt
        expected = torch.cat([lin(x) for lin in linears], dim=-1)
        torch.testing.assert_close(fused(x), expected, atol=1e-5, rtol=0)


def _engine(model) -> BatchEngine:
    return BatchEngine(
        model,
        EngineConfig(chunk_size=16),
        BatchConfig(max_batch_size=4, pool_slots=4, slot_tokens=96),
    )


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_decode_step_gives_the_model_layers_logits(request, model_fixture):
    """Rows of different lengths (Qwen2: past its sliding window too), fused and through the
    model's own layers: the same logits."""
    model = request.getfixturevalue(model_fixture).model
    engine = _engine(model)
    assert engine.decode_layers is not None
    for i, n in enumerate((5, 31, 60)):
        task = engine.new_task(GenerationRequest(f"r{i}", tuple(range(3, 3 + n)), 8))
        engine.prefill(task, PreemptionChannel())
        engine.join(task)
    fused = engine.decode_layers
    for _ in range(3):
        rows = [(t, list(t.output_ids), t.state.cache.length) for t in engine.rows]
        step = engine.decode_step()
        for task, outputs, length in rows:  # step again through the model's layers
            task.output_ids[:] = outputs
            task.state.cache.filled = [length] * len(engine.layers)
        engine.decode_layers = None
        plain = engine.decode_step()
        engine.decode_layers = fused
        torch.testing.assert_close(step.logits, plain.logits, atol=1e-4, rtol=0)
        assert step.tokens == plain.tokens


def test_models_it_does_not_cover_keep_their_layers(request, tiny_llama):
    eager = model_with_attention(request, "tiny_llama", "eager").model
    assert _engine(eager).decode_layers is None
    # engines over one model share one fused copy
    assert _engine(tiny_llama.model).decode_layers is DecodeLayers.of(_engine(tiny_llama.model))
