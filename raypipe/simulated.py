"""A layer whose compute is simulated exactly: forward sleeps `forward_s`, backward `backward_s`.

Schedules, timelines and the engine's overhead can then be measured without the
result depending on how many cores the machine has: sleeping takes no CPU, so p
such stages on 2 cores behave like p devices. Used by `examples/timeline.py` and
`benchmarks/pipeline_efficiency.py`.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        if forward_s:
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.backward_s:
            time.sleep(ctx.backward_s)
        return grad, None, None


class SimulatedCompute(nn.Module):
    """Identity with a tiny trainable scale, whose forward and backward take fixed times."""

    def __init__(self, forward_s: float, backward_s: float, features: int = 8) -> None:
        super().__init__()
        self.forward_s, self.backward_s = float(forward_s), float(backward_s)
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}"
