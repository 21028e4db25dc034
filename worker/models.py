"""Loading the weights the engine serves: presets, local directories and hub ids.

Which models there are (the presets), and their tokenizers and limits, are in the shared
catalogue (``tierflow.catalogue``), which the queue service reads too without torch. This module
is the worker's part: it builds or loads the weights, and converts the ``smollm2`` GGUF once to a
safetensors directory in the tierflow cache (later loads read that directory).

Every model is loaded with ``attn_implementation="sdpa"``, in eval mode, and checked to have the
shape the layer-wise engine drives (``check_layerwise_supported``). On a CPU in float32 its
linear layers keep a copy of their weights packed once for oneDNN, which the batched decode step
multiplies by (``worker.packed_linear``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Set before transformers/huggingface_hub are imported (they read it once, at import), so that
# nothing this process loads waits on a hub it cannot reach. An explicit setting wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import structlog
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from tierflow import builtin_tokenizer
from tierflow.catalogue import (
    PRESETS,
    GgufPreset,
    ModelLoadError,
    RandomPreset,
    find_packaged_gguf,
    first_line,
    hub_offline,
    looks_like_path,
    models_cache_dir,
    unknown_model_error,
)
from worker.packed_linear import can_pack, pack_linears

log = structlog.get_logger(__name__)

ATTN_IMPLEMENTATION = "sdpa"


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


def preset_config(preset: RandomPreset, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """The transformers config of a random-weight preset, sized to ``tokenizer``."""
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "max_position_embeddings": preset.max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if preset.architecture == "llama":
        return LlamaConfig(**common)
    window = {}
    if preset.sliding_window is not None:
        window = {
            "use_sliding_window": True,
            "sliding_window": preset.sliding_window,
            "max_window_layers": preset.max_window_layers or 0,
        }
    return Qwen2Config(**common, **window)


@functools.cache
def load_builtin_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer as a transformers tokenizer. Cached: treat it as read-only."""
    return PreTrainedTokenizerFast(
        tokenizer_file=str(builtin_tokenizer.TOKENIZER_PATH),
        bos_token=builtin_tokenizer.BOS_TOKEN,
        eos_token=builtin_tokenizer.EOS_TOKEN,
        pad_token=builtin_tokenizer.PAD_TOKEN,
        additional_special_tokens=[builtin_tokenizer.IM_START, builtin_tokenizer.IM_END],
        chat_template=builtin_tokenizer.CHAT_TEMPLATE,
        # Left padding: batched generation appends to the right end of every row.
        padding_side="left",
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bfloat16 halves memory and uses tensor cores on GPUs; CPUs are fastest and exact in float32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
    if can_pack(target, dtype):  # faster decode-step products on a CPU: worker.packed_linear
        pack_linears(model)
    return LoadedModel(
        name=name_or_path, model=model, tokenizer=tokenizer, device=target, dtype=dtype
    )


def build_random_model(
    preset: RandomPreset,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The preset's model in float32 on the CPU, with weights that depend only on its seed."""
    tokenizer = load_builtin_tokenizer()
    config = preset_config(preset, tokenizer)
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
    gguf_path = find_packaged_gguf(preset)
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
    if looks_like_path(name_or_path):
        raise ModelLoadError(f"model directory {name_or_path!r} does not exist")
    try:
        offline = hub_offline()
        note = " (offline: only the local Hugging Face cache is read)" if offline else ""
        return _load_pretrained(
            name_or_path, dtype=dtype, local_files_only=offline, label=name_or_path, note=note
        )
    except _NotFoundError as exc:
        raise unknown_model_error(name_or_path, str(exc)) from exc


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
        raise _NotFoundError(f"cannot load {label!r}{note}: {first_line(exc)}") from exc
    except (ValueError, KeyError) as exc:  # e.g. an architecture transformers does not know
        raise ModelLoadError(f"cannot load {label!r}: {first_line(exc)}") from exc
    # Checked before the tokenizer so an unsupported model fails with the clearer message.
    check_layerwise_supported(model, label)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer of {label!r}{note}: {first_line(exc)}"
        ) from exc
    return model, tokenizer
