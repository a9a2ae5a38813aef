"""What each experiment logger costs the driver per step: TensorBoard (event files), MLflow (a
local sqlite store) and W&B (offline run files), recording a real pp = 2 step's scalars.

One trainer takes one step to get real metrics (`raypipe.observe.loggers.scalars`: 25 scalars at pp = 2
for the MLP below); then each logger records them for `--steps` steps in turn, in rounds, and the
driver's wall and CPU time per record is reported (median over rounds), beside the step time of
that trainer for scale. Opening a run and closing it (MLflow's close waits for its asynchronous
writes of every step) are timed too.

    python benchmarks/loggers.py [--steps 200] [--rounds 3] [--out loggers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.observe.loggers import MLflowLogger, TensorBoardLogger, WandbLogger, scalars

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="loggers.json")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    ray.init(
        address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    layers = [LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 64, 8)]
    with Trainer(layers, nn.functional.mse_loss, TrainConfig(pp=2, microbatches=4, cpus_per_actor=0.5)) as trainer:
        step_times = [trainer.step(torch.randn(64, 64), torch.randn(64, 8))["step_time"] for _ in range(6)][1:]
        metrics = trainer.step(torch.randn(64, 64), torch.randn(64, 8))
    values = scalars(metrics)
    params = {"pp": 2, "microbatches": 4, "optimizer": {"name": "adamw", "lr": 1e-3}}
    root = tempfile.mkdtemp(prefix="raypipe-loggers-")
    makers = {
        "tensorboard": lambda r: TensorBoardLogger("bench", params, f"{root}/tb{r}"),
        "mlflow": lambda r: MLflowLogger("bench", params, f"sqlite:///{root}/mlflow.db", f"bench{r}"),
        "wandb": lambda r: WandbLogger("bench", params, project="bench", mode="offline", dir=root),
    }
    per_record: dict[str, dict[str, list[float]]] = {
        k: {"wall_ms": [], "cpu_ms": [], "open_s": [], "close_s": []} for k in makers
    }
    for r in range(args.rounds):
        for name, make in makers.items():
            opened = time.perf_counter()
            logger = make(r)
            per_record[name]["open_s"].append(time.perf_counter() - opened)
            wall, cpu = time.perf_counter(), time.process_time()
            for step in range(1, args.steps + 1):
                logger.log(step, values)
            per_record[name]["wall_ms"].append(1000 * (time.perf_counter() - wall) / args.steps)
            per_record[name]["cpu_ms"].append(1000 * (time.process_time() - cpu) / args.steps)
            closing = time.perf_counter()
            logger.close()  # MLflow: waits for its async writes of every step
            per_record[name]["close_s"].append(time.perf_counter() - closing)
    shutil.rmtree(root, ignore_errors=True)  # the runs' files are not the result
    step_ms = 1000 * statistics.median(step_times)
    result = {
        "config": vars(args) | {"scalars_per_step": len(values), "cpus": os.cpu_count()},
        "step_ms": step_ms,
        "loggers": {
            name: {
                "wall_ms_per_step": statistics.median(m["wall_ms"]),
                "cpu_ms_per_step": statistics.median(m["cpu_ms"]),
                "share_of_step": statistics.median(m["wall_ms"]) / step_ms,
                "open_s": statistics.median(m["open_s"]),
                "close_s": statistics.median(m["close_s"]),
            }
            for name, m in per_record.items()
        },
    }
    json_out.emit(result, indent=2)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    json_out.run(main)
