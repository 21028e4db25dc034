"""Linear layers whose weights are reordered once for oneDNN, for float32 decoding on a CPU.

Why: a decode step multiplies a few rows (one per decoding request) by every weight matrix of
the model. torch's default float32 path on the CPU (MKL's GEMM) runs such small products well
below what the machine's memory allows; oneDNN's matmul, with each weight reordered once into
its own blocked layout, runs them faster. It is what torch's compiler does for a CPU linear
whose batch size varies (``torch._inductor``'s oneDNN fusion with freezing emits the same two
operators); this module does it without compiling, so the engine's layer-by-layer loop, its
preemption checks and caches stay as they are. Only a batched decode step's products (the
engine runs it inside ``decode_products()``), of at most ``PACKED_MAX_ROWS`` rows, take the
packed copy; every other forward (prefills, a plain ``transformers`` call) takes the plain
path, as before.

Measured on the 2-core development machine (bench-llama, engine decode steps at 512 tokens of
context; plain and packed copies of the model interleaved in one process, 3 rounds): median
step 41.2 -> 37.4 ms at 8 rows, 58.1 -> 46.4 ms at 16, 24.1 -> 23.3 ms at 1. Results equal
``nn.Linear``'s to float32 rounding (the summation order differs), well inside the engine's
1e-4 exactness.

The packed copy is made from the weight as it is at packing time. A later in-place edit of the
weight (its version counter moves; tensors made under ``torch.inference_mode`` have none)
repacks it; a weight moved to another device or dtype is served by plain ``nn.Linear`` again.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

# Only a batched decode step's products take the packed copy (``decode_products``), and only up
# to this many rows. oneDNN builds and keeps a primitive for every input shape (about 0.65 MB
# each, measured): with every forward packed, each new prompt length added some, and a worker
# grew by ~200 MB a minute in the 60 s soak (~35 MB with prefills of up to 32 tokens still
# packed). A decode step has one row per request in the batch, so at most this many shapes per
# weight shape are ever cached (about 100 MB at most for bench-llama's 5 weight shapes), and
# packing gained prefills nothing anyway.
PACKED_MAX_ROWS = 32

_in_decode_step: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "in_decode_step", default=False
)


@contextlib.contextmanager
def decode_products() -> Iterator[None]:
    """Within this block (a batched decode step), packed linears use their packed copy."""
    token = _in_decode_step.set(True)
    try:
        yield
    finally:
        _in_decode_step.reset(token)


# Read once: can_pack runs for every product of a decode step.
_ONEDNN = torch.backends.mkldnn.is_available()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed matmul applies: float32 weights on a CPU, torch built with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and _ONEDNN


def weight_version(weight: torch.Tensor) -> int:
    # Inference tensors (made under torch.inference_mode) keep no version counter.
    return -1 if weight.is_inference() else weight._version


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that multiplies by a packed copy."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=bias is not None, device="meta")
        self.weight = weight  # the same Parameter objects: tied weights stay tied
        self.bias = bias
        self._unpack()

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def _unpack(self) -> None:
        # Packed on first use: a linear that the decode step reaches through
        # ``worker.decode_forward`` instead never holds a packed copy.
        self._packed = None
        self._packed_version: int | None = None

    def _pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._packed_version = weight_version(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            not _in_decode_step.get()
            or x.numel() // self.in_features > PACKED_MAX_ROWS
            or not can_pack(weight.device, weight.dtype)
            or x.dtype != weight.dtype
        ):
            return super().forward(x)
        if self._packed is None or weight_version(weight) != self._packed_version:
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    # The packed copy is an opaque oneDNN tensor, which neither pickle nor deepcopy can copy:
    # copies carry the parameters only and pack their own when used.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_version")}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._unpack()


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` over the same parameters.
    Returns how many were replaced. Call once the weights are final (loaded, cast, on device)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight.device, child.weight.dtype):
                setattr(parent, name, PackedLinear.of(child))
                replaced += 1
    return replaced
