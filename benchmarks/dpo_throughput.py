"""DPO with LoRA through raypipe against TRL 1.16's DPOTrainer in one process (issue 62).

A Llama of random weights (nothing is downloaded; `--layers`, `--hidden`, `--vocab`) saved once
per `--dir`; LoRA (r = 8 on q/k/v/o) trains it by DPO (sigmoid, beta 0.1, AdamW) on random pairs
(`--pairs` per step, `--prompt` and `--completion` tokens each). Each step of either side runs the
reference policy's forward first (TRL: under its frozen "ref" adapter, raypipe: the adapters off,
a pass through the pipeline), then the policy's forward and backward and the optimizer step.
- TRL: its collator, `compute_loss` (the loss and its metrics), backward and AdamW, in this
  process with the machine's cores as torch threads.
- raypipe at pp = 1 (one actor with the node's cores) and pp = 2 (each stage its share): one
  `Trainer.step(pairs)` each.
TRL and pp = 1 take their steps in turn (`rounds.interleaved`); the ratio is TRL's step time /
raypipe's, median of paired steps (target >= 0.95). pp = 2 is timed after, alone. tokens/s
counts every row's tokens (prompt and completion, both rows of a pair). The reference pass's
share of raypipe's step is timed on its own (`objective_batch`, the same pairs).

    python benchmarks/dpo_throughput.py > dpo_throughput.json     # about 4 minutes on 2 cores
    python benchmarks/dpo_throughput.py --layers 2 --rounds 1 --steps 1 --hidden 64   # the script, small
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer
from raypipe.driver.inference.objective import objective_batch
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, paired_ratio  # noqa: E402

LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LR = 1e-4


def save_model(directory: str, layers: int, hidden: int, vocab: int, positions: int = 1024) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(directory, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 128),
            vocab_size=vocab,
            max_position_embeddings=positions,
        )
        LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_pairs(step: int, count: int, prompt: int, completion: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        {"prompt_ids": ids(prompt), "chosen_ids": ids(completion), "rejected_ids": ids(completion)}
        for _ in range(count)
    ]


def trl_runner(directory: str, out: str):
    """One DPO step of TRL's DPOTrainer on the peft model, per call; TRL's reference: its "ref" copy."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.nn.lora import peft_config

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory), peft_config(LORA))
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0), tokenizer.convert_ids_to_tokens(1)
    args = DPOConfig(output_dir=out, beta=0.1, loss_type=["sigmoid"], report_to=[], use_cpu=True, max_length=None)
    text = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=model, args=args, train_dataset=text, processing_class=tokenizer)
    trained = [p for n, p in trainer.model.named_parameters() if p.requires_grad and ".default." in n]
    opt = torch.optim.AdamW(trained, lr=LR)
    trainer.model.train()

    def step(pairs: list[dict]) -> None:
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "raypipe-dpo-bench"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    directory = save_model(a.dir + f"-{a.layers}x{a.hidden}", a.layers, a.hidden, a.vocab)
    pairs = lambda k: make_pairs(k, a.pairs, a.prompt, a.completion, a.vocab)  # noqa: E731
    tokens = 2 * a.pairs * (a.prompt + a.completion)  # every row, both of each pair
    torch.set_num_threads(os.cpu_count() or 1)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    objective = {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid"}
    common = dict(optimizer={"name": "adamw", "lr": LR}, lora=LORA, objective=objective, probe_links=False)
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "model": {"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab},
        "batch": {"pairs": a.pairs, "prompt": a.prompt, "completion": a.completion, "tokens_per_step": tokens},
    }
    with tempfile.TemporaryDirectory() as out:
        trl_step = trl_runner(directory, out)
        with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=1, **common)) as one:
            seconds = interleaved(
                {"trl": lambda k: trl_step(pairs(k)), "raypipe_pp1": lambda k: one.step(pairs(k))}, a.rounds, a.steps
            )
            reference = []
            for k in range(a.steps):
                started = time.perf_counter()
                objective_batch(one.group, pairs(k))
                reference.append(time.perf_counter() - started)
    with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=2, microbatches=2, **common)) as two:
        for k in range(2):
            two.step(pairs(k))
        pp2 = []
        for k in range(a.rounds * a.steps):
            started = time.perf_counter()
            two.step(pairs(100 + k))
            pp2.append(time.perf_counter() - started)
    median = {name: statistics.median([s for r in per for s in r]) for name, per in seconds.items()}
    one_step = median["raypipe_pp1"]
    result["seconds_per_step"] = {**median, "raypipe_pp2": statistics.median(pp2)}
    result["tokens_per_s"] = {name: tokens / s for name, s in result["seconds_per_step"].items()}
    result["trl_over_raypipe_pp1"] = paired_ratio(seconds, "trl", "raypipe_pp1")
    result["reference_pass_s"] = statistics.median(reference)
    result["reference_share_of_pp1_step"] = statistics.median(reference) / one_step
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
