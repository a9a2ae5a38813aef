"""Expert parallelism on the same MoE GPT: ep = 1 (every replica holds every expert) against
ep = 2 (each replica holds half and tokens travel by all-to-all), side by side.

Both trainers run dp = 2 replicas of the same model on the same batches, taking their steps in
turn after two warm-up steps, so background load hits them alike. Reported per ep: median step
time and tokens/s, all-to-all bytes sent and seconds spent per step (per actor, from replica 0's
lead actor of each stage), the expert load (assignments per expert over the measured steps,
max/mean per layer, as replica 0 routed them), tokens dropped over capacity, and per-actor
parameter and optimizer-state bytes (what ep saves).

    python benchmarks/moe.py [--steps 8] [--experts 8] [--top-k 2] [--capacity 1.25] [--pp 1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=None, help="capacity factor (default: dropless)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = gpt.GPTConfig(
        vocab_size=256,
        n_layer=2,
        n_head=4,
        n_embd=128,
        block_size=64,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity,
    )
    ray.init(
        address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    trainers = {
        ep: Trainer(
            gpt.layers(cfg),
            gpt.loss_fn,
            TrainConfig(
                pp=args.pp,
                dp=2,
                ep=ep,
                microbatches=args.microbatches,
                cpus_per_actor=0.01,
                threads_per_actor=1,
                optimizer={"name": "adamw", "lr": 1e-3},
                name=f"moe-ep{ep}",
            ),
        )
        for ep in (1, 2)
    }
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch_size, cfg.block_size + 1), generator=g) for _ in range(4)]
    times = {ep: [] for ep in trainers}
    moved = {ep: [] for ep in trainers}
    a2a_s = {ep: [] for ep in trainers}
    load: dict[int, dict[str, list[int]]] = {ep: {} for ep in trainers}
    dropped = {ep: 0 for ep in trainers}
    try:
        for k in range(args.steps + 2):
            seq = batches[k % len(batches)]
            for ep, trainer in trainers.items():
                metrics = trainer.step(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
                if k < 2:
                    continue
                times[ep].append(metrics["step_time"])
                moved[ep].append(sum(s["all_to_all_bytes"] for s in metrics["stages"]))
                a2a_s[ep].append(sum(s["all_to_all_s"] for s in metrics["stages"]))
                for stage in metrics["stages"]:
                    for layer, routed in stage["experts"].items():
                        total = load[ep].setdefault(layer, [0] * args.experts)
                        load[ep][layer] = [a + b for a, b in zip(total, routed["routed"])]
                        dropped[ep] += routed["dropped"]
        info = {ep: trainer.stage_info() for ep, trainer in trainers.items()}
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
    tokens = args.batch_size * cfg.block_size
    rows = []
    for ep in trainers:
        step = statistics.median(times[ep])
        rows.append(
            {
                "ep": ep,
                "step_s": step,
                "tokens_per_s": tokens / step,
                "all_to_all_bytes_per_step": statistics.median(moved[ep]),
                "all_to_all_s_per_step": statistics.median(a2a_s[ep]),
                "expert_load_max_over_mean": {layer: max(c) / (sum(c) / len(c)) for layer, c in load[ep].items()},
                "assignments_per_expert": load[ep],
                "dropped_assignments": dropped[ep],
                "parameter_bytes_per_actor": max(i["parameter_bytes"] for i in info[ep]),
                "optimizer_state_bytes_per_actor": max(i["optimizer_state_bytes"] for i in info[ep]),
            }
        )
    rows[1]["tokens_per_s_over_ep1"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    for row in rows:
        json_out.emit(row)
    json_out.emit(
        {
            "benchmark": "moe",
            "cores": os.cpu_count(),
            "pp": args.pp,
            "dp": 2,
            "experts": args.experts,
            "top_k": args.top_k,
            "capacity_factor": args.capacity,
            "parameters": cfg.parameters,
            "rows": rows,
        }
    )


if __name__ == "__main__":
    json_out.run(main)
