"""transformers' causal-LM loss as a raypipe loss: labels as transformers takes them (the
same length as the input, shifted inside, -100 ignored), averaged over the tokens not
ignored across the whole step, as one process computes it for the whole batch. Its
cross-entropy is computed in blocks of rows (`raypipe.nn.cross_entropy`), so a 150k-token
vocabulary costs the logits and nothing more of their size."""

from __future__ import annotations

from typing import Any

import torch

from raypipe.nn.cross_entropy import IGNORE, chunked_cross_entropy


class CausalLMLoss:
    """`CausalLMLoss(vocab_size)(logits, labels)`: transformers' `ForCausalLMLoss` on one microbatch
    (the same numbers; its backward overwrites the logits with their gradient).

    `count(labels)` is the number of tokens its mean is over; the trainer weighs each
    microbatch by it (`raypipe.data.batches.loss_weights`), so the step's loss and
    gradients are the mean over every counted token of the batch, whatever the split.
    """

    #: labels are the input's tokens, shifted here: a sequence chunk's come with the next chunk's
    #: first one (`raypipe.data.sequence_units`)
    shifts_labels = True

    def __init__(self, vocab_size: int, num_experts: int = 0, router_aux_loss_coef: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.num_experts, self.router_aux_loss_coef = num_experts, router_aux_loss_coef

    def __call__(self, output: Any, labels: Any) -> torch.Tensor:
        """`output`: the logits, or a Mixtral's (logits, routing sums), whose balancing loss is added
        times `router_aux_loss_coef`, as transformers adds it with `output_router_logits`."""
        logits, stats = output if isinstance(output, tuple) else (output, None)
        if self.count(labels) == 0:  # all ignored: nothing to learn from, and a mean over none is NaN
            loss = logits.float().sum() * 0.0
        else:
            if labels.shape[-1] == logits.shape[-2] + 1:  # a sequence chunk's, with the next chunk's first label
                shifted = labels.to(logits.device)[..., 1:]
            else:
                shifted = torch.nn.functional.pad(labels.to(logits.device), (0, 1), value=IGNORE)[..., 1:]
            loss = chunked_cross_entropy(logits, shifted, IGNORE)
        if stats is not None:
            from raypipe.models.hf.sparse_moe import balancing_loss

            loss = loss + self.router_aux_loss_coef * balancing_loss(stats, self.num_experts).to(loss.device)
        return loss

    @staticmethod
    def count(labels: torch.Tensor) -> int:
        return int((labels[..., 1:] != IGNORE).sum())

    def __repr__(self) -> str:
        aux = f", num_experts={self.num_experts}" if self.num_experts else ""
        return f"CausalLMLoss(vocab_size={self.vocab_size}{aux})"
