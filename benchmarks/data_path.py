"""Where a step's batch is made and cut: on the driver (`fit(batches_fn, ...)`) against a Ray
Dataset read by the reader actor (`fit(dataset, ..., batch_size=...)`), on one pp = 2 x dp = 2
trainer, side by side.

Both make the same batches (rows generated from their index by a seeded generator: the driver
generates a step's rows itself; Ray Data generates them in its tasks), and both train the same
MLP. The trainer alternates between the two for `--rounds` rounds of `--steps` steps; the first
two steps of each round are left out (the reader's start, and its re-read up to the round's
first step). Reported per path, as medians over the kept steps: the driver process's CPU
seconds per step (`time.process_time` between steps: making, cutting and sending the batch,
and booking the step), the bytes of the step's data the driver serializes (the batch itself
driver-fed; the references and loss weights from the reader), step time and samples/s.

    python benchmarks/data_path.py [--rounds 3] [--steps 10] [--batch-size 256] [--features 4096] [--out data_path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


def rows(ids: np.ndarray, features: int) -> dict[str, np.ndarray]:
    """Rows `ids` of the benchmark's data: x from a generator seeded by the first id, y from x."""
    g = np.random.default_rng(int(ids[0]))
    x = g.standard_normal((len(ids), features), dtype=np.float32)
    return {"x": x, "y": x[:, :8].sum(axis=1, keepdims=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument(
        "--materialize",
        action="store_true",
        help="generate the dataset's rows before training (Ray Data's tasks then compete for no CPU)",
    )
    parser.add_argument("--out", default="data_path.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(
        address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    batch, features = args.batch_size, args.features
    total = batch * args.steps * args.rounds * 2
    dataset = ray.data.range(total, override_num_blocks=total // batch).map_batches(
        lambda b: rows(b["id"], features), batch_size=batch, batch_format="numpy"
    )
    if args.materialize:
        dataset = dataset.materialize()

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        made = rows(np.arange(step * batch, (step + 1) * batch), features)
        return torch.from_numpy(made["x"]), torch.from_numpy(made["y"])

    layers = [
        LayerSpec(nn.Linear, features, 64),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 64, 64),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 64, 1),
    ]
    config = TrainConfig(
        pp=2,
        dp=2,
        microbatches=4,
        cpus_per_actor=0.01,
        threads_per_actor=1,
        optimizer={"name": "adamw", "lr": 1e-3},
        name="data-path",
        actor_steps=0,  # each step through the driver: the path measured (driver_scaling.py: actor-driven)
    )
    measured: dict[str, dict[str, list[float]]] = {
        p: {"cpu_s": [], "step_s": [], "samples_per_s": []} for p in ("driver", "ray_data")
    }
    sent: dict[str, list[int]] = {"driver": [], "ray_data": []}
    import raypipe.driver.feeds as feeds

    original_get = feeds.DatasetFeed.get

    def counted_get(self, step):  # the bytes the reader's answer takes on the driver
        prepared = original_get(self, step)
        sent["ray_data"].append(len(ray.cloudpickle.dumps((prepared.packed, prepared.weights, prepared.samples))))
        return prepared

    feeds.DatasetFeed.get = counted_get
    with Trainer(layers, nn.functional.mse_loss, config) as trainer:
        for _ in range(args.rounds):
            for path in ("driver", "ray_data"):
                marks: list[float] = []

                def on_step(metrics, marks=marks, path=path):
                    marks.append(time.process_time())
                    if len(marks) > 2:  # the first two steps of a round: warm-up
                        measured[path]["cpu_s"].append(marks[-1] - marks[-2])
                        measured[path]["step_s"].append(metrics["step_time"])
                        measured[path]["samples_per_s"].append(metrics["samples_per_s"])

                end = trainer.step_count + args.steps
                if path == "driver":
                    x, y = batches(trainer.step_count)
                    sent["driver"].append(x.numel() * x.element_size() + y.numel() * y.element_size())
                    trainer.fit(batches, end, on_step=on_step, overlap=True)
                else:
                    trainer.fit(dataset, end, batch_size=batch, on_step=on_step, overlap=True)
    result = {
        "config": vars(args)
        | {"pp": 2, "dp": 2, "microbatches": 4, "cpus": os.cpu_count(), "batch_bytes": batch * (features + 1) * 4},
        "paths": {
            p: {
                "driver_cpu_ms_per_step": 1000 * statistics.median(m["cpu_s"]),
                "driver_data_bytes_per_step": statistics.median(sent[p]),
                "step_ms": 1000 * statistics.median(m["step_s"]),
                "samples_per_s": statistics.median(m["samples_per_s"]),
                "steps_measured": len(m["cpu_s"]),
            }
            for p, m in measured.items()
        },
    }
    d, r = result["paths"]["driver"], result["paths"]["ray_data"]
    result["ray_data_vs_driver"] = {
        "driver_cpu": r["driver_cpu_ms_per_step"] / d["driver_cpu_ms_per_step"],
        "driver_bytes": r["driver_data_bytes_per_step"] / d["driver_data_bytes_per_step"],
        "step_time": r["step_ms"] / d["step_ms"],
    }
    json_out.emit(result, indent=2)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    json_out.run(main)
