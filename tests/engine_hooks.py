"""Test hooks on a model's layers: raise a preemption signal at chosen operator calls."""

from __future__ import annotations


class StopAfter:
    """Raises the channel's preempt signal after the listed operator calls (1-based).

    ``halves``: count the attention and MLP submodules (the engine calls those with
    check="half", so a stop can fall inside a layer) instead of whole layers.
    """

    def __init__(self, model, channel, stops, *, halves: bool) -> None:
        self.channel, self.stops, self.calls = channel, set(stops), 0
        modules = []
        for layer in model.model.layers:
            modules += [layer.self_attn, layer.mlp] if halves else [layer]
        self.handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, args, output):
        self.calls += 1
        if self.calls in self.stops:
            self.channel.preempt()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
