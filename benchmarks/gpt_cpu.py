"""Tokens/s of the main job's GPT: plain PyTorch vs raypipe pp=1 and pp=2, side by side.

Every configuration runs in the same process and the same Ray, taking its steps in
turn (one step of plain, pp=1, pp=2, then the next of each), so background load hits
them alike. Each actor and the plain loop get one torch thread, so pp=1 vs plain doing
the same microbatches measures raypipe's overhead, and pp=2 what a second core buys
through the pipeline. Two plain loops run: torch's default AdamW (what a user writes)
and the fused AdamW raypipe's CPU stages use (to isolate the engine's own cost).
Each raypipe trainer runs twice: `raypipe_*` calls `Trainer.step` once per step (the
driver waits for each step before sending the next), `raypipe_fit_*` trains the same
steps through `Trainer.fit`, which keeps the next step queued at the actors. Every
runner takes `--block` steps per turn; times are per step. `--only` keeps the named
runners and their plain twins, for longer runs of one comparison.

    python benchmarks/gpt_cpu.py --rounds 3 --steps 4 --block 5 > gpt_cpu.json
    python benchmarks/gpt_cpu.py --only raypipe_fit_pp1_m4 --rounds 4 --steps 10 --block 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer, build_layers
from raypipe.data import TokenDataset
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, paired_ratio, plain_twin, round_means  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured turns per round")
    parser.add_argument("--block", type=int, default=5, help="steps per turn")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--engine", default=TrainConfig.engine, help="raypipe engine: p2p, compiled or refs")
    parser.add_argument("--only", default="", help="comma-separated runners to keep (with their plain twins)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    model_cfg = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
    g = torch.Generator().manual_seed(0)
    data = TokenDataset(torch.randint(0, 256, (200_000,), generator=g).numpy(), model_cfg.block_size)
    optimizer = {"name": "adamw", "lr": 1e-3}
    tokens_per_step = args.batch_size * model_cfg.block_size

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    # the loop a user writes (torch's default AdamW: a per-tensor loop on CPU), and the same
    # loop with the fused AdamW that raypipe's CPU stages use, to separate the engine's cost
    plain = {flavour: torch.nn.Sequential(*build_layers(gpt.layers(model_cfg))) for flavour in ("torch", "fused")}
    plain_opt = {
        "torch": torch.optim.AdamW(plain["torch"].parameters(), lr=1e-3),
        "fused": torch.optim.AdamW(plain["fused"].parameters(), lr=1e-3, fused=True),
    }

    def plain_steps(turn: int, microbatches: int = 1, flavour: str = "torch") -> None:
        for step in range(turn * args.block, (turn + 1) * args.block):
            x, y = data.batch(step, args.batch_size)
            model, opt = plain[flavour], plain_opt[flavour]
            opt.zero_grad()
            for xc, yc in zip(x.chunk(microbatches), y.chunk(microbatches)):
                (gpt.loss_fn(model(xc), yc) / microbatches).backward()
            opt.step()

    def raypipe_steps(trainer: Trainer, turn: int) -> None:
        for step in range(turn * args.block, (turn + 1) * args.block):
            trainer.step(*data.batch(step, args.batch_size))

    def raypipe_fit(trainer: Trainer, turn: int) -> None:
        first = trainer.step_count
        trainer.fit(lambda step: data.batch(turn * args.block + step - first, args.batch_size), first + args.block)

    m = args.microbatches
    flavours = ("torch", "fused")
    runners = {
        f"plain_{flavour}_m{mb}": (lambda turn, mb=mb, flavour=flavour: plain_steps(turn, mb, flavour))
        for flavour in flavours
        for mb in (1, m)
    }
    shapes = {f"raypipe_pp{pp}_m{mb}": (pp, mb) for pp, mb in ((1, 1), (1, m), (2, m))}
    fit_name = lambda name: name.replace("raypipe_", "raypipe_fit_")
    every = [*runners, *shapes, *map(fit_name, shapes)]
    only = [name for name in args.only.split(",") if name]
    if set(only) - set(every):
        parser.error(f"--only: unknown runner(s) {sorted(set(only) - set(every))}; choose from {every}")
    wanted = (
        set(only) | {plain_twin(n, f) for n in only if n.startswith("raypipe") for f in flavours}
        if only
        else set(every)
    )
    trainers = {
        name: Trainer(
            gpt.layers(model_cfg),
            gpt.loss_fn,
            TrainConfig(
                pp=pp, microbatches=mb, optimizer=optimizer, cpus_per_actor=0.5, threads_per_actor=1, engine=args.engine
            ),
        )
        for name, (pp, mb) in shapes.items()
        if name in wanted or fit_name(name) in wanted
    }
    runners.update({name: (lambda turn, t=t: raypipe_steps(t, turn)) for name, t in trainers.items()})
    runners.update({fit_name(name): (lambda turn, t=t: raypipe_fit(t, turn)) for name, t in trainers.items()})
    runners = {name: run for name, run in runners.items() if name in wanted}

    per_turn = interleaved(runners, args.rounds, args.steps, warmup=-(-3 // args.block))  # 3 steps or more
    per_step = {name: [[s / args.block for s in r] for r in rounds] for name, rounds in per_turn.items()}
    seconds = round_means(per_step)
    for t in trainers.values():
        t.shutdown()
    ray.shutdown()

    best = {name: min(v) for name, v in seconds.items()}
    result = {
        "benchmark": "gpt_cpu",
        "machine": {"cpus": 2, "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__},
        "model": {"parameters": model_cfg.parameters, "n_layer": 4, "n_embd": 128, "block_size": 64},
        "engine": args.engine,
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "turns_per_round": args.steps,
        "steps_per_turn": args.block,
        "rounds": args.rounds,
        "step_seconds_per_round": seconds,
        "step_seconds_median": {k: statistics.median(t for r in v for t in r) for k, v in per_step.items()},
        "tokens_per_s_best": {k: tokens_per_step / v for k, v in best.items()},
        # raypipe against plain PyTorch doing the same microbatches (the engine's overhead)
        "ratio_vs_plain_same_microbatches": {
            k: best[plain_twin(k)] / v for k, v in best.items() if k.startswith("raypipe")
        },
        "ratio_vs_plain_same_microbatches_median_of_steps": {
            k: paired_ratio(per_step, plain_twin(k), k) for k in seconds if k.startswith("raypipe")
        },
        # against a plain loop with the same fused AdamW: what the engine itself costs
        "ratio_vs_plain_fused_same_microbatches_median_of_steps": {
            k: paired_ratio(per_step, plain_twin(k, "fused"), k) for k in seconds if k.startswith("raypipe")
        },
        "ratio_vs_plain_m1": {
            k: best["plain_torch_m1"] / v for k, v in best.items() if k != "plain_torch_m1" and "plain_torch_m1" in best
        },
    }
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
