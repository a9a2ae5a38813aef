"""`gpu_check.py`'s `preference` part (issue 62), printing one JSON line: DPO and GRPO with LoRA on
the LLM of `gpu_parts.py` (Qwen3-8B's shape, random bf16 weights; `--tiny`: a 2-layer Qwen3), every
stage on the one device, pp = 1:
- DPO: step time and tokens/s on random pairs (sigmoid, beta 0.1), and the reference pass alone;
- GRPO generation: 16 rows sampled (4 prompts x 4, temperature 1, top-p 0.95, KV cache) through
  raypipe against transformers' `generate` on the same device in this process (on a CPU with the
  one thread each actor computes with), both loaded at once and taking their turns (`rounds.py`):
  new tokens/s, and raypipe over transformers pair by pair with its spread;
- a GRPO step (dapo, beta 0.04): generation, scoring, the reference pass and rows, training.

    python benchmarks/gpu_preference.py --device cuda --work /tmp/gc
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from dpo_throughput import make_pairs
from gpu_parts import LORA, OPTIMIZER, SHARE, _free, llama_config, saved_llm, timed_steps
from grpo_throughput import even_tokens, prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, match_actor_threads, ratio_with_spread  # noqa: E402


def transformers_generator(directory: str, device: torch.device, batch, new: int):
    """transformers' sampled `generate` of `new` tokens for `batch(k)` in this process, bf16 with
    the same adapters: a function of k, to time beside raypipe's."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from raypipe.nn.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device)
    model = get_peft_model(model, peft_config(LORA)).eval()
    model.generation_config.pad_token_id = 0

    def generate(k: int) -> None:
        x = batch(k).to(device)
        with torch.no_grad():
            model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=True, top_p=0.95
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return generate


def preference(args: argparse.Namespace, device: torch.device) -> dict:
    from raypipe import TrainConfig, Trainer
    from raypipe.driver.inference.objective import objective_batch
    from raypipe.models import hf

    directory, _ = saved_llm(args.work, args.tiny, device)
    vocab = llama_config(args.tiny).vocab_size
    pairs_n, length, new = (4, 16, 8) if args.tiny else (8, 256, 64)
    warmup, count = (1, 2) if args.tiny else (2, 4)
    pairs = lambda k: make_pairs(k, pairs_n, length, length, vocab)  # noqa: E731
    rows = lambda k: torch.tensor([p["prompt_ids"] for p in prompts(k, 4, length, vocab)]).repeat_interleave(4, 0)  # noqa: E731
    share = SHARE[device.type]
    match_actor_threads(device.type, share.get("threads_per_actor", 1))
    transformers_generate = transformers_generator(directory, device, rows, new)
    common = dict(lora=LORA, optimizer=OPTIMIZER, precision="bf16", devices=device.type, **share)
    dpo = TrainConfig(objective={"name": "dpo", "beta": 0.1}, name="gpu-check-dpo", **common)
    with Trainer(hf.from_pretrained(directory, dtype="bf16"), config=dpo) as trainer:
        step_s = statistics.median(timed_steps(lambda k: trainer.step(pairs(k)), warmup, count))
        reference_s = statistics.median(timed_steps(lambda k: objective_batch(trainer.group, pairs(k)), 0, count))
        runners = {
            "transformers": transformers_generate,
            "raypipe_pp1": lambda k: trainer.generate(rows(k), new, temperature=1.0, top_p=0.95, seed=k),
        }
        generation = interleaved(runners, 1 if args.tiny else 2, count, warmup=1)
    transformers_generate = runners = None  # freed before the GRPO trainer takes the device
    _free(device)
    generate_s, raypipe_generate_s = (
        statistics.median(s for r in generation[k] for s in r) for k in ("transformers", "raypipe_pp1")
    )
    objective = {"name": "grpo", "num_generations": 4, "max_completion_length": new, "beta": 0.04, "top_p": 0.95}
    grpo = TrainConfig(objective={**objective, "reward_funcs": [even_tokens]}, name="gpu-check-grpo", **common)
    with Trainer(hf.from_pretrained(directory, dtype="bf16"), config=grpo) as trainer:
        started = time.perf_counter()
        steps = trainer.fit(lambda k: prompts(k, 4, length, vocab), warmup + count, log=lambda _: None)
        whole = (time.perf_counter() - started) / len(steps)
    parts = {p: statistics.median(m[p] for m in steps[warmup:]) for p in ("generation_s", "scoring_s", "step_time")}
    generated = 16 * new
    return {
        "part": "preference",
        "model": "tiny Qwen3" if args.tiny else "Qwen3-8B's shape, random bf16 weights",
        "dpo": {
            "pairs": pairs_n,
            "tokens_per_step": 2 * pairs_n * 2 * length,
            "step_s": step_s,
            "tokens_per_s": 2 * pairs_n * 2 * length / step_s,
            "reference_pass_s": reference_s,
        },
        "generation": {
            "rows": 16,
            "new_tokens": new,
            "tokens_per_s": {"transformers": generated / generate_s, "raypipe_pp1": generated / raypipe_generate_s},
            "raypipe_over_transformers": generate_s / raypipe_generate_s,
        },
        "ratios": {
            "generation_raypipe_pp1_over_transformers": ratio_with_spread(generation, "transformers", "raypipe_pp1")
        },
        "grpo_step": {**parts, "whole_step_s": whole},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--work", required=True, help="where the LLM's files are made and kept")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from pathlib import Path

    args.work = Path(args.work)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    import ray

    from raypipe import driver

    driver.connect()  # a local Ray advertising this machine's accelerators
    try:
        json_out.emit(preference(args, device))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    json_out.run(main)
