"""Speed-aware partitioning on two device kinds, one 2x slower: uniform vs parameters vs profile.

A fake two-node cluster (`ray.cluster_utils.Cluster`) advertises a cuda node and a
rocm node, as `raypipe node-resources` would; stages run on the CPU there
(`allow_cpu_fallback`), and each layer is `SimulatedCompute` whose forward and
backward sleep for a time that is 2x longer on the rocm node. Layer times differ
(5 to 20 ms), and each layer's parameters are proportional to its time, so
`partition="parameters"` balances the work as if both devices were equal, and only
`partition="profile"` sees that rocm is slower. All three run in one invocation,
interleaved over rounds; reports each plan, the median step time, the ideal
balanced step time (work cut anywhere), the bound of the best contiguous split (tried
exhaustively) and the speed-up of profile over the others. A plan's bound is the
critical path: each stage once plus m - 1 microbatches of the slowest.

    python benchmarks/hetero_balance.py [--rounds 3] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.core.devices import LABEL_KIND
from raypipe.models.simulated import SimulatedCompute
from raypipe.planning.profiling import pipeline_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

MS = [5, 5, 10, 10, 20, 20, 10, 10]  # forward (= backward) time of each layer on the fast kind
SLOWDOWN = {"rocm": 2.0}
PARTITIONS = ("uniform", "parameters", "profile")


def layers() -> list[LayerSpec]:
    return [LayerSpec(SimulatedCompute, ms / 1000, ms / 1000, slowdown=SLOWDOWN, ballast=1000 * ms) for ms in MS]


def main() -> None:
    parser = argparse.ArgumentParser(description="speed-aware partitioning on two simulated device kinds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round, after one warm-up step")
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    m, p = args.microbatches, 2
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for kind in ("cuda", "rocm"):
            cluster.add_node(num_cpus=1, num_gpus=1, resources={kind: 1}, labels={LABEL_KIND: kind})
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        x = torch.randn(4 * m, 8)
        trainers = {}
        for partition in PARTITIONS:
            config = TrainConfig(
                pp=p,
                devices=["cuda", "rocm"],
                allow_cpu_fallback=True,
                cpus_per_actor=0.25,
                gpus_per_actor=0.3,
                microbatches=m,
                partition=partition,
                optimizer={"name": "sgd", "lr": 1e-3},
                name=f"balance-{partition}",
            )
            trainers[partition] = Trainer(
                layers(), torch.nn.functional.mse_loss, config, sample=(x, x), log=lambda _: None
            )
        times = {k: [] for k in PARTITIONS}
        for _ in range(args.rounds):
            for partition, trainer in trainers.items():
                trainer.step(x, x)
                times[partition] += [trainer.step(x, x)["step_time"] for _ in range(args.steps)]
        fast = [2 * ms / 1000 for ms in MS]  # forward + backward per microbatch
        per_microbatch = sum(fast) / (1 + 1 / SLOWDOWN["rocm"])  # work split so both stages take equally long
        rows = {}
        for partition, trainer in trainers.items():
            (a, b), (c, d) = trainer.plan
            stage_s = [sum(fast[a:b]), SLOWDOWN["rocm"] * sum(fast[c:d])]
            rows[partition] = {
                "plan": [list(r) for r in trainer.plan],
                "step_s": statistics.median(times[partition]),
                "plan_bound_s": pipeline_seconds(stage_s, m),
                **({"predicted_s": trainer.plan_report.step_seconds} if trainer.plan_report else {}),
            }
            trainer.shutdown()
        best = min(pipeline_seconds([sum(fast[:k]), SLOWDOWN["rocm"] * sum(fast[k:])], m) for k in range(1, len(MS)))
        result = {
            "layers_ms": MS,
            "slowdown": SLOWDOWN,
            "pp": p,
            "microbatches": m,
            "schedule": "1f1b",
            "ideal_balanced_s": (m + p - 1) * per_microbatch,  # if layers could be cut anywhere
            "best_split_bound_s": best,  # the best of all contiguous splits, found by trying each
            "partitions": rows,
            "profile_speedup_vs_uniform": rows["uniform"]["step_s"] / rows["profile"]["step_s"],
            "profile_speedup_vs_parameters": rows["parameters"]["step_s"] / rows["profile"]["step_s"],
            "profile_vs_best_split": rows["profile"]["step_s"] / best,
            "profile_vs_ideal": rows["profile"]["step_s"] / ((m + p - 1) * per_microbatch),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    json_out.emit(result, indent=1)


if __name__ == "__main__":
    json_out.run(main)
