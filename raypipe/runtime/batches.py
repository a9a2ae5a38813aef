"""Cutting a batch into the equal parts a step needs (dp replicas x microbatches), with an
error that says which sizes work."""

from __future__ import annotations

import math
from typing import Any

import torch

from raypipe.errors import BatchError


def split_batch(x: torch.Tensor, y: Any, parts: int, dp: int, microbatches: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Splits `(x, y)` into `parts` equal chunks along dim 0; `y=None` (inference) takes any
    split that divides the batch. A tensor `y` is split alongside; anything else is repeated.

    Raises:
        BatchError: `x` is not a batched tensor, `y` does not match it, or the batch does not
            divide into `parts` (`dp` and `microbatches` word the message).
    """
    if not torch.is_tensor(x):
        raise BatchError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise BatchError("x must have a batch dimension (dim 0)")
    batch = x.shape[0]
    if torch.is_tensor(y) and (y.dim() == 0 or y.shape[0] != batch):
        raise BatchError(
            f"x has {batch} samples but y has shape {tuple(y.shape)}: give one target per sample (y.shape[0] == {batch})."
        )
    if y is None:
        parts = math.gcd(batch, parts)  # inference: any split works
    elif batch % parts:
        into = f"dp={dp} x microbatches={microbatches} = {parts}" if parts == dp * microbatches and dp > 1 \
            else f"microbatches={parts}"
        options = [d for d in range(1, batch + 1) if batch % d == 0]
        raise BatchError(
            f"a batch of {batch} samples cannot be split into {into} equal parts: "
            f"use a batch size divisible by {parts} (e.g. {max(parts, batch - batch % parts)})"
            + (f", or microbatches in {options}." if dp == 1 else ".")
        )
    # clone: a view would carry the whole batch's storage through the object store
    inputs = [c.clone() for c in x.split(batch // parts)]
    targets = [c.clone() for c in y.split(batch // parts)] if torch.is_tensor(y) else [y] * len(inputs)
    return inputs, targets
