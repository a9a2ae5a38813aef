"""A whole GRPO step through raypipe at pp = 1 against TRL's `GRPOTrainer` on the same model (issue 74).

Both sides: a random Llama (`--layers`, `--hidden`; the byte tokenizer's 256 ids, nothing
downloaded) with LoRA r = 8 on q/k/v/o, AdamW at 1e-4, `--prompts` prompts of text (bytes as
tokens) sampled `--generations` times each at temperature 1.0, `--new` tokens a completion (every
completion runs to the end: TRL with `min_new_tokens`, raypipe with no end-of-text token), the
loss "dapo" with beta 0.04 (so the reference pass runs), a reward of token ids (the share of even
ones), fp32, the machine's cores as torch threads (TRL in this process, raypipe's one actor).
A step is everything: generation, scoring, the reference pass, the loss, backward, the optimizer.
TRL's step is its `training_step` (which generates and scores its batch) and the optimizer's;
raypipe's is one step of a `fit` that runs several, timed from one step's end to the next. They
take turns by rounds of `--steps` steps (a first round warms both up); the ratio is TRL's
seconds over raypipe's, pair by pair (step i of a round against step i of the same round).

    python benchmarks/grpo_vs_trl.py > grpo_vs_trl.json     # about 2 minutes on 2 cores
    python benchmarks/grpo_vs_trl.py --layers 2 --hidden 64 --rounds 1 --steps 2   # the script, small
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
from grpo_throughput import even_tokens

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import ratio_with_spread  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial bumpkins".split()


def prompt_texts(count: int, length: int) -> list[str]:
    """`count` prompts of `length` bytes, made of the same words in turn."""
    return [(" ".join(WORDS[i:] + WORDS[:i]) * 4)[:length] for i in range(count)]


def trl_trainer(directory: str, a: argparse.Namespace, texts: list[str], out: str):
    """TRL's GRPOTrainer on the peft model, with its optimizer made; `step()` runs one whole step."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.nn.lora import peft_config

    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0), tokenizer.convert_ids_to_tokens(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory), peft_config(LORA))
    args = GRPOConfig(
        output_dir=out,
        report_to=[],
        use_cpu=True,
        bf16=False,
        learning_rate=LR,
        per_device_train_batch_size=a.prompts * a.generations,
        num_generations=a.generations,
        max_completion_length=a.new,
        generation_kwargs={"min_new_tokens": a.new},
        loss_type="dapo",
        beta=0.04,
        temperature=1.0,
        logging_steps=10**6,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[even_tokens],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
        processing_class=tokenizer,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before a step
    trainer.model.train()
    batch = [{"prompt": t} for t in texts for _ in range(a.generations)]

    def step(_: int) -> None:
        trainer.training_step(trainer.model, batch, None)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad()

    return step


def timed(step, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`."""
    seconds = []
    for k in range(steps):
        started = time.perf_counter()
        step(k)
        seconds.append(time.perf_counter() - started)
    return seconds


def fit_steps(trainer: Trainer, records: list[dict], steps: int) -> list[float]:
    """Seconds of each of `steps` GRPO steps of one `fit` call, from one step's end to the next's
    (a step's metrics are booked as it ends); the call runs a step more, whose time from the
    call's start (the run's set-up, paid once per `fit`) is left out."""
    ends = []
    trainer.fit(
        lambda k: records,
        trainer.step_count + steps + 1,
        on_step=lambda _: ends.append(time.perf_counter()),
        log=lambda _: None,
    )
    return [b - a for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "raypipe-grpo-trl-bench"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32, help="bytes a prompt")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    directory = save_model(a.dir + f"-{a.layers}x{a.hidden}", a.layers, a.hidden, 256)
    texts = prompt_texts(a.prompts, a.prompt)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    ray.init(num_cpus=cores, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as out:
        trl_step = trl_trainer(directory, a, texts, out)
        records = [{"prompt_ids": list(t.encode())} for t in texts]
        objective = {
            "name": "grpo",
            "num_generations": a.generations,
            "max_completion_length": a.new,
            "loss_type": "dapo",
            "beta": 0.04,
            "temperature": 1.0,
            "reward_funcs": [even_tokens],
        }
        config = TrainConfig(
            pp=1, optimizer={"name": "adamw", "lr": LR}, lora=LORA, objective=objective, probe_links=False
        )
        with Trainer(hf.from_pretrained(directory), config=config, log=lambda m: print(m, file=sys.stderr)) as trainer:
            seconds: dict[str, list[list[float]]] = {"trl": [], "raypipe_pp1": []}
            for _ in range(a.rounds + 1):  # round 0 warms both up
                seconds["trl"].append(timed(trl_step, a.steps))
                seconds["raypipe_pp1"].append(fit_steps(trainer, records, a.steps))
            seconds = {name: per[1:] for name, per in seconds.items()}
    result = {
        "machine": {"cpus": cores, "python": platform.python_version(), "torch": torch.__version__},
        "model": {"layers": a.layers, "hidden": a.hidden, "vocab": 256, "lora": LORA},
        "step": {"prompts": a.prompts, "generations": a.generations, "prompt_bytes": a.prompt, "new_tokens": a.new},
        "step_s": {name: statistics.median([s for r in per for s in r]) for name, per in seconds.items()},
        "trl_over_raypipe_pp1": ratio_with_spread(seconds, "trl", "raypipe_pp1"),
    }
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
