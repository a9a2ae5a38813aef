"""What DPO and GRPO runs survive (issue 74's check outside the suite), on a tiny Llama with LoRA at
pp 2 on an embedded local Ray, printing one JSON object:

- `dpo_feed_death`: the last stage killed while a step's reference pass runs in `fit`'s feed
  (`max_restarts` 2): does `fit` finish every step, and are the replayed steps' losses the ones
  they had?
- `grpo_scoring_death`: the last stage killed while a generation batch is scored (a Python reward
  function kills it): the same questions;
- `grpo_checkpoint`: a GRPO run with a Python callable reward writes checkpoints, and a new trainer
  resumes from the last one and trains on;
- `refused`: an id outside the vocabulary (DPO) and a NaN reward (GRPO) given to `Trainer.step`:
  a raypipe error naming it, and the adapters untouched.

    python benchmarks/objective_faults.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ray
import torch

from raypipe import BatchError, TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

VOCAB = 48
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
COMMON = dict(pp=2, microbatches=2, lora=LORA, cpus_per_actor=0.25, threads_per_actor=1)
SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
DOOMED: list = []  # an actor the reward function kills once, while it scores


def tiny_llama(directory: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4)
    config = LlamaConfig(**shape, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def pairs(k: int) -> list[dict]:
    g = torch.Generator().manual_seed(700 + k)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(2 + i % 3), "chosen_ids": ids(1 + i % 4), "rejected_ids": ids(2)} for i in range(4)]


def prompts(k: int) -> list[dict]:
    g = torch.Generator().manual_seed(800 + k)
    return [{"prompt_ids": torch.randint(1, VOCAB, (3,), generator=g).tolist()} for _ in range(2)]


def reward(prompts, completions, completion_ids, **_):
    """Even tokens' share of each completion; kills the actor in DOOMED first, once."""
    if DOOMED:
        ray.kill(DOOMED.pop())
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completion_ids]


GRPO = {"name": "grpo", "num_generations": 4, "max_completion_length": 4, "beta": 0.04, "reward_funcs": [reward]}


def survived(directory: str, objective: dict, batches, kill_at: int, work: str) -> dict:
    """`fit` over 6 steps with the last stage killed at batch `kill_at` (through `batches`)."""
    config = TrainConfig(
        **COMMON,
        optimizer=SGD,
        objective=objective,
        checkpoint_dir=os.path.join(work, objective["name"]),
        checkpoint_every=2,
        max_restarts=2,
    )
    killed: list = []
    with Trainer(hf.from_pretrained(directory), config=config) as t:

        def feed(k):
            if k == kill_at and not killed:
                killed.append(t.group.actors[-1])
                if objective["name"] == "grpo":
                    DOOMED.append(killed[0])  # killed while batch k is scored
                else:
                    ray.kill(killed[0])  # killed as the feed runs step k's reference pass
            return batches(k)

        started, error = time.perf_counter(), None
        try:
            history = t.fit(feed, 6, log=lambda _: None)
        except Exception as failure:  # noqa: BLE001 - what ended the run is the finding
            history, error = [], f"{type(failure).__name__}: {failure}"[:300]
        losses: dict[int, list[float]] = {}
        for m in history:
            losses.setdefault(m["step"], []).append(m["loss"])
        return {
            "finished_every_step": sorted(losses) == list(range(1, 7)),
            "restarts": t.restarts,
            "replayed_steps": sorted(k for k, v in losses.items() if len(v) > 1),
            "replays_equal_their_first_run": all(len(set(v)) == 1 for v in losses.values()),
            "error": error,
            "seconds": round(time.perf_counter() - started, 1),
        }


def grpo_checkpoint(directory: str, work: str) -> dict:
    root = os.path.join(work, "grpo-ck")
    config = TrainConfig(**COMMON, optimizer=SGD, objective=GRPO, checkpoint_dir=root, checkpoint_every=2)
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        t.fit(prompts, 4, log=lambda _: None)
        saved = sorted(os.listdir(root))
    with Trainer(hf.from_pretrained(directory), config=config.replace(resume=True)) as again:
        resumed_at = again.step_count
        more = again.fit(prompts, 6, log=lambda _: None)
    with open(os.path.join(root, "step-00000004", "trainer.json")) as f:
        meta = json.load(f)
    return {
        "checkpoints": [name for name in saved if name.startswith("step-")],
        "resumed_at": resumed_at,
        "steps_after_resume": [m["step"] for m in more],
        "reward_recorded_as": meta["config"]["objective"]["reward_funcs"],
    }


def refused(directory: str) -> dict:
    out = {}
    for name, objective, bad in (
        ("dpo_out_of_vocabulary", {"name": "dpo"}, [{**pairs(0)[0], "prompt_ids": [VOCAB + 5]}] + pairs(0)[1:]),
        (
            "grpo_nan_reward",
            GRPO,
            {"prompt_ids": [[1, 2]], "completion_ids": [[3], [4], [5], [6]], "rewards": [1.0, float("nan"), 0.0, 0.5]},
        ),
    ):
        config = TrainConfig(**COMMON, optimizer=SGD, objective=objective)
        with Trainer(hf.from_pretrained(directory), config=config) as t:
            before = t.state_dict()
            try:
                t.step(bad)
                error = None
            except BatchError as failure:
                error = str(failure)[:200]
            after = t.state_dict()
        out[name] = {"error": error, "weights_untouched": all(torch.equal(before[k], after[k]) for k in before)}
    return out


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as work:
        directory = tiny_llama(os.path.join(work, "llama"))
        report = {
            "benchmark": "objective_faults",
            "dpo_feed_death": survived(directory, {"name": "dpo"}, pairs, 3, work),
            "grpo_scoring_death": survived(directory, GRPO, prompts, 3, work),
            "grpo_checkpoint": grpo_checkpoint(directory, work),
            "refused": refused(directory),
        }
    ray.shutdown()
    json_out.emit(report, indent=1)


if __name__ == "__main__":
    json_out.run(main)
