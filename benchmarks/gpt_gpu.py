"""The reference GPT on one accelerator: plain PyTorch vs raypipe pp=1 and pp=2 sharing it.

With `--device cuda` (the default where CUDA is present) the GPT has GPT-2 small's
shape (12 blocks, 12 heads, n_embd 768, block 1024, vocabulary 50304: 124M
parameters) and trains in bf16 autocast with AdamW on random tokens (nothing to
download). The plain loop, raypipe pp=1 and raypipe pp=2 (both stages on the one GPU,
`gpus_per_actor=0.25` so every trainer fits at once) take their steps in turn in one
process (on a CPU the plain loop computes with one thread, as each actor does); reports
tokens/s, the ratio to plain PyTorch pair by pair with its spread, and MFU: model FLOPs
per token (6 N + 12 L d T, as PaLM counts them) x tokens/s over the device's bf16 dense
peak (H100/H200: 989 TFLOPS; others: `--peak-tflops`).

`--device cpu --size tiny` runs the same code small, to check the script itself.

`--links` (two GPUs or more) instead compares pp = 2 with each stage on a GPU of its own, linked
over NCCL (`device_links="auto"`) or through host memory (`"host"`): the two trainers cannot
hold both GPUs at once, so each round builds one, times its steps, shuts it down, then the
other; reports step seconds per round and the ratio host / NCCL of the medians.

    python benchmarks/gpt_gpu.py [--rounds 3 --steps 10 --batch-size 8 --microbatches 4]
    python benchmarks/gpt_gpu.py --links [--rounds 3 --steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer, build_layers, driver
from raypipe.models import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, match_actor_threads, paired_ratio, plain_twin, ratio_with_spread, round_means  # noqa: E402

SIZES = {
    "124m": gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny": gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.05}


def peak_tflops(device: str, given: float | None) -> float | None:
    if given is not None or device != "cuda":
        return given
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--size", default=None, choices=sorted(SIZES), help="124m on cuda, tiny on cpu by default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 dense peak")
    parser.add_argument("--links", action="store_true", help="pp = 2 on two GPUs: NCCL vs the host path")
    args = parser.parse_args()
    cfg = SIZES[args.size or ("124m" if args.device == "cuda" else "tiny")]
    precision = "bf16" if args.device == "cuda" else "fp32"
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    driver.connect()  # a local Ray advertising this machine's accelerators, as raypipe node-resources would

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    optimizer = {"name": "adamw", "lr": 3e-4}
    if args.links:
        json_out.emit(compare_links(cfg, args, precision, optimizer, batch), indent=1)
        ray.shutdown()
        return
    match_actor_threads(args.device, 1)  # the trainers' threads_per_actor below
    plain = torch.nn.Sequential(*build_layers(gpt.layers(cfg))).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4)

    def plain_step(step: int, microbatches: int) -> None:
        x, y = (t.to(device) for t in batch(step))
        plain_opt.zero_grad(set_to_none=True)
        for xc, yc in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = gpt.loss_fn(plain(xc), yc) / microbatches
            loss.backward()
        plain_opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    m = args.microbatches
    trainers = {
        f"raypipe_pp{pp}_m{mb}": Trainer(
            gpt.layers(cfg),
            gpt.loss_fn,
            TrainConfig(
                pp=pp,
                microbatches=mb,
                optimizer=optimizer,
                precision=precision,
                devices=args.device,
                gpus_per_actor=0.25,
                name=f"gpt-bench-pp{pp}-m{mb}",
                **({"cpus_per_actor": 0.5, "threads_per_actor": 1} if args.device == "cpu" else {}),
            ),
        )
        for pp, mb in ((1, 1), (1, m), (2, m))
    }
    runners = {
        "plain_torch_m1": lambda step: plain_step(step, 1),
        f"plain_torch_m{m}": lambda step: plain_step(step, m),
    }
    runners.update({name: (lambda step, t=t: t.step(*batch(step))) for name, t in trainers.items()})
    per_step = interleaved(runners, args.rounds, args.steps)
    seconds = round_means(per_step)
    for t in trainers.values():
        t.shutdown()
    ray.shutdown()

    tokens = args.batch_size * cfg.block_size
    best = {name: min(v) for name, v in seconds.items()}
    rate = {name: tokens / s for name, s in best.items()}
    flops_per_token = 6 * cfg.parameters + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    peak = peak_tflops(args.device, args.peak_tflops)
    json_out.emit(
        {
            "benchmark": "gpt_gpu",
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "model": {
                "parameters": cfg.parameters,
                "n_layer": cfg.n_layer,
                "n_embd": cfg.n_embd,
                "block_size": cfg.block_size,
                "vocab_size": cfg.vocab_size,
            },
            "precision": precision,
            "batch_size": args.batch_size,
            "microbatches": m,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "step_seconds_per_round": seconds,
            "step_seconds_median": {k: statistics.median(t for r in v for t in r) for k, v in per_step.items()},
            "tokens_per_s_best": rate,
            "ratio_vs_plain_same_microbatches": {
                k: best[plain_twin(k)] / v for k, v in best.items() if k.startswith("raypipe")
            },
            "ratio_vs_plain_same_microbatches_median_of_steps": {
                k: paired_ratio(per_step, plain_twin(k), k) for k in seconds if k.startswith("raypipe")
            },
            # raypipe's tokens/s over the plain loop's on the same microbatches, pair by pair
            "ratios": {
                f"{k}_over_plain": ratio_with_spread(per_step, plain_twin(k), k)
                for k in seconds
                if k.startswith("raypipe")
            },
            "mfu": {k: flops_per_token * v / (peak * 1e12) for k, v in rate.items()} if peak else None,
            "peak_tflops": peak,
        },
        indent=1,
    )


def compare_links(cfg: gpt.GPTConfig, args: argparse.Namespace, precision: str, optimizer: dict, batch) -> dict:
    """pp = 2 with a GPU per stage, over NCCL and through host memory, one trainer at a time in
    alternating rounds (both need both GPUs)."""
    import time

    if args.device != "cuda" or torch.cuda.device_count() < 2:
        raise SystemExit("--links needs two GPUs or more on this node: a stage per GPU")
    seconds: dict[str, list[float]] = {"nccl": [], "host": []}
    links: dict[str, list] = {}
    for _ in range(args.rounds):
        for mode in ("nccl", "host"):
            config = TrainConfig(
                pp=2,
                microbatches=args.microbatches,
                optimizer=optimizer,
                precision=precision,
                devices="cuda",
                gpus_per_actor=1,
                device_links="auto" if mode == "nccl" else "host",
                name=f"gpt-links-{mode}",
            )
            with Trainer(gpt.layers(cfg), gpt.loss_fn, config) as trainer:
                links[mode] = [i["links"] for i in trainer.stage_info()]
                for step in range(2):  # warm-up: allocator, NCCL's buffers
                    trainer.step(*batch(step))
                for step in range(args.steps):
                    started = time.perf_counter()
                    trainer.step(*batch(2 + step))
                    seconds[mode].append(time.perf_counter() - started)
    median = {mode: statistics.median(v) for mode, v in seconds.items()}
    return {
        "benchmark": "gpt_gpu_links",
        "device": torch.cuda.get_device_name(0),
        "precision": precision,
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "rounds": args.rounds,
        "links": links,
        "step_seconds": seconds,
        "step_seconds_median": median,
        "tokens_per_s": {mode: args.batch_size * cfg.block_size / s for mode, s in median.items()},
        "host_over_nccl_step_time": median["host"] / median["nccl"],
    }


if __name__ == "__main__":
    json_out.run(main)
