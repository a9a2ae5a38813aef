"""Picking the next token from a model's logits: greedy, or sampled with temperature, top-k and
top-p as transformers' warpers do, from a seeded generator (generation through the pipeline,
GRPO's completions)."""

from __future__ import annotations

import numpy as np
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
    whose probabilities reach `top_p` (transformers' warpers, in its order).

    The same distribution as transformers' sort-and-`multinomial`, drawn for a tenth of its cost on
    a CPU (a large vocabulary made them a quarter of a decoding step): the nucleus is cut at a
    probability found from the sorted values alone (no index sort), and the token is drawn by
    inverting the kept probabilities' running sum at one uniform number per row.
    """
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = probs * (probs >= _nucleus_floor(probs, top_p))
    running = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64) * running[:, -1:]
    token = torch.searchsorted(running, u, right=True).squeeze(-1)
    return token.clamp_(max=probs.shape[-1] - 1)


def _nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row, the smallest probability the `top_p` nucleus keeps: the least likely tokens go while
    their running sum stays within 1 - top_p, the most likely always stays (transformers'
    `TopPLogitsWarper`; tokens tied with the floor all stay)."""
    ascending = torch.from_numpy(np.sort(probs.cpu().numpy(), axis=-1)).to(probs.device)
    dropped = (ascending.cumsum(dim=-1) <= 1 - top_p).sum(dim=-1, keepdim=True)
    return ascending.gather(-1, dropped.clamp_(max=probs.shape[-1] - 1))
