"""The exactness tests run under both attention implementations the engine supports."""

from __future__ import annotations

import pytest

from worker.models import LoadedModel

ATTENTION = ["sdpa", "eager"]


def model_with_attention(request: pytest.FixtureRequest, fixture: str, attn: str) -> LoadedModel:
    """The loaded model of ``fixture`` (``tiny_llama``, ``tiny_qwen2``) with ``attn``
    attention: ``sdpa`` (as loaded) or ``eager``."""
    if attn not in ("sdpa", "eager"):
        raise ValueError(f"unknown attention implementation {attn!r}")
    return request.getfixturevalue(fixture if attn == "sdpa" else f"{fixture}_eager")
