"""One stream's wire format, shared by every transport: a header (dtype code, ndim, shape) before
its first message, and a flag (OK or POISON) with each message.

A stream is one direction between two neighbours within a step (activations
forward, or gradients back), carrying one message per microbatch, each on its own
tag. Every message of a step has the first one's shape (microbatches are equal
splits), so the receiver can post receives ahead. A failed stage keeps the
communication pattern: it still makes every send its action list calls for, sending
poison instead of a tensor, so no neighbour waits forever; a neighbour that receives
poison fails the same way (`PeerFailed`).
"""

from __future__ import annotations

import torch

HEADER = 8  # int64 slots: dtype code, ndim, up to 6 dimensions
OK, POISON = 0, -1
FLAG_BYTES = 8  # an int64 flag (OK or POISON) at the start of every message
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
CODES = {dtype: i for i, dtype in enumerate(DTYPES)}


class PeerFailed(RuntimeError):
    """A neighbouring stage failed earlier in this step (it sent poison instead of a tensor)."""


def check_sendable(t: torch.Tensor) -> None:
    """Refuses a boundary tensor with more dimensions than a header describes."""
    if t.dim() > HEADER - 2:
        raise ValueError(f"a boundary tensor has {t.dim()} dimensions; at most {HEADER - 2} can be sent")


def check_like(like: torch.Tensor, t: torch.Tensor) -> None:
    """Refuses a boundary tensor whose shape or dtype differs from its stream's first one this step."""
    if t.shape != like.shape or t.dtype != like.dtype:
        raise ValueError(
            f"boundary tensor {tuple(t.shape)} {t.dtype} differs from this step's first microbatch "
            f"({tuple(like.shape)} {like.dtype}); engine='p2p' needs equal shapes within a step, "
            f"engine='refs' does not."
        )


def header(t: torch.Tensor | None) -> torch.Tensor:
    """A stream's description of its tensors (HEADER int64s: dtype code, ndim, shape), or poison for None."""
    if t is None:
        return torch.tensor([POISON] + [0] * (HEADER - 1), dtype=torch.int64)
    return torch.tensor([CODES[t.dtype], t.dim(), *t.shape] + [0] * (HEADER - 2 - t.dim()), dtype=torch.int64)
