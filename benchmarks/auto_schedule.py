"""schedule="auto" against the measured steps: the main job's GPT (`examples/configs/gpt_pp2.yaml`:
4 blocks of 128, batch 32 x 64 tokens, AdamW) at pp = 2 and 4.

For each pp a Trainer with `schedule="auto"` profiles the layers and ranks every candidate
(schedule, chunks, microbatches); then every candidate that fits is run with the split auto
planned for it (`shard_plan`), `--steps` steps after two warm-ups, once per round, all the
candidates in turn each round (the load of a 2-core machine drifts), and the median of its
rounds is set beside its prediction. Trainers are shared where the layout and split are the
same (a change of schedule or microbatches is a `reconfigure`). Reported per candidate: predicted and measured
step, their ratio; per pp: auto's pick, the measured fastest, and the pick's measured step over
the fastest's (1.0: auto picked the fastest).

    python benchmarks/auto_schedule.py [--steps 5] [--rounds 3] [--pp 2,4] [--lora]

`--lora`: the same GPT with rank-4 adapters on its attention and MLP projections, the rest frozen.
`--simulated`: eight simulated layers instead (F, I and W 4 ms each, batch 16): sleeps that take
no CPU, so the predictions meet a workload the cores cannot distort (the suite once asserted
these within 15 %; a timing claim belongs here, not in a test).
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
from raypipe.planning.autoschedule import predicted_seconds, rank
from raypipe.planning.profiling import plan_from_profiles

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

GPT = gpt.GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64)
BATCH = 32
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["c_attn", "c_proj", "c_fc"]}


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    if SIMULATED:
        return torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    seq = torch.randint(0, GPT.vocab_size, (BATCH, GPT.block_size + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


SIMULATED = False  # set by --simulated before any run


def workload() -> tuple[list, object]:
    """The layers and loss timed: the GPT's, or eight simulated layers (`--simulated`)."""
    if SIMULATED:
        from raypipe import LayerSpec
        from raypipe.models.simulated import SimulatedCompute

        return [
            LayerSpec(SimulatedCompute, 0.004, 0.004, weight_s=0.004) for _ in range(8)
        ], torch.nn.functional.mse_loss
    return gpt.layers(GPT), gpt.loss_fn


def measure(trainer: Trainer, steps: int) -> float:
    for k in range(2):
        trainer.step(*batch(k))
    return statistics.median(trainer.step(*batch(2 + k))["step_time"] for k in range(steps))


def run_pp(pp: int, steps: int, rounds: int, lora: dict | None) -> dict:
    base = TrainConfig(
        pp=pp,
        schedule="auto",
        optimizer={"name": "adamw", "lr": 1e-3},
        cpus_per_actor=0.01,
        lora=lora,
        name=f"auto-pp{pp}",
    )
    specs, loss_fn = workload()
    with Trainer(specs, loss_fn, base, sample=batch(0), log=lambda line: None) as auto:
        chosen = auto.config
        profiled = auto.plan_report.profiled_microbatches
    choice = rank(profiled, specs, base)
    candidates = [c for c in choice.candidates if c.step_seconds is not None]
    trainers: dict[tuple, Trainer] = {}
    runs = []  # (candidate, its config, its plan report, its trainer's key)
    try:
        for c in candidates:
            cfg = base.replace(
                schedule=c.schedule, chunks=c.chunks, microbatches=c.microbatches, extra_warmup=c.extra_warmup
            )
            report = plan_from_profiles(profiled[c.microbatches], cfg.stage_kinds(), cfg.replace(partition="profile"))
            key = (cfg.num_chunks(), c.schedule if cfg.num_chunks() > 1 else "flat", tuple(map(tuple, report.plan)))
            if key not in trainers:
                own = cfg.replace(shard_plan=[list(r) for r in report.plan], name=f"{cfg.name}-{len(trainers)}")
                trainers[key] = Trainer(specs, loss_fn, own)
            runs.append((c, cfg, report, key))
        measured: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        for _ in range(rounds):  # every candidate once per round, so drifting load hits them alike
            for i, (c, _, _, key) in enumerate(runs):
                trainers[key].reconfigure(schedule=c.schedule, microbatches=c.microbatches)
                measured[i].append(measure(trainers[key], steps))
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
    rows = []
    for i, (c, cfg, report, _) in enumerate(runs):
        predicted, seconds = predicted_seconds(cfg, report), statistics.median(measured[i])
        row = {
            "pp": pp,
            "schedule": c.schedule,
            "chunks": c.chunks,
            "microbatches": c.microbatches,
            "plan": report.plan,
            "predicted_s": predicted,
            "measured_s": seconds,
            "measured_per_round_s": measured[i],
            "measured_over_predicted": seconds / predicted,
        }
        rows.append(row)
        json_out.emit(row)
    fastest = min(rows, key=lambda r: r["measured_s"])
    pick = next(r for r in rows if (r["schedule"], r["microbatches"]) == (chosen.schedule, chosen.microbatches))
    return {
        "pp": pp,
        "lora": lora is not None,
        "picked": f"{pick['schedule']} m={pick['microbatches']}",
        "fastest": f"{fastest['schedule']} m={fastest['microbatches']}",
        "picked_over_fastest": pick["measured_s"] / fastest["measured_s"],
        "worst_prediction_error": max(abs(r["measured_over_predicted"] - 1) for r in rows),
        "rows": rows,
        "profiles": {m: p for m, p in profiled.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per candidate and round (after 2 warm-ups)")
    parser.add_argument("--rounds", type=int, default=3, help="every candidate runs once per round; medians")
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--simulated", action="store_true", help="eight simulated 4 ms layers, not the GPT")
    args = parser.parse_args()
    global SIMULATED
    SIMULATED = args.simulated
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    lora = LORA if args.lora else None
    results = [run_pp(int(pp), args.steps, args.rounds, lora) for pp in args.pp.split(",")]
    ray.shutdown()
    for r in results:
        json_out.emit({k: v for k, v in r.items() if k not in ("rows", "profiles")})
    workload_name = "simulated 8 x 4 ms" if args.simulated else "gpt 4x128"
    json_out.emit(
        {"benchmark": "auto_schedule", "workload": workload_name, "cores": os.cpu_count(), "results": results}
    )


if __name__ == "__main__":
    json_out.run(main)
