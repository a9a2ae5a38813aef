"""Schedule efficiency with exactly simulated compute: how close raypipe gets to the ideal pipeline.

Each of p = 4 stages is one `SimulatedCompute` layer whose forward sleeps tf and
whose backward sleeps tb, so the result does not depend on how many cores the
machine has. For m in {4, 8, 16, 32}, tf = tb in {2, 10} ms and both schedules it
reports the measured step time (median of 5 `Trainer.step` calls, after 2 warm-up
steps; and per step of 5 steps through `Trainer.fit`, which queues the next step at
the actors while the driver waits for the current one), the ideal
(m + p - 1)(tf + tb), efficiency = ideal / measured, and the span of the actions
themselves (first start to last end, from the actors' timestamps). It also reports
how much longer than tf or tb an action took (median, from the same timestamps) and
the efficiency cap that sets: t / (t + that excess), what even a free engine would
reach with actions that long (the sleep's wake-up and Python around it, on the
machine at hand). At tf = tb = 0
it reports the per-action overhead: step time / (2 m p). It also reports each
stage's peak stashed microbatches (GPipe holds m, 1F1B at most p - s).

    python benchmarks/pipeline_efficiency.py [--quick] [--engines p2p,p2p:gloo]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.models.simulated import SimulatedCompute

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

P = 4


def simulated_trainer(t: float, engine: str = TrainConfig.engine) -> Trainer:
    """p stages of one SimulatedCompute layer each (forward and backward sleep t), nearly no CPU reserved.

    `engine` is an engine name, optionally with the same-node transport after a colon:
    "p2p" (its default, shared memory), "p2p:gloo", "compiled:gloo".
    """
    name, _, transport = engine.partition(":")
    layers = [LayerSpec(SimulatedCompute, t, t) for _ in range(P)]
    config = TrainConfig(
        pp=P,
        optimizer={"name": "sgd", "lr": 1e-3},
        cpus_per_actor=0.01,
        threads_per_actor=1,
        engine=name,
        same_node_transport=transport or TrainConfig.same_node_transport,
        name=f"efficiency-{name}-{transport or 'default'}",
        actor_steps=0,  # the driver books each step: on_step reads each step's timeline
    )
    return Trainer(layers, torch.nn.functional.mse_loss, config)


def measure(trainer: Trainer, schedule: str, m: int, steps: int, t: float) -> dict:
    """Median step time (and actions span) of `steps` `Trainer.step` calls after 2 warm-up
    steps, the median time an action took beyond `t`, the stash peaks, and the time per
    step of `steps` steps through `Trainer.fit` (which keeps the next step queued at the
    actors), right after."""
    trainer.reconfigure(schedule=schedule, microbatches=m)
    x, y = torch.randn(m, 8), torch.randn(m, 8)
    for _ in range(2):
        trainer.step(x, y)
    times, spans, excess, stashed = [], [], [], None
    for _ in range(steps):
        metrics = trainer.step(x, y)
        times.append(metrics["step_time"])
        line = trainer.timeline()
        spans.append(line.makespan / 1000)
        excess += [(a.end - a.start) / 1000 - t for a in line.spans]
        stashed = [s["peak_stashed_microbatches"] for s in metrics["stages"]]
    fit_spans = []  # on_step reads only the driver's copy of the timestamps: overlap stays safe
    started = time.perf_counter()
    trainer.fit(
        lambda _: (x, y),
        trainer.step_count + steps,
        overlap=True,
        on_step=lambda _: fit_spans.append(trainer.timeline().makespan / 1000),
    )
    fit_step = (time.perf_counter() - started) / steps
    step_s, span_s = statistics.median(times), statistics.median(spans)
    return {
        "step_s": step_s,
        "fit_step_s": fit_step,
        "actions_span_s": span_s,
        "action_excess_s": statistics.median(excess),
        # the time a step spends outside its actions: the call, the closing agreement, the
        # optimizer step, the reply; fit's queued step hides the call and the reply
        "outside_actions_s": step_s - span_s,
        "fit_outside_actions_s": fit_step - statistics.median(fit_spans),
        "peak_stashed_microbatches": stashed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="raypipe schedule efficiency on simulated stages")
    parser.add_argument("--quick", action="store_true", help="m = 16 only")
    parser.add_argument(
        "--engines",
        default="refs,p2p,compiled",
        help="comma-separated; each row is measured for each, alternating, so ratios between them "
        "are side by side; ENGINE:gloo sends between stages over gloo instead of shared memory",
    )
    args = parser.parse_args()
    engines = args.engines.split(",")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    micro = [16] if args.quick else [4, 8, 16, 32]
    rows = []
    for t in (0.0, 0.002, 0.010):
        trainers = {engine: simulated_trainer(t, engine) for engine in engines}
        for schedule in ("gpipe", "1f1b"):
            for m in micro:
                for engine, trainer in trainers.items():
                    result = measure(trainer, schedule, m, steps=5, t=t)
                    ideal = (m + P - 1) * 2 * t
                    row = {
                        "engine": engine,
                        "schedule": schedule,
                        "p": P,
                        "m": m,
                        "tf_ms": 1000 * t,
                        "tb_ms": 1000 * t,
                        "ideal_s": ideal,
                        **result,
                    }
                    if t > 0:
                        row["efficiency"] = ideal / result["step_s"]
                        row["efficiency_fit"] = ideal / result["fit_step_s"]
                        row["efficiency_of_actions_span"] = ideal / result["actions_span_s"]
                        row["efficiency_cap_of_actions"] = t / (t + result["action_excess_s"])
                    else:
                        row["overhead_per_action_us"] = 1e6 * result["step_s"] / (2 * m * P)
                        row["overhead_per_action_us_fit"] = 1e6 * result["fit_step_s"] / (2 * m * P)
                    rows.append(row)
                    json_out.emit(row)
        for trainer in trainers.values():
            trainer.shutdown()
    ray.shutdown()
    json_out.emit({"benchmark": "pipeline_efficiency", "rows": rows})


if __name__ == "__main__":
    json_out.run(main)
