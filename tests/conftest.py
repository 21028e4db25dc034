"""Shared fixtures: the loaded test models, built once per session on CPU in float32.

Session scope because building is the slow part (SmolLM2 most of all) and the engine and model
tests use the same instances. Tests must treat them as read-only: no weight edits, and any
forward hook they register removed before they return.

Every model is loaded with ``sdpa`` attention; ``tiny_llama_eager`` and ``tiny_qwen2_eager`` are
the same weights with ``eager`` attention (copies, so the shared ones stay ``sdpa``), for the
exactness tests that run under both (``tests.attention.model_with_attention``).
"""

from __future__ import annotations

import copy
import os

# Before grpc is imported: the tests start service processes (fork + exec) while other threads
# may be inside gRPC calls (a client reattaching while a queue service restarts). gRPC's fork
# support then runs a pre-fork handler that waits for those calls while the forking thread holds
# the GIL they need: a deadlock. The children exec at once and never use the parent's gRPC, so
# the support is not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest
import torch

from worker.models import LoadedModel, load_model


def _load(name: str) -> LoadedModel:
    return load_model(name, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return _load("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> LoadedModel:
    return _load("tiny-qwen2")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct (converted from its GGUF on first use, ~20 s once)."""
    return _load("smollm2")


def _eager_copy(loaded: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    return LoadedModel(loaded.name, model, loaded.tokenizer, loaded.device, loaded.dtype)


@pytest.fixture(scope="session")
def tiny_llama_eager(tiny_llama: LoadedModel) -> LoadedModel:
    return _eager_copy(tiny_llama)


@pytest.fixture(scope="session")
def tiny_qwen2_eager(tiny_qwen2: LoadedModel) -> LoadedModel:
    return _eager_copy(tiny_qwen2)
