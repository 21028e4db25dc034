"""Model presets, the built-in tokenizer and load_model's error handling."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tierflow.builtin_tokenizer import TOKENIZER_PATH, trained_json
from worker import models
from worker.models import (
    PRESETS,
    GgufPreset,
    LoadedModel,
    ModelLoadError,
    RandomPreset,
    build_random_model,
    check_layerwise_supported,
    ensure_converted,
    load_builtin_tokenizer,
    load_model,
    preset_config,
)

# --- presets ------------------------------------------------------------------------------


def test_presets_are_described_and_keyed_by_their_name():
    assert all(name == preset.name for name, preset in PRESETS.items())
    assert {"tiny-llama", "tiny-qwen2", "bench-llama", "smollm2"} <= set(PRESETS)
    assert all(preset.description for preset in PRESETS.values())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_same_seed_gives_identical_weights_and_another_seed_does_not(name):
    preset = PRESETS[name]
    first = build_random_model(preset)[0].state_dict()
    second = build_random_model(preset)[0].state_dict()
    other = build_random_model(dataclasses.replace(preset, seed=preset.seed + 1))[0].state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert first[weight].std() > 0  # really initialised, not left empty or zero
    assert not torch.equal(first[weight], other[weight])


def test_building_a_preset_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    build_random_model(PRESETS["tiny-llama"])
    assert torch.equal(torch.random.get_rng_state(), state)


def test_tiny_qwen2_mixes_full_and_sliding_attention(tiny_qwen2: LoadedModel):
    config = tiny_qwen2.model.config
    assert config.layer_types[0] == "full_attention"
    assert "sliding_attention" in config.layer_types
    assert len(config.layer_types) == len(tiny_qwen2.model.model.layers)
    assert config.sliding_window == 24


def test_bench_llama_config_is_benchmark_sized():
    preset = PRESETS["bench-llama"]
    assert isinstance(preset, RandomPreset)
    config = preset_config(preset, load_builtin_tokenizer())
    assert (config.num_hidden_layers, config.hidden_size) == (12, 512)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert config.max_position_embeddings >= 8192


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_presets_load_ready_to_serve_and_run_a_forward(request, fixture):
    loaded: LoadedModel = request.getfixturevalue(fixture)
    model = loaded.model
    assert (loaded.device, loaded.dtype) == (torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config.vocab_size == len(loaded.tokenizer)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (2, 200, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_lower_precision_casts_weights_but_keeps_rotary_frequencies_in_float32():
    model = load_model("tiny-llama", device="cpu", dtype=torch.bfloat16).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_a_saved_preset_loads_back_from_its_directory(tmp_path: Path, tiny_llama: LoadedModel):
    tiny_llama.model.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.name == str(tmp_path)
    assert loaded.model.config._attn_implementation == "sdpa"
    expected = tiny_llama.model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())
    assert loaded.tokenizer.encode("hello world") == tiny_llama.tokenizer.encode("hello world")


# --- the built-in tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "What is the capital of France?",
        "  leading spaces, tabs\tand\nnew lines\n",
        "café, naïve, 日本語, emoji 🙂 and a zero-width\u200bjoiner",
        "def f(x: int) -> int:\n    return x ** 2  # square\n",
        "",
    ],
)
def test_builtin_tokenizer_round_trips_text(text):
    tokenizer = load_builtin_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_builtin_tokenizer_special_tokens_and_chat_template():
    tokenizer = load_builtin_tokenizer()
    assert len(tokenizer) == 4096
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.encode("hello")[0] == tokenizer.bos_token_id
    # Common English words are single tokens: the BPE really learned from the corpus.
    assert len(tokenizer.encode(" the capital of", add_special_tokens=False)) == 3
    chat = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"].count(tokenizer.bos_token_id) == 1
    assert load_builtin_tokenizer() is tokenizer  # cached


def test_shipped_tokenizer_is_what_the_corpus_trains():
    # If this fails, the corpus or trainer changed: rerun the training,
    # `python -m tierflow.builtin_tokenizer --train`.
    assert TOKENIZER_PATH.read_text(encoding="utf-8") == trained_json()


# --- errors -------------------------------------------------------------------------------


def test_unknown_name_lists_presets_and_suggests_the_closest():
    with pytest.raises(ModelLoadError) as error:
        load_model("tiny-lama", device="cpu")
    message = str(error.value)
    assert "unknown model 'tiny-lama'" in message
    assert "tiny-llama, tiny-qwen2" in message
    assert "Did you mean 'tiny-llama'?" in message


def test_uncached_hub_id_says_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="offline"):
        load_model("no-such-org/no-such-model", device="cpu")


def test_nonexistent_directory_is_reported_as_such(tmp_path: Path):
    missing = tmp_path / "no" / "model"
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(missing), device="cpu")


def test_directory_without_a_model_is_reported(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path), device="cpu")


def test_unknown_architecture_is_reported(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path), device="cpu")


def test_architecture_the_engine_cannot_drive_is_rejected(tmp_path: Path):
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not supported by the layer-wise engine") as error:
        load_model(str(tmp_path), device="cpu")
    assert "GPT2LMHeadModel" in str(error.value)


def test_check_layerwise_supported_names_what_is_missing(tiny_llama: LoadedModel):
    check_layerwise_supported(tiny_llama.model, "tiny-llama")  # passes
    with pytest.raises(ModelLoadError, match=r"missing lm_head, model\b"):
        check_layerwise_supported(torch.nn.Linear(2, 2), "linear")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model("tiny-llama", device="cuda")


# --- GGUF conversion: locking and atomicity, with a stand-in converter --------------------


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch) -> tuple[GgufPreset, list[Path]]:
    """The smollm2 preset pointed at a temporary cache, with a slow stand-in converter."""
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for a racing caller to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    preset = PRESETS["smollm2"]
    assert isinstance(preset, GgufPreset)
    return preset, calls


def test_racing_conversions_convert_once_and_leave_no_scratch(fake_gguf):
    preset, calls = fake_gguf
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_converted(preset))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    target = results[0]
    assert results == [target] * 3
    assert (target / "config.json").exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []
    ensure_converted(preset)  # already done: no new conversion
    assert len(calls) == 1


def test_failed_conversion_leaves_nothing_half_written(fake_gguf, monkeypatch):
    preset, _ = fake_gguf

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted(preset)
    root = models.models_cache_dir()
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_gguf_package_says_to_run_make_setup(fake_gguf):
    preset, _ = fake_gguf
    with pytest.raises(ModelLoadError, match="make setup"):
        ensure_converted(dataclasses.replace(preset, package="tierflow_no_such_package"))


# --- the real SmolLM2 ---------------------------------------------------------------------


def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel):
    tokenizer = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = smollm2.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
