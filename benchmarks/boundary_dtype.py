"""What narrower stage boundaries cost in loss and save in bytes: bf16, and 8-bit compression of the
activations, the gradients, or both (`compress_activations`, `compress_gradients`: fp8 e4m3 with a
scale per tensor or per row, int8 with a scale per row), against fp32 boundaries.

Runs a job (by default the main job, `examples/configs/gpt_pp2.yaml`: GPT, pp=2, 1F1B, 4
microbatches, AdamW with a cosine schedule; `--config examples/configs/llama_pp2.yaml` for a
transformers Llama) once per variant from the same seed, and reports per run the training losses
(mean of the first and last 10 steps), the validation loss at the end and its difference from
fp32's, the largest per-step loss difference, the bytes sent between the stages per step and
their ratio to fp32's. TensorBoard logging, exports and the text sample are off.

    python benchmarks/boundary_dtype.py [--steps 300]                       # the main job, ~15 min
    python benchmarks/boundary_dtype.py --config examples/configs/llama_pp2.yaml --steps 200 \\
        --variants fp32 bf16 fp8-row int8                                   # a Llama, ~6 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ray

from raypipe.job import JobConfig, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples/configs/gpt_pp2.yaml"
VARIANTS = {
    "fp32": [],
    "bf16": ["boundary_dtype=bf16"],
    "fp8": ["compress_activations=fp8", "compress_gradients=fp8"],
    "fp8-row": ["compress_activations=fp8-row", "compress_gradients=fp8-row"],
    "int8": ["compress_activations=int8", "compress_gradients=int8"],
    "fp8-row-activations": ["compress_activations=fp8-row"],
    "fp8-row-gradients": ["compress_gradients=fp8-row"],
    # the noise floor: the same training in fp32 with its sums in another order (8 microbatches of
    # the same batch), which moves the loss curve as any rounding does
    "fp32-reordered": ["microbatches=8"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description="narrow and compressed stage boundaries against fp32")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    variants = ["fp32"] + [v for v in args.variants if v != "fp32"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    runs = {}
    try:
        for name in variants:
            config = JobConfig.from_yaml(
                args.config,
                VARIANTS[name]
                + [
                    f"job.steps={args.steps}",
                    f"optim.lr_schedule.total_steps={args.steps}",
                    "log_dir=null",
                    "job.sample_tokens=0",
                    "job.progress=false",
                    "job.save_pretrained=null",
                    f"name=boundary-{name}",
                ],
            )
            sent = []
            summary = run(
                config,
                log=lambda line: None,
                on_metrics=lambda m: sent.append(sum(s["sent_bytes"] for s in m["stages"])),
            )
            losses = summary["losses"]
            runs[name] = {
                "loss_first10": sum(losses[:10]) / 10,
                "loss_last10": sum(losses[-10:]) / 10,
                "val_last": summary["val_last"],
                "sent_bytes_per_step": sent[-1],
                "losses": losses,
            }
            print(name, {k: v for k, v in runs[name].items() if k != "losses"}, flush=True)
    finally:
        ray.shutdown()
    base = runs["fp32"]
    for r in runs.values():
        r["val_diff"] = r["val_last"] - base["val_last"]
        r["max_step_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        r["bytes_ratio"] = r["sent_bytes_per_step"] / base["sent_bytes_per_step"]
    result = {
        "config": args.config.name,
        "steps": args.steps,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in runs.items()},
    }
    json_out.emit(result, indent=1)


if __name__ == "__main__":
    json_out.run(main)
