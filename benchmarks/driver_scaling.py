"""What the driver spends per step as the actor count grows (issue 40, "measure first").

Tiny layers (an 8 x 8 linear per stage), so the step is the engine's and the driver's own cost.
For each shape (pp x dp: 2, 4, 8, 16 and 32 actors), engine and input (a function of the step the
driver calls and cuts, or a Ray Data dataset read by a reader actor beside the stages), one trainer
runs `fit` for `--warmup` steps and then `--steps` more, and the report gives per step in that
steady state: the driver process's CPU time (getrusage: user + system, every thread of the
process, so the 2-core machine's contention does not hide it the way wall time would), the
step's wall time (median of `step_time`), and the bytes the driver cut and shipped to the actors
(the batch itself when driver-fed; none with Ray Data). Then the least-squares slope of driver CPU
per added actor, per engine and input.

    .venv/bin/python benchmarks/driver_scaling.py --out driver_scaling.json  # ~11 min on 2 cores
    .venv/bin/python benchmarks/driver_scaling.py --shapes 2x1 4x4 --engines p2p --inputs function  # quick

Not measured yet: tensor-parallel shapes (pp x dp x tp).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys

import numpy as np
import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer

WIDTH, ROWS_PER_MICROBATCH, MICROBATCHES = 8, 4, 4
SHAPES = {"2x1": (2, 1), "2x2": (2, 2), "4x2": (4, 2), "4x4": (4, 4), "8x4": (8, 4)}


def driver_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(pp: int, dp: int, engine: str, source: str, warmup: int, steps: int) -> dict:
    rows = dp * MICROBATCHES * ROWS_PER_MICROBATCH
    x, y = torch.randn(rows, WIDTH), torch.randn(rows, WIDTH)
    config = TrainConfig(
        pp=pp,
        dp=dp,
        microbatches=MICROBATCHES,
        engine=engine,
        cpus_per_actor=0.04,
        threads_per_actor=1,
        optimizer={"name": "sgd", "lr": 0.01},
        loggers=[],
        actor_start_timeout=600,
        name=f"drv-{pp}x{dp}-{engine}-{source}",
    )
    if source == "dataset":
        data = ray.data.from_items(
            [{"x": x[i % rows].numpy(), "y": y[i % rows].numpy()} for i in range(rows * (warmup + steps))],
            override_num_blocks=4,
        )
    layers = [LayerSpec(nn.Linear, WIDTH, WIDTH) for _ in range(pp)]
    with Trainer(layers, nn.functional.mse_loss, config) as trainer:

        def run(to: int) -> list[dict]:
            if source == "dataset":
                return trainer.fit(data, to, batch_size=rows, log=lambda line: None)
            return trainer.fit(lambda k: (x, y), to, log=lambda line: None)

        run(warmup)
        before = driver_cpu()
        history = run(warmup + steps)
        spent = driver_cpu() - before
    return {
        "pp": pp,
        "dp": dp,
        "actors": pp * dp,
        "engine": engine,
        "input": source,
        "driver_cpu_ms_per_step": 1e3 * spent / steps,
        "step_ms": 1e3 * statistics.median(m["step_time"] for m in history[-steps:]),
        "driver_fed_bytes_per_step": 0 if source == "dataset" else x.nbytes + y.nbytes,
    }


def slopes(rows: list[dict]) -> dict:
    """Per engine and input: driver CPU ms per added actor (least squares) and the 32-to-2 ratio."""
    out = {}
    for key in sorted({(r["engine"], r["input"]) for r in rows}):
        mine = sorted((r for r in rows if (r["engine"], r["input"]) == key), key=lambda r: r["actors"])
        actors = np.array([r["actors"] for r in mine], dtype=float)
        cpu = np.array([r["driver_cpu_ms_per_step"] for r in mine])
        if len(mine) < 2:
            continue
        slope, intercept = np.polyfit(actors, cpu, 1)
        out["/".join(key)] = {
            "ms_per_added_actor": float(slope),
            "ms_at_zero_actors": float(intercept),
            "largest_over_smallest": float(cpu[-1] / cpu[0]),
            "at_1000_actors_ms": float(intercept + 1000 * slope),
            "at_10000_actors_ms": float(intercept + 10000 * slope),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="pp x dp")
    parser.add_argument("--engines", nargs="+", default=["p2p", "compiled"], choices=["p2p", "compiled", "refs"])
    parser.add_argument("--inputs", nargs="+", default=["function", "dataset"], choices=["function", "dataset"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="also write the JSON here (Ray's own warnings may share stdout)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = []
    try:
        for shape in args.shapes:
            for engine in args.engines:
                for source in args.inputs:
                    row = measure(*SHAPES[shape], engine, source, args.warmup, args.steps)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    report = json.dumps({"benchmark": "driver_scaling", "cpus": 2, "rows": rows, "slopes": slopes(rows)}, indent=1)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
