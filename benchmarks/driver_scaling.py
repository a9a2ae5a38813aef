"""What the driver spends per step as the actor count grows (issue 40).

Tiny layers (an 8 x 8 linear per stage; with tp, an 8-16-8 MLP split over the tp ranks), so the
step is the engine's and the driver's own cost.
For each shape (pp x dp, or pp x dp x tp: 2 to 32 actors), engine and input (a function of the
step the driver calls and cuts, or a Ray Data dataset read by a reader actor beside the stages),
one trainer runs `fit` for `--warmup` steps and then `--steps` more, and the report gives per
step in that steady state (from the warm-up's last step booked to the last one): the driver
process's CPU time (getrusage: user + system, every thread of the process, so the 2-core
machine's contention does not hide it the way wall time would), the step's wall time (median of
`step_time`), and the bytes the driver cut and shipped to the actors (the batch itself when
driver-fed; none with Ray Data). Then the least-squares slope of driver CPU
per added actor, per engine and input. On 2 cores the step's wall time grows with the actors,
and a Ray driver spends CPU for every second a call of its is in flight (~10 ms/s measured here,
whatever it waits on), so `--pace S` also runs each shape with every batch taking at least S s to
come (a sleep in the reader): each shape's step then lasts about as long and the driver's CPU
per step compares like with like. After each shape's run the driver's idle CPU per second is
measured for 5 s with the same actors alive (Ray's floor, which moves between runs more than
between shapes), and each row also gives the run's CPU per second and what it spent above that
floor per step. "actors" is the p2p engine with `TrainConfig.actor_steps`:
the whole `fit` is one actor-driven run, begun in the warm-up. "auto" is the default config with
`fit(overlap=True)`, the row's `driven_by` saying whether "auto" handed the actors the steps.

    .venv/bin/python benchmarks/driver_scaling.py --out driver_scaling.json  # ~25 min on 2 cores
    .venv/bin/python benchmarks/driver_scaling.py --shapes 2x1 8x4 --engines p2p actors --inputs dataset  # quick
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.actors.io.reader import default_collate
from raypipe.nn import ColumnParallel, RowParallel

WIDTH, ROWS_PER_MICROBATCH, MICROBATCHES = 8, 4, 4
IDLE_S = 5.0  # seconds each shape's idle floor is measured over, after its run
SHAPES = {
    "2x1": (2, 1, 1),
    "2x2": (2, 2, 1),
    "4x2": (4, 2, 1),
    "4x4": (4, 4, 1),
    "8x4": (8, 4, 1),
    "2x2x2": (2, 2, 2),
    "4x2x2": (4, 2, 2),
    "4x4x2": (4, 4, 2),
}


def idle_cpu_per_s(seconds: float) -> float:
    """The driver's CPU seconds per second while it waits on nothing: Ray's own floor (its core
    worker's threads), which a driver pays whatever it asks, for as long as it runs."""
    cpu, clock = driver_cpu(), time.perf_counter()
    time.sleep(seconds)
    return (driver_cpu() - cpu) / (time.perf_counter() - clock)


def driver_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Block(nn.Module):
    """A tiny MLP block whose two linears split across tp ranks (the tp shapes' layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def tp_plan(self, tp_size: int) -> dict:
        return {"fc1": ColumnParallel(), "fc2": RowParallel()}


def paced(pace: float, make: Any) -> Any:
    """`make`, taking at least `pace` s: every shape's step then lasts about as long."""

    def batch(arg: Any) -> Any:
        time.sleep(pace)
        return make(arg)

    return batch


def measure(pp: int, dp: int, tp: int, engine: str, source: str, warmup: int, steps: int, pace: float) -> dict:
    rows = dp * MICROBATCHES * ROWS_PER_MICROBATCH
    x, y = torch.randn(rows, WIDTH), torch.randn(rows, WIDTH)
    config = TrainConfig(
        pp=pp,
        dp=dp,
        tp=tp,
        microbatches=MICROBATCHES,
        engine="p2p" if engine in ("actors", "auto") else engine,
        actor_steps=warmup + steps if engine == "actors" else "auto" if engine == "auto" else 0,
        cpus_per_actor=0.04,
        threads_per_actor=1,
        optimizer={"name": "sgd", "lr": 0.01},
        loggers=[],
        actor_start_timeout=600,
        name=f"drv-{pp}x{dp}x{tp}-{engine}-{source}",
    )
    if source == "dataset":
        data = ray.data.from_items(
            [{"x": x[i % rows].numpy(), "y": y[i % rows].numpy()} for i in range(rows * (warmup + steps))],
            override_num_blocks=4,
        )
    layers = [LayerSpec(nn.Linear, WIDTH, WIDTH) if tp == 1 else LayerSpec(Block, WIDTH) for _ in range(pp)]
    spent, booked = [], []  # the driver's CPU time and the clock as each step is booked
    overlap = True if engine == "auto" else None  # on_step only reads: "auto" may hand the actors the fit
    with Trainer(layers, nn.functional.mse_loss, config) as trainer:
        record = lambda metrics: (spent.append(driver_cpu()), booked.append(time.perf_counter()))  # noqa: E731
        if source == "dataset":
            collate = paced(pace, default_collate) if pace else None
            history = trainer.fit(
                data,
                warmup + steps,
                batch_size=rows,
                collate=collate,
                on_step=record,
                log=lambda line: None,
                overlap=overlap,
            )
        else:
            batches = paced(pace, lambda k: (x, y)) if pace else lambda k: (x, y)
            history = trainer.fit(batches, warmup + steps, on_step=record, log=lambda line: None, overlap=overlap)
        driven_by = "actors" if trainer.group.board is not None else "driver"
        idle = idle_cpu_per_s(IDLE_S)  # the same actors alive, nothing asked of them
    spent, wall = spent[-1] - spent[warmup - 1], booked[-1] - booked[warmup - 1]
    return {
        "pp": pp,
        "dp": dp,
        "tp": tp,
        "actors": pp * dp * tp,
        "engine": engine,
        "driven_by": driven_by,
        "input": source,
        "pace_s": pace,
        "driver_cpu_ms_per_step": 1e3 * spent / steps,
        "driver_cpu_ms_per_s": 1e3 * spent / wall,
        "idle_driver_cpu_ms_per_s": 1e3 * idle,
        "above_idle_ms_per_step": 1e3 * (spent - idle * wall) / steps,
        "step_ms": 1e3 * statistics.median(m["step_time"] for m in history[-steps:]),
        "wall_ms_per_step": 1e3 * wall / steps,
        "driver_fed_bytes_per_step": 0 if source == "dataset" else x.nbytes + y.nbytes,
    }


def slopes(rows: list[dict]) -> dict:
    """Per engine and input: driver CPU ms per added actor (least squares) and the 32-to-2 ratio."""
    out = {}
    for key in sorted({(r["engine"], r["input"], r["pace_s"]) for r in rows}):
        mine = [r for r in rows if (r["engine"], r["input"], r["pace_s"]) == key and r["tp"] == 1]
        mine.sort(key=lambda r: r["actors"])
        actors = np.array([r["actors"] for r in mine], dtype=float)
        cpu = np.array([r["driver_cpu_ms_per_step"] for r in mine])
        per_s = [r["driver_cpu_ms_per_s"] for r in mine]
        if len(mine) < 2:
            continue
        slope, intercept = np.polyfit(actors, cpu, 1)
        out["/".join(map(str, key))] = {
            "ms_per_added_actor": float(slope),
            "ms_at_zero_actors": float(intercept),
            "largest_over_smallest": float(cpu[-1] / cpu[0]),
            # per second of the run: per step at equal step times (what a pace makes them)
            "largest_over_smallest_per_s": float(per_s[-1] / per_s[0]),
            "at_1000_actors_ms": float(intercept + 1000 * slope),
            "at_10000_actors_ms": float(intercept + 10000 * slope),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="pp x dp (x tp)")
    engines = ["p2p", "actors", "compiled", "refs", "auto"]
    parser.add_argument("--engines", nargs="+", default=engines[:3], choices=engines)
    parser.add_argument("--inputs", nargs="+", default=["function", "dataset"], choices=["function", "dataset"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pace", nargs="+", type=float, default=[0.0, 0.3], help="s each batch takes at least")
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
                    for pace in args.pace:
                        row = measure(*SHAPES[shape], engine, source, args.warmup, args.steps, pace)
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
