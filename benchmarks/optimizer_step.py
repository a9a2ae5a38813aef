"""Milliseconds per optimizer step on the main job's GPT parameters: torch's default
implementation, foreach and fused kernels, for SGD, Adam and AdamW, on one CPU thread.

Why raypipe's CPU stages build their optimizer with `fused=True` (`raypipe.actors.optim.build`):
on CPU torch's default is a Python loop over the parameter tensors.

    python benchmarks/optimizer_step.py --steps 40 > optimizer_step.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from raypipe import build_layers
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}
IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
    model = torch.nn.Sequential(*build_layers(gpt.layers(cfg)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers = {
        (name, impl): cls(model.parameters(), **kwargs, **extra)
        for name, (cls, kwargs) in OPTIMIZERS.items()
        for impl, extra in IMPLEMENTATIONS.items()
    }
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in optimizers}
    for step in range(args.steps + 5):  # in turn, so a slow moment of the machine hits all alike
        for key, optimizer in optimizers.items():
            started = time.perf_counter()
            optimizer.step()
            if step >= 5:
                seconds[key].append(time.perf_counter() - started)
    ms = {
        name: {impl: round(statistics.median(seconds[(name, impl)]) * 1e3, 3) for impl in IMPLEMENTATIONS}
        for name in OPTIMIZERS
    }
    json_out.emit(
        {
            "benchmark": "optimizer_step",
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": 1},
            "parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())),
            "steps": args.steps,
            "ms_per_step_median": ms,
            "fused_speedup_vs_default": {name: round(v["default"] / v["fused"], 2) for name, v in ms.items()},
        },
        indent=1,
    )


if __name__ == "__main__":
    json_out.run(main)
