"""GRPO's generation through raypipe's pipeline against transformers' `generate` in one process, and
a GRPO step split into generation, scoring and training (issue 62).

The random Llama of `dpo_throughput.py` (nothing is downloaded; `--layers`, `--hidden`, `--vocab`),
LoRA r = 8 on q/k/v/o. Generation: `--prompts` prompts of `--prompt` tokens, each sampled
`--generations` times (temperature 1.0, top-p 0.95), `--new` new tokens each (the random model
has no end-of-text token, so every row runs to the end), both sides with a KV cache:
- transformers: `model.generate(..., do_sample=True)` on the peft model, the machine's cores as
  torch threads;
- raypipe: `Trainer.generate` at pp = 1 (one actor with the node's cores), taken in turn with
  transformers (`rounds.interleaved`), and at pp = 2 after, alone.
The ratio is transformers' seconds / raypipe pp 1's, median of paired rounds. Then `fit` runs
`--steps` GRPO steps at pp = 2 (dapo, beta 0.04, so the reference pass runs) and reports each
part's median: generation (`generation_s`), scoring (`scoring_s`, a reward of token ids), and the
step (`step_time`: the reference pass is in the batch's making, timed with the generation figure's
neighbour, `grpo_batch`).

    python benchmarks/grpo_throughput.py > grpo_throughput.json     # about 3 minutes on 2 cores
    python benchmarks/grpo_throughput.py --layers 2 --hidden 64 --rounds 1 --steps 2   # the script, small
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from dpo_throughput import LORA, LR, save_model

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, paired_ratio  # noqa: E402


def even_tokens(completion_ids, **_):
    """A reward of token ids alone: the share of even ones."""
    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]


def prompts(index: int, count: int, length: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1000 + index)
    return [{"prompt_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "raypipe-dpo-bench"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    directory = save_model(a.dir + f"-{a.layers}x{a.hidden}", a.layers, a.hidden, a.vocab)
    rows = a.prompts * a.generations
    ids = lambda k: torch.tensor([p["prompt_ids"] for p in prompts(k, a.prompts, a.prompt, a.vocab)])  # noqa: E731
    batch = lambda k: ids(k).repeat_interleave(a.generations, dim=0)  # noqa: E731
    torch.set_num_threads(os.cpu_count() or 1)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "model": {"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab},
        "generation": {"rows": rows, "prompt": a.prompt, "new_tokens": a.new, "tokens_per_call": rows * a.new},
    }
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from raypipe.nn.lora import peft_config

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory), peft_config(LORA)).eval()
    model.generation_config.pad_token_id = 0  # no end-of-text token: every row runs to the end
    sampling = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 0}

    def transformers_generate(k: int) -> None:
        with torch.no_grad():
            x = batch(k)
            mask, length = torch.ones_like(x), {"max_new_tokens": a.new, "min_new_tokens": a.new}
            model.generate(x, attention_mask=mask, use_cache=True, **length, **sampling)

    common = dict(optimizer={"name": "adamw", "lr": LR}, lora=LORA, probe_links=False)
    with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=1, **common)) as one:

        def raypipe_generate(k: int) -> None:
            one.generate(batch(k), a.new, temperature=1.0, top_p=0.95, seed=k)

        seconds = interleaved({"transformers": transformers_generate, "raypipe_pp1": raypipe_generate}, a.rounds, 2)
    objective = {
        "name": "grpo",
        "num_generations": a.generations,
        "max_completion_length": a.new,
        "loss_type": "dapo",
        "beta": 0.04,
        "top_p": 0.95,
        "reward_funcs": [even_tokens],
    }
    config = TrainConfig(pp=2, microbatches=2, objective=objective, **common)
    with Trainer(hf.from_pretrained(directory), config=config) as two:
        pp2 = []
        for k in range(a.rounds * 2):
            started = time.perf_counter()
            two.generate(batch(k), a.new, temperature=1.0, top_p=0.95, seed=k)
            pp2.append(time.perf_counter() - started)
        started = time.perf_counter()
        steps = two.fit(lambda k: prompts(k, a.prompts, a.prompt, a.vocab), a.steps, log=lambda _: None)
        fit_s = (time.perf_counter() - started) / a.steps
    medians = {name: statistics.median([s for r in per for s in r]) for name, per in seconds.items()}
    medians["raypipe_pp2"] = statistics.median(pp2)
    result["generation_s"] = medians
    result["generated_tokens_per_s"] = {name: rows * a.new / s for name, s in medians.items()}
    result["transformers_over_raypipe_pp1"] = paired_ratio(seconds, "transformers", "raypipe_pp1")
    parts = {part: statistics.median(m[part] for m in steps[1:]) for part in ("generation_s", "scoring_s", "step_time")}
    parts["reference_and_rows_s"] = max(0.0, fit_s - sum(parts.values()))
    parts["whole_step_s"] = fit_s
    result["grpo_step_pp2"] = parts
    result["grpo_step_pp2_shares"] = {k: v / fit_s for k, v in parts.items() if k != "whole_step_s"}
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
