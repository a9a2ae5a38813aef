"""A transformers GPT-2 trained by a plain transformers loop vs raypipe pp=1, side by side, and
the parameter bytes each actor holds at pp=2.

The model is GPT-2-shaped (learned positions, tied head, Conv1D projections) and small
enough to train a few steps a second on 2 cores. It is saved once with `save_pretrained`;
the plain loop loads it with `AutoModelForCausalLM` and trains on whole batches
(`model(input_ids, labels=labels).loss`, AdamW), raypipe loads it stage by stage with
`hf.from_pretrained` and trains the same batches in one microbatch (pp=1, one actor).
Both use one torch thread and take their steps in turn (`rounds.interleaved`), so
machine load hits them alike; the ratio is plain step time / raypipe step time (1.0 =
as fast; the target is >= 0.95). At pp=2 each actor's parameter bytes come from the
actors themselves (`Trainer.stage_info`), against the whole model's (the tied head's copy
of the embedding counts on the last stage).

    python benchmarks/hf_cpu.py --rounds 3 --steps 4 --block 5 > hf_cpu.json
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
    parser.add_argument("--steps", type=int, default=4, help="measured turns per round")
    parser.add_argument("--block", type=int, default=5, help="steps per turn")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM, GPT2Config

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = GPT2Config(
        n_embd=256,
        n_layer=4,
        n_head=4,
        vocab_size=4096,
        n_positions=args.seq,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
    )
    directory = tempfile.mkdtemp(prefix="hf_cpu-")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    plain = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    plain.train()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    parameters = sum(p.numel() for p in plain.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(
            0, config.vocab_size, (args.batch_size, args.seq), generator=torch.Generator().manual_seed(step)
        )
        return ids, ids

    def plain_steps(turn: int) -> None:
        for step in range(turn * args.block, (turn + 1) * args.block):
            ids, labels = batch(step)
            plain_opt.zero_grad()
            plain(input_ids=ids, labels=labels).loss.backward()
            plain_opt.step()

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    optimizer = {"name": "adamw", "lr": 1e-4}
    common = dict(optimizer=optimizer, threads_per_actor=1, cpus_per_actor=0.5)
    pp1 = Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=1, microbatches=1, **common))

    def raypipe_steps(turn: int) -> None:
        for step in range(turn * args.block, (turn + 1) * args.block):
            pp1.step(*batch(step))

    per_turn = interleaved(
        {"plain_transformers": plain_steps, "raypipe_pp1": raypipe_steps}, args.rounds, args.steps, warmup=1
    )
    per_step = {name: [[s / args.block for s in r] for r in rounds] for name, rounds in per_turn.items()}
    pp1.shutdown()
    with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=2, microbatches=2, **common)) as pp2:
        per_actor = [info["parameter_bytes"] for info in pp2.stage_info()]
        plan = [list(r) for r in pp2.plan]
    ray.shutdown()

    tokens = args.batch_size * args.seq
    seconds = round_means(per_step)
    result = {
        "benchmark": "hf_cpu",
        "machine": {
            "cpus": 2,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "transformers": transformers.__version__,
        },
        "model": {
            "type": "gpt2",
            "parameters": parameters,
            "n_layer": config.n_layer,
            "n_embd": config.n_embd,
            "vocab_size": config.vocab_size,
            "seq": args.seq,
            "tied_head": True,
        },
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "turns_per_round": args.steps,
        "steps_per_turn": args.block,
        "step_seconds_per_round": seconds,
        "tokens_per_s_median": {k: tokens / statistics.median(t for r in v for t in r) for k, v in per_step.items()},
        "ratio_raypipe_pp1_vs_plain_median_of_steps": paired_ratio(per_step, "plain_transformers", "raypipe_pp1"),
        "pp2_plan": plan,
        "pp2_parameter_bytes_per_actor": per_actor,
        "whole_model_parameter_bytes": total_bytes,
        "pp2_fraction_per_actor": [b / total_bytes for b in per_actor],
        # the tied head keeps a copy of the token embedding on the last stage (as DeepSpeed's
        # TiedLayerSpec does), so the actors together hold more than the model's unique bytes
        "pp2_fraction_of_bytes_held": [b / sum(per_actor) for b in per_actor],
    }
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
