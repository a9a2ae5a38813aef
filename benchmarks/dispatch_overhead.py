"""Engine overhead per actor call: step time of a model whose compute is negligible.

A 4x4 linear layer per stage makes every action nearly free, so the step time is
the engine's own cost: submitting calls, Ray dispatching them, moving tiny tensors.

    python benchmarks/dispatch_overhead.py > dispatch_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--engines", default="p2p,compiled", help="comma-separated; measured alternately per row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    for pp, m in [(1, 1), (1, 4), (1, 16), (2, 16), (4, 16)]:
        for engine in args.engines.split(","):
            config = TrainConfig(
                pp=pp, microbatches=m, cpus_per_actor=0.5, engine=engine, optimizer={"name": "sgd", "lr": 0.01}
            )
            with Trainer([LayerSpec(nn.Linear, 4, 4)] * pp, nn.functional.mse_loss, config) as trainer:
                x, y = torch.randn(16, 4), torch.randn(16, 4)
                for _ in range(5):
                    trainer.step(x, y)
                started = time.perf_counter()
                for _ in range(args.steps):
                    trainer.step(x, y)
                step = (time.perf_counter() - started) / args.steps
            actions = 2 * pp * m + pp  # forwards and backwards, then an optimizer step per stage
            rows.append(
                {
                    "pp": pp,
                    "microbatches": m,
                    "engine": engine,
                    "actions_per_step": actions,
                    "step_ms": 1e3 * step,
                    "us_per_action": 1e6 * step / actions,
                }
            )
    ray.shutdown()
    json_out.emit({"benchmark": "dispatch_overhead", "cpus": 2, "ray": ray.__version__, "rows": rows}, indent=2)


if __name__ == "__main__":
    json_out.run(main)
