"""Draws a pipeline step as it really ran next to the plan, from the actors' own timestamps.

Four stages whose compute is simulated (each forward sleeps 10 ms, each backward
20 ms), 8 microbatches, 1F1B. Writes the measured and planned charts (SVG, and PNG
where Graphviz is installed) and a Chrome trace of the measured step (open it in
https://ui.perfetto.dev or chrome://tracing).

    python examples/timeline.py [--schedule gpipe] [--out docs]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.models.simulated import SimulatedCompute  # layers of a set compute time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--out", default="runs/timeline")
    args = parser.parse_args()
    p, m, tf, tb = 4, 8, 0.010, 0.020
    layers = [LayerSpec(SimulatedCompute, tf, tb) for _ in range(p)]
    config = TrainConfig(
        pp=p, microbatches=m, schedule=args.schedule, optimizer={"name": "sgd", "lr": 1e-3}, cpus_per_actor=0.01
    )
    x, y = torch.randn(m * 2, 8), torch.randn(m * 2, 8)
    with Trainer(layers, torch.nn.functional.mse_loss, config) as trainer:
        for _ in range(3):  # the first steps warm up
            step_time = trainer.step(x, y)["step_time"]
        measured, planned = trainer.timeline(), trainer.timeline(planned=True)
    out = Path(args.out)
    kinds = [".svg", ".json"] + ([".png"] if shutil.which("dot") else [])
    for suffix in kinds:
        print("wrote", measured.save(out / f"timeline-{args.schedule}-measured{suffix}"))
    print("wrote", planned.save(out / f"timeline-{args.schedule}-planned.svg"))
    ideal = (m + p - 1) * (tf + tb) * 1000
    print(
        f"step {1000 * step_time:.1f} ms (driver), actions span {measured.makespan:.1f} ms, "
        f"ideal (m+p-1)(tf+tb) = {ideal:.1f} ms; idle per stage: "
        + ", ".join(f"{100 * b:.0f}%" for b in measured.bubble())
    )


if __name__ == "__main__":
    main()
