"""Zero-bubble schedules on real compute: the reference GPT at pp = 4, m = 16, 1F1B vs ZB-H1 vs
ZB-V vs interleaved 1F1B, tokens/s side by side.

Each schedule has its own trainer (ZB-V and interleaved place their layers differently); the
trainers take their steps in turn, one step each, `--steps` times, after two warm-up steps,
so background load hits them alike. Reported per schedule: median step time, tokens/s, the
ratio to 1F1B and the bubble measured from the actors' own timestamps (idle share of the
step's action span over all actors).

Four actors of real compute need four cores for a schedule's bubble to be time lost: with
fewer, an actor idle in its bubble leaves its core to another actor's compute, so the
schedules run nearly the same. `--threads` sets each actor's torch threads.

    python benchmarks/zero_bubble_gpt.py [--steps 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

P, M = 4, 16
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = gpt.GPTConfig(vocab_size=256, n_layer=6, n_head=4, n_embd=128, block_size=64)  # 8 layers
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 256, (args.batch_size, cfg.block_size + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    ray.init(
        address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    trainers = {
        s: Trainer(
            gpt.layers(cfg),
            gpt.loss_fn,
            TrainConfig(
                pp=P,
                microbatches=M,
                schedule=s,
                cpus_per_actor=0.01,
                threads_per_actor=args.threads,
                optimizer={"name": "adamw", "lr": 1e-3},
                name=f"zb-gpt-{s}",
            ),
        )
        for s in SCHEDULES
    }
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    bubbles: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    try:
        for k in range(args.steps + 2):
            for s, trainer in trainers.items():
                seconds = trainer.step(x, y)["step_time"]
                if k >= 2:
                    times[s].append(seconds)
                    line = trainer.timeline()
                    bubbles[s].append(1.0 - sum(line.busy()) / line.num_stages)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
    tokens = args.batch_size * cfg.block_size
    base = statistics.median(times["1f1b"])
    rows = [
        {
            "schedule": s,
            "step_s": statistics.median(times[s]),
            "tokens_per_s": tokens / statistics.median(times[s]),
            "tokens_per_s_over_1f1b": base / statistics.median(times[s]),
            "measured_bubble": statistics.median(bubbles[s]),
        }
        for s in SCHEDULES
    ]
    for row in rows:
        json_out.emit(row)
    json_out.emit(
        {
            "benchmark": "zero_bubble_gpt",
            "p": P,
            "m": M,
            "cores": os.cpu_count(),
            "threads_per_actor": args.threads,
            "rows": rows,
        }
    )


if __name__ == "__main__":
    json_out.run(main)
