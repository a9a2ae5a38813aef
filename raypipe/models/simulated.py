"""A layer whose compute is simulated exactly: forward sleeps `forward_s`, backward `backward_s`.

Schedules, timelines and the engine's overhead can then be measured without the
result depending on how many cores the machine has: sleeping takes no CPU, so p
such stages on 2 cores behave like p devices. A `slowdown` per accelerator kind
makes one kind of device simulate slower than another, for speed-aware partitioning.
Used by `examples/timeline.py`, the `benchmarks/` and the tests of schedules and timelines.
In one process a `SimulatedClock` can stand in for the sleeps: the layers then move that clock
instead of waiting, and whatever reads it (the layer profiler) sees exact seconds.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from raypipe.core.devices import serving_kind


class SimulatedClock:
    """Seconds that pass only when a simulated layer takes them: `sleep(s)` adds s, calling the
    clock reads the total. Given to `SimulatedCompute(clock=...)` and to a reader such as
    `LayerProfiler(clock=...)` in the same process, it makes timings exact on any machine."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def sleep(self, seconds: float) -> None:
        self.seconds += seconds

    def __call__(self) -> float:
        return self.seconds


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float, sleep) -> torch.Tensor:
        ctx.backward_s, ctx.sleep = backward_s, sleep
        if forward_s:
            sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.backward_s:
            ctx.sleep(ctx.backward_s)
        return grad, None, None, None


class _WeightPath(torch.autograd.Function):
    """The weight gradient's share of a simulated backward: zeros forward, `weight_s` backward."""

    @staticmethod
    def forward(ctx, scale: torch.Tensor, weight_s: float, sleep) -> torch.Tensor:
        ctx.weight_s, ctx.sleep = weight_s, sleep
        return torch.zeros_like(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.weight_s:
            ctx.sleep(ctx.weight_s)
        return grad, None, None


class SimulatedCompute(nn.Module):
    """Identity with a tiny trainable scale, whose forward and backward take fixed times.

    Args:
        forward_s, backward_s: seconds each takes on a device of unit speed.
        features: the width of the activation it passes on.
        slowdown: {"rocm": 2.0}: on a stage (or profiler) placed for rocm, both take
            twice as long; kinds not named run at unit speed.
        ballast: extra parameters that take no compute, so a layer can weigh more
            than another under `partition="parameters"`.
        weight_s: makes the backward two parts, as zero-bubble schedules split it: the input
            gradient takes `backward_s`, the weight gradient `weight_s` (a whole backward
            both). The input path then runs on every stage, the first included, as if its
            input needed a gradient, so every stage does the same work.
        clock: a `SimulatedClock` to move instead of sleeping (in one process only: a layer
            built on an actor sleeps).
    """

    def __init__(
        self,
        forward_s: float,
        backward_s: float,
        features: int = 8,
        slowdown: dict[str, float] | None = None,
        ballast: int = 0,
        weight_s: float | None = None,
        clock: SimulatedClock | None = None,
    ) -> None:
        super().__init__()
        self.sleep = time.sleep if clock is None else clock.sleep
        self.forward_s, self.backward_s = float(forward_s), float(backward_s)
        self.weight_s = None if weight_s is None else float(weight_s)
        self.slowdown = dict(slowdown or {})
        self.scale = nn.Parameter(torch.ones(features))
        self.ballast = nn.Parameter(torch.zeros(ballast)) if ballast else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = self.slowdown.get(serving_kind() or "", 1.0)
        if self.weight_s is None:
            return _Sleep.apply(x * self.scale, self.forward_s * factor, self.backward_s * factor, self.sleep)
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        inputs = _Sleep.apply(x, self.forward_s * factor, self.backward_s * factor, self.sleep)
        return inputs + _WeightPath.apply(self.scale, self.weight_s * factor, self.sleep)

    def extra_repr(self) -> str:
        slow = f", slowdown={self.slowdown}" if self.slowdown else ""
        weight = f", weight_s={self.weight_s}" if self.weight_s is not None else ""
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}{weight}{slow}"
