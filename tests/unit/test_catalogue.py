"""The light model catalogue: no torch on the services' side, and the same tokens as the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow import tokenizer as text_tokenizer
from tierflow.catalogue import PRESETS, ModelLoadError, load_model_info
from worker.models import LoadedModel, load_builtin_tokenizer

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    " a leading space,  two spaces and a trailing one ",
    "naïve café, 東京, emoji 🎉\n\ttabs and\r\nnewlines",
    "<|im_start|>user\nspecial tokens in the text<|im_end|>",
    "def f(x):\n    return x ** 2  # code\n",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# Modules that mean the model stack was loaded: torch itself, and transformers' model code.
HEAVY = ("torch", "transformers", "transformers.modeling_utils", "accelerate", "safetensors.torch")


def test_services_import_and_read_the_catalogue_without_torch():
    """The queue service, the gateway and the client, imported in a fresh interpreter, load no
    torch and no transformers, even once the queue service has read a model's tokenizer, and
    do not change the process environment (HF_HUB_OFFLINE is the worker's business)."""
    script = f"""
import json, os, sys
before = dict(os.environ)
import queue_service.server, gateway.server, openai_api.server, tierflow.client
from tierflow.catalogue import load_model_info
infos = [load_model_info(name) for name in ("tiny-llama", "smollm2")]
print(json.dumps({{
    "heavy": sorted(m for m in {list(HEAVY)!r} if m in sys.modules),
    "worker": sorted(m for m in sys.modules if m == "worker" or m.startswith("worker.")),
    "env_changed": sorted(k for k in set(before) | set(os.environ)
                          if before.get(k) != os.environ.get(k)),
    "vocab": [i.vocab_size for i in infos],
}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"heavy": [], "worker": [], "env_changed": [], "vocab": [4096, 49152]}


def test_random_presets_share_the_builtin_tokenizer_and_their_context_length():
    info = load_model_info("bench-llama")
    assert info.max_positions == PRESETS["bench-llama"].max_position_embeddings == 8192
    assert info.vocab_size == len(info.tokenizer) == len(load_builtin_tokenizer())
    _assert_same_tokens(info.tokenizer, load_builtin_tokenizer())


def test_smollm2_from_its_gguf_matches_the_converted_model(smollm2: LoadedModel):
    info = load_model_info("smollm2")
    assert info.vocab_size == smollm2.model.config.vocab_size
    assert info.max_positions == smollm2.model.config.max_position_embeddings
    _assert_same_tokens(info.tokenizer, smollm2.tokenizer)


def test_a_model_directory_reads_its_saved_tokenizer_and_config(
    tmp_path: Path, tiny_llama: LoadedModel
):
    tiny_llama.model.config.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    info = load_model_info(str(tmp_path))
    assert (info.vocab_size, info.max_positions) == (4096, 4096)
    _assert_same_tokens(info.tokenizer, tiny_llama.tokenizer)


def test_unknown_models_are_clear_errors(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_info(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="Did you mean 'tiny-llama'"):
        load_model_info("tiny-lama")


def _assert_same_tokens(light: text_tokenizer.TextTokenizer, reference) -> None:
    """Same ids, same decoded text and the same chat prompt as the transformers tokenizer."""
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert light.encode(text) == ids, text
        assert light.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
        assert light.decode(ids) == reference.decode(ids)
    rendered = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert light.render_chat(CHAT, add_generation_prompt=True) == rendered
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    assert light.apply_chat_template(CHAT, add_generation_prompt=True) == list(
        expected["input_ids"]
    )
