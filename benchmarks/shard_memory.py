"""Per-actor parameter and optimizer-state bytes: tp 1 vs 2, ZeRO-1 off vs on (pp=2, dp=2, AdamW).

The main job's GPT takes one step in each configuration; each actor then reports
what it holds. Tensor parallelism should halve the split layers' parameters and
their optimizer state on every actor; ZeRO-1 should split each stage's optimizer
state across its dp replicas while parameters stay whole.

    python benchmarks/shard_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray

from raypipe import TrainConfig, Trainer
from raypipe.data import TokenDataset
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    model = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
    import numpy as np

    data = TokenDataset(np.arange(100_000, dtype=np.uint16) % 256, model.block_size)
    result = {"benchmark": "shard_memory", "model_parameters": model.parameters, "runs": {}}
    for tp in (1, 2):
        for zero in (0, 1):
            config = TrainConfig(
                pp=2,
                dp=2,
                tp=tp,
                zero=zero,
                microbatches=2,
                optimizer={"name": "adamw", "lr": 1e-3},
                cpus_per_actor=0.5 / tp,
            )
            with Trainer(gpt.layers(model), gpt.loss_fn, config) as trainer:
                trainer.step(*data.batch(0, 8))
                result["runs"][f"tp{tp}-zero{zero}"] = {
                    i["name"]: {
                        "parameter_bytes": i["parameter_bytes"],
                        "optimizer_state_bytes": i["optimizer_state_bytes"],
                    }
                    for i in trainer.stage_info()
                }
    ray.shutdown()
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
