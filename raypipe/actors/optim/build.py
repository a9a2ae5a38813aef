"""Optimizer, learning-rate schedule and fp16 loss scaling, as each stage actor runs them.

Every stage runs the same code on the same global inputs (step number, global
gradient norm, whether any gradient overflowed), so all stages stay in lock-step
without talking to each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


def build_optimizer(params: Iterable[torch.nn.Parameter], spec: Mapping) -> torch.optim.Optimizer:
    """`{"name": "sgd", "lr": 0.1, "momentum": 0.9}` -> torch.optim.SGD(params, lr=0.1, momentum=0.9).

    Parameters that all live on the CPU get torch's fused kernels (`fused=True`) unless
    `spec` chooses `fused` or `foreach` itself: torch's default there is a Python loop
    over the tensors, which for the main job's GPT (53 tensors, 0.87 M parameters) took
    4.1 ms per AdamW step against 1.2 ms fused, 2-3 % of a training step. Fused kernels
    round differently in the last bits (~5e-6 relative after 30 AdamW steps). Where the
    fused kernels refuse an option or dtype, the default implementation is used.
    """
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[spec["name"]]
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    params = list(params)
    if params and "fused" not in kwargs and "foreach" not in kwargs and all(p.device.type == "cpu" for p in params):
        try:
            return cls(params, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # e.g. differentiable=True, a dtype without fused kernels
            pass
    return cls(params, **kwargs)


def learning_rate(step: int, base_lr: float, schedule: Mapping) -> float:
    """The learning rate for optimizer step `step` (0-based).

    Linear warm-up over `warmup_steps`, then constant or cosine decay to `min_lr`
    at `total_steps` (and `min_lr` after it).
    """
    warmup = schedule.get("warmup_steps", 0)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule["name"] == "constant":
        return base_lr
    min_lr = schedule.get("min_lr", 0.0)
    total = schedule["total_steps"]
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class LossScaler:
    """Dynamic fp16 loss scaling, mirrored on every stage from the same global overflow flag."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2.0
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0
