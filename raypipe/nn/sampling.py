"""Picking the next token from a model's logits: greedy, or sampled with temperature, top-k and
top-p as transformers' warpers do, from a seeded generator (generation through the pipeline,
GRPO's completions)."""

from __future__ import annotations

import torch


def pick(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The next token of each row: the most likely one (`temperature` 0), else a sample from the
    softmax of `logits / temperature` over the `top_k` most likely, then over the fewest most likely
    whose probabilities reach `top_p` (transformers' warpers, in its order)."""
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False, dim=-1)
        dropped = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1:] = False  # the most likely always stays
        logits = logits.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
