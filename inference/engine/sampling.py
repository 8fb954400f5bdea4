"""Turning logits into the distributions that sampling and verification use."""

from __future__ import annotations

import torch


def distribution(logits: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, in fp32.

    ``temperature == 0`` means greedy: a one-hot on the argmax. Speculative sampling is
    exact only when draft and target probabilities are both taken after these same
    transformations, so every caller goes through here.
    """
    logits = logits.float()
    if temperature == 0:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cumulative - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
