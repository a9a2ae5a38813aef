"""Cross-entropy over a large vocabulary without logits-sized temporaries.

`F.cross_entropy` on (tokens × vocabulary) logits keeps its log-softmax for backward, and its
backward makes two more tensors of that size: on Qwen2's 151,936-token vocabulary and 512
tokens, each is 311 MB, which made a LoRA stage's peak 1.57× its parameters. Here the loss is
computed a block of rows at a time, keeping only each row's log-sum-exp, and backward writes
each block's gradient (softmax minus the one-hot target, times the incoming gradient over the
counted tokens, in float32 before it is rounded to the logits' dtype, as `F.cross_entropy`
after transformers' upcast rounds it) into the logits' own storage, as Liger-Kernel's
cross-entropy does: nothing of the logits' size is allocated. The loss is `F.cross_entropy`'s
mean over the targets not ignored, in float32 whatever the logits' dtype.

Backward overwrites the logits handed in, so they must not be read after it, and it runs once
(no `retain_graph`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx

IGNORE = -100
BLOCK_ELEMENTS = 2**24  # float32 elements per block: 64 MB, a few of them live at a time


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., V) against `targets` (...), `ignore_index` left out,
    computed in float32 whatever the logits' dtype (as transformers' loss upcasts)."""
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()  # a copy: the gradient then goes to it, and autograd carries it back
    return _ChunkedCrossEntropy.apply(flat, targets.reshape(-1).to(flat.device), ignore_index)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        counted = targets != ignore_index
        count = counted.sum()
        norms = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _blocks(logits):
            block = logits[rows].float()
            norms[rows] = torch.logsumexp(block, dim=1)
            picked = block.gather(1, targets[rows].clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((norms[rows] - picked) * counted[rows]).sum()
        ctx.save_for_backward(logits, targets, counted, norms, count)
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        logits, targets, counted, norms, count = ctx.saved_tensors
        gradient = logits.detach()  # the logits' own storage: each block's gradient replaces it
        weight = counted.to(torch.float32) * (grad.float() / count.clamp(min=1))
        with torch.no_grad():
            for rows in _blocks(logits):
                block = gradient[rows].float()  # the stored rows themselves when the logits are float32
                block.sub_(norms[rows].unsqueeze(1)).exp_()
                picked = targets[rows].clamp(min=0).unsqueeze(1)
                block.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=block.dtype))
                block.mul_(weight[rows].unsqueeze(1))
                if gradient.dtype != torch.float32:
                    gradient[rows].copy_(block)
        return gradient, None, None


def _blocks(logits: torch.Tensor) -> list[slice]:
    """Row ranges of about `BLOCK_ELEMENTS` elements each."""
    rows = max(1, BLOCK_ELEMENTS // max(1, logits.shape[1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]
