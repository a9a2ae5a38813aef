"""transformers' causal-LM loss as a raypipe loss: labels as transformers takes them (the
same length as the input, shifted inside, -100 ignored), averaged over the tokens not
ignored across the whole step, as one process computes it for the whole batch."""

from __future__ import annotations

from typing import Any

import torch

IGNORE = -100


class CausalLMLoss:
    """`CausalLMLoss(vocab_size)(logits, labels)`: transformers' `ForCausalLMLoss` on one microbatch.

    `count(labels)` is the number of tokens its mean is over; the trainer weighs each
    microbatch by it (`raypipe.runtime.batches.loss_weights`), so the step's loss and
    gradients are the mean over every counted token of the batch, whatever the split.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        if self.count(labels) == 0:  # all ignored: nothing to learn from, and a mean over none is NaN
            return logits.float().sum() * 0.0
        return ForCausalLMLoss(logits, labels.to(logits.device), self.vocab_size)

    @staticmethod
    def count(labels: torch.Tensor) -> int:
        return int((labels[..., 1:] != IGNORE).sum())

    def __repr__(self) -> str:
        return f"CausalLMLoss(vocab_size={self.vocab_size})"
