"""Test hooks on a model's layers: raise a preemption signal at chosen operator calls."""

from __future__ import annotations


class StopAfter:
    """Raises the channel's preempt signal after the listed operator calls (1-based).

    ``halves``: count the attention and MLP halves (the engine calls those with check="half"
    or "block", so a stop can fall inside a layer; with row blocks each block is one call)
    instead of whole layers. An attention call is counted at its output projection, which
    every path runs once per call: the module's own forward and the engine's unmasked blocks
    (``worker.block_attention``) alike.
    """

    def __init__(self, model, channel, stops, *, halves: bool) -> None:
        self.channel, self.stops, self.calls = channel, set(stops), 0
        modules = []
        for layer in model.model.layers:
            modules += [layer.self_attn.o_proj, layer.mlp] if halves else [layer]
        self.handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, args, output):
        self.calls += 1
        if self.calls in self.stops:
            self.channel.preempt()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
