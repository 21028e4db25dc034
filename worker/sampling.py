"""Next-token choice from the last position's logits: greedy, or temperature + top-p, seeded."""

from __future__ import annotations

import torch

from worker.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    # Sampling runs on the CPU so that a seed gives the same tokens on every device.
    return torch.Generator(device="cpu").manual_seed(params.seed)


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> int:
    """``logits``: 1-D over the vocabulary."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = cumulative - sorted_probs < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
