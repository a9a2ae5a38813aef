"""What `boundary_dtype="bf16"` costs in loss and saves in bytes: the main job, fp32 vs bf16 boundaries.

Runs the main job (`examples/configs/gpt_pp2.yaml`: GPT, pp=2, 1F1B, 4 microbatches,
AdamW with cosine schedule) twice from the same seed, once sending activations and
gradients between the stages in fp32 and once in bf16, and reports per run the
training losses (mean of the first and last 10 steps), the validation loss at the
end, the largest per-step loss difference, the bytes sent between the stages per
step and tokens/s. TensorBoard logging and the text sample are off.

    python benchmarks/boundary_dtype.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ray

from raypipe.job import JobConfig, run

CONFIG = Path(__file__).resolve().parent.parent / "examples/configs/gpt_pp2.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description="fp32 vs bf16 stage boundaries on the main job")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    runs = {}
    try:
        for dtype in ("fp32", "bf16"):
            config = JobConfig.from_yaml(
                CONFIG,
                [
                    f"boundary_dtype={dtype}",
                    f"job.steps={args.steps}",
                    f"optim.lr_schedule.total_steps={args.steps}",
                    "log_dir=null",
                    "job.sample_tokens=0",
                    "job.progress=false",
                    f"name=boundary-{dtype}",
                ],
            )
            sent = []
            summary = run(
                config,
                log=lambda line: None,
                on_metrics=lambda m: sent.append(sum(s["sent_bytes"] for s in m["stages"])),
            )
            losses = summary["losses"]
            runs[dtype] = {
                "loss_first10": sum(losses[:10]) / 10,
                "loss_last10": sum(losses[-10:]) / 10,
                "val_last": summary["val_last"],
                "sent_bytes_per_step": sent[-1],
                "tokens_per_s": sum(summary["tokens_per_s"]) / len(summary["tokens_per_s"]),
                "losses": losses,
            }
    finally:
        ray.shutdown()
    diffs = [abs(a - b) for a, b in zip(runs["fp32"]["losses"], runs["bf16"]["losses"])]
    result = {
        "config": str(CONFIG.name),
        "steps": args.steps,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in runs.items()},
        "max_step_loss_diff": max(diffs),
        "val_loss_diff": runs["bf16"]["val_last"] - runs["fp32"]["val_last"],
        "bytes_ratio": runs["bf16"]["sent_bytes_per_step"] / runs["fp32"]["sent_bytes_per_step"],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
