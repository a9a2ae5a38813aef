"""Activation memory per stage, GPipe vs 1F1B: p = 4, m = 16, the reference GPT.

Each stage reports the peak number of microbatches it kept for backward during a
step and the peak bytes autograd saved for them (saved-tensor hooks; storage shared
between tensors counted once). 1F1B must hold at most p - s microbatches on stage s;
GPipe holds all m.

    python benchmarks/activation_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import ray

from raypipe import TrainConfig, Trainer
from raypipe.data import TokenDataset
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

P, M = 4, 16


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    model = gpt.GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=64)  # 8 layers: 2 per stage
    data = TokenDataset(np.arange(200_000, dtype=np.uint16) % 256, model.block_size)
    x, y = data.batch(0, 2 * M)
    config = TrainConfig(
        pp=P, microbatches=M, optimizer={"name": "adamw", "lr": 1e-3}, cpus_per_actor=0.5, measure_activations=True
    )
    result = {"benchmark": "activation_memory", "p": P, "m": M, "microbatch": [2, model.block_size], "schedules": {}}
    with Trainer(gpt.layers(model), gpt.loss_fn, config) as trainer:
        for schedule in ("gpipe", "1f1b"):
            trainer.reconfigure(schedule=schedule)
            stages = trainer.step(x, y)["stages"]
            result["schedules"][schedule] = [
                {
                    "stage": s,
                    "peak_stashed_microbatches": st["peak_stashed_microbatches"],
                    "peak_stashed_mib": round(st["peak_stashed_bytes"] / 2**20, 2),
                    "bound": M if schedule == "gpipe" else P - s,
                }
                for s, st in enumerate(stages)
            ]
    ray.shutdown()
    json_out.emit(result, indent=1)


if __name__ == "__main__":
    json_out.run(main)
