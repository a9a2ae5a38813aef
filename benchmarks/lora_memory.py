"""Full fine-tuning vs LoRA on the same split transformers model: per actor, trainable parameters,
gradient bytes, optimizer-state bytes and checkpoint bytes, and the step time side by side.

A Llama-shaped model (hidden 256, 4 layers, vocabulary 4096) saved with `save_pretrained`,
split in two stages; full fine-tuning trains every weight with AdamW, LoRA (r = 8 on q_proj
and v_proj, through peft) only the adapters. Both trainers live at once and take their steps
in turn (`rounds.interleaved`). Memory figures come from the actors after a step
(`Trainer.stage_info`), checkpoint bytes from the files each stage wrote. QLoRA (nf4 base
through bitsandbytes' CPU backend) runs beside them.

    python benchmarks/lora_memory.py --rounds 3 --steps 4 --block 3 > lora_memory.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, paired_ratio, round_means  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=None,
    )
    directory = tempfile.mkdtemp(prefix="lora_memory-")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)

    def batch(step: int):
        ids = torch.randint(0, config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(step))
        return ids, ids

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    common = dict(
        pp=2, microbatches=2, optimizer={"name": "adamw", "lr": 1e-4}, cpus_per_actor=0.3, threads_per_actor=1
    )
    trainers = {
        "full": Trainer(hf.from_pretrained(directory), config=TrainConfig(**common)),
        "lora": Trainer(
            hf.from_pretrained(directory),
            config=TrainConfig(**common, lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
        ),
        "qlora": Trainer(
            hf.from_pretrained(directory),
            config=TrainConfig(
                **common, lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, quantize="nf4"
            ),
        ),
    }
    runners = {
        name: (lambda turn, t=t: [t.step(*batch(turn * args.block + i)) for i in range(args.block)])
        for name, t in trainers.items()
    }
    per_turn = interleaved(runners, args.rounds, args.steps, warmup=1)
    per_step = {name: [[s / args.block for s in r] for r in rounds] for name, rounds in per_turn.items()}
    memory = {}
    for name, t in trainers.items():
        info = t.stage_info()
        where = Path(t.save(tempfile.mkdtemp(prefix=f"lora_memory-{name}-")))
        files = [p for p in where.rglob("*") if p.is_file()]
        memory[name] = {
            "per_actor": [
                {
                    k: i[k]
                    for k in (
                        "name",
                        "parameters",
                        "trainable_parameters",
                        "parameter_bytes",
                        "gradient_bytes",
                        "optimizer_state_bytes",
                    )
                }
                for i in info
            ],
            "checkpoint_bytes": sum(p.stat().st_size for p in files),
            "checkpoint_bytes_per_stage": [
                sum(
                    p.stat().st_size
                    for p in files
                    if p.parent.name in ("model", "optim") and start <= int(p.stem.split("-")[1]) < end
                )
                for start, end in t.plan
            ],
        }
        t.shutdown()
    ray.shutdown()
    json_out.emit(
        {
            "benchmark": "lora_memory",
            "machine": {
                "cpus": 2,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "ray": ray.__version__,
                "transformers": transformers.__version__,
            },
            "model": {"type": "llama", "hidden_size": 256, "layers": 4, "vocab_size": 4096, "seq": 64, "batch": 8},
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            "memory": memory,
            "step_seconds_per_round": round_means(per_step),
            "step_seconds_median": {k: statistics.median(s for r in v for s in r) for k, v in per_step.items()},
            "lora_speed_vs_full_median_of_steps": paired_ratio(per_step, "full", "lora"),
            "qlora_speed_vs_full_median_of_steps": paired_ratio(per_step, "full", "qlora"),
        },
        indent=2,
    )


if __name__ == "__main__":
    json_out.run(main)
