"""Which tensor-parallel group a process belongs to, and the collectives its layers use.

A `TensorParallelGroup` is created by the stage actor before it builds its layers
(rank and size are known then) and receives its process group when the actor joins
the trainer's world; the parallel layers keep a reference to it, so they can be
built before the collectives exist. The three autograd functions are the Megatron
conjugate pairs: copy (identity forward, all-reduce backward), reduce (all-reduce
forward, identity backward) and gather (all-gather forward, own slice backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """This process's place in its tensor-parallel group; `group` is set on joining the world."""

    rank: int = 0
    size: int = 1
    group: object = None

    def process_group(self) -> object:
        if self.size > 1 and self.group is None:
            raise RuntimeError(
                f"tensor-parallel rank {self.rank} of {self.size} ran a collective before joining its group; "
                f"parallel layers run inside a Trainer's stage actors, which join the group at start."
            )
        return self.group


_SINGLE = TensorParallelGroup()
# the group of the layers a StageActor is building right now (`building`): module state because a
# user's layer constructor takes no group argument; one build at a time per actor process
_current: TensorParallelGroup = _SINGLE


def current() -> TensorParallelGroup:
    """The group parallel layers built now belong to (size 1 outside a stage actor's build)."""
    return _current


@contextlib.contextmanager
def building(tp: TensorParallelGroup) -> Iterator[None]:
    """Makes `tp` the group of parallel layers constructed inside the block."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.process_group())
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(x, group=tp.process_group())
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.process_group())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def copy_to_group(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Identity forward; backward sums the input gradient over the group (before a column split)."""
    return _Copy.apply(x, tp) if tp.size > 1 else x


def reduce_from_group(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Sums partial results over the group in forward; identity backward (after a row split)."""
    return _Reduce.apply(x, tp) if tp.size > 1 else x


def gather_from_group(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Concatenates every rank's last dimension in forward; backward keeps this rank's slice."""
    return _Gather.apply(x, tp) if tp.size > 1 else x
