"""A real LLM's shape through raypipe: Qwen2-0.5B (494 M parameters, 24 layers, GQA 14/2, a
151,936-token tied vocabulary) fine-tuned with LoRA, against the plain transformers + peft loop.

The model gets random weights (nothing is downloaded) and is saved with `save_pretrained` as
five safetensors shards, once per `--dir`. LoRA (r = 8 on q/k/v/o, through peft) trains it:
- speed: the plain peft loop (in this process, the machine's cores as torch threads) and
  raypipe at pp = 1 (one actor, which by default computes with the node's cores too) take
  their steps in turn (`rounds.interleaved`) on the same batches; the ratio is plain step
  time / raypipe step time, median of paired steps (target >= 0.97). pp = 2 (each stage on
  its share of the cores) is timed after, alone.
- memory: each stage's peak over its parameter bytes once loaded (before any step) and after
  training, and the split the stage reports (parameters / gradients / optimizer state /
  activations / other). `baseline` is the peak of a stage actor holding a one-layer model of
  the same family: the runtime's own cost (Python, torch, transformers, peft, Ray's worker),
  which every stage pays once. The plain loop's peak, over what its process held before it
  loaded the model, is the reference for pp = 1.
- load time (Trainer built: actors placed, layers read), `save_pretrained` with the adapters
  merged, and the driver's resident growth while it holds the trainer (it holds no weights).

With `--full-ft`, instead: full fine-tuning (every weight trains, AdamW) at pp = 2 x dp = 2,
ZeRO-0 against ZeRO-3 (`zero=3`) on the same batches: each actor's peak, its parameter and
optimizer-state bytes (the stage's split: ZeRO-3's slices plus the largest layer gathered),
their ratio to ZeRO-0's, and the step time of each (one trainer after the other: two would not fit).

    python benchmarks/llm_scale.py --dir /tmp/qwen2-0.5b > llm_scale.json   # about 6 minutes on 2 cores
    python benchmarks/llm_scale.py --layers 2 --rounds 1 --steps 1          # the script itself, small
    python benchmarks/llm_scale.py --dir /tmp/qwen2-8l --layers 8 --full-ft > zero3.json  # ~6 minutes
    python benchmarks/llm_scale.py --dir /tmp/qwen2-0.5b --save-memory > saves.json  # ~3 minutes
    python benchmarks/llm_scale.py --dir /tmp/qwen2-0.5b --seq 64 --ray-cpus 4 > told4.json  # Ray told 2x the cores
    python benchmarks/llm_scale.py --dir /tmp/qwen2-0.5b --stage-peaks > peaks.json  # each stage / the model, pp 2, 4

With `--save-memory`, instead: what saving costs a stage (issue 59): at pp = 2 under LoRA, each
stage's peak right after loading, after `save_adapter`, after `save_pretrained(merge_adapters=True)`
and after a step, in that order (a process's peak only grows, so each save's growth is its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, paired_ratio  # noqa: E402

LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
OPTIMIZER = {"name": "adamw", "lr": 1e-4}


def qwen2_config(layers: int, vocab: int = 151936):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def saved_model(directory: str, layers: int) -> str:
    """The model saved in `directory` as transformers saves it, sharded; made once."""
    from transformers import AutoModelForCausalLM

    marker = os.path.join(directory, f"layers-{layers}")
    if not os.path.exists(marker):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(qwen2_config(layers))
        model.save_pretrained(directory, max_shard_size="450MB")
        del model
        open(marker, "w").close()
    return directory


class PlainLoop:
    """The plain transformers + peft training loop on whole batches, as a user writes it."""

    def __init__(self, directory: str, batch) -> None:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        from raypipe.nn.lora import peft_config

        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = get_peft_model(model, peft_config(LORA))
        self.model.train()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.batch = batch

    def step(self, step: int) -> None:
        ids, labels = self.batch(step)
        self.optimizer.zero_grad()
        self.model(input_ids=ids, labels=labels).loss.backward()
        self.optimizer.step()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def stage_memory(trainer: Trainer) -> list[dict]:
    """Per stage: parameter bytes, peak, peak over parameters, and the peak's split."""
    out = []
    for info in trainer.stage_info():
        split = info["memory"]
        out.append(
            {
                "layers": info["layers"],
                "parameter_bytes": info["parameter_bytes"],
                "peak_bytes": split["peak"],
                "peak_over_parameters": split["peak"] / info["parameter_bytes"],
                "split": split,
                "threads": info["threads"],
                "pid": info["pid"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the model is saved (kept, reused); a temp dir if unset")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per round")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the plain loop's torch threads")
    parser.add_argument(
        "--ray-cpus", type=int, default=os.cpu_count(), help="the CPUs Ray is told (above the cores: oversubscribed?)"
    )
    parser.add_argument("--full-ft", action="store_true", help="full fine-tuning at pp 2 x dp 2: ZeRO-0 vs ZeRO-3")
    parser.add_argument("--save-memory", action="store_true", help="each stage's peak as saves go, at pp 2")
    parser.add_argument("--stage-peaks", action="store_true", help="each stage's peak over the whole model, pp 2 and 4")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="--stage-peaks: the pipeline depths")
    args = parser.parse_args()

    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    directory = saved_model(args.dir or tempfile.mkdtemp(prefix="llm_scale-"), args.layers)
    torch.set_num_threads(args.threads)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 151936, (args.batch_size, args.seq), generator=g)
        return ids, ids

    if args.full_ft:
        json_out.emit(full_fine_tuning(directory, batch, args), indent=2)
        return
    if args.save_memory:
        json_out.emit(save_memory(directory, batch, args), indent=2)
        return
    if args.stage_peaks:
        json_out.emit(stage_peaks(directory, batch, args), indent=2)
        return
    plain_start = rss_bytes()  # torch, transformers and peft imported, no model yet
    started = time.perf_counter()
    plain = PlainLoop(directory, batch)
    plain_load_s = time.perf_counter() - started
    plain_parameter_bytes = sum(p.numel() * p.element_size() for p in plain.model.parameters())

    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR")
    # the runtime's own cost: a stage holding one layer of the family, stepped once
    with Trainer(
        hf.from_config(qwen2_config(1, vocab=256)), config=TrainConfig(pp=1, lora=LORA, optimizer=OPTIMIZER)
    ) as tiny:
        tiny.step(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
        baseline = tiny.stage_info()[0]["memory"]["peak"]

    driver_before = rss_bytes()
    started = time.perf_counter()
    pp1 = Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=1, lora=LORA, optimizer=OPTIMIZER))
    pp1_load_s = time.perf_counter() - started
    driver_growth = rss_bytes() - driver_before
    pp1_loaded = stage_memory(pp1)  # before any step: the peak of placing and loading
    seconds = interleaved(
        {"plain_peft": plain.step, "raypipe_pp1": lambda step: pp1.step(*batch(step))},
        args.rounds,
        args.steps,
        warmup=1,
    )
    pp1_memory = stage_memory(pp1)
    pp1.shutdown()
    # the plain loop's own peak over what the process held before it loaded the model (the
    # driver's trainers in this process hold no weights: see driver_rss_growth_bytes_pp1)
    plain_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - plain_start
    del plain  # its memory back before pp = 2 starts

    started = time.perf_counter()
    pp2 = Trainer(
        hf.from_pretrained(directory), config=TrainConfig(pp=2, microbatches=4, lora=LORA, optimizer=OPTIMIZER)
    )
    pp2_load_s = time.perf_counter() - started
    pp2_loaded = stage_memory(pp2)
    pp2.step(*batch(0))
    pp2_steps = []
    for step in range(args.rounds * args.steps):
        t0 = time.perf_counter()
        pp2.step(*batch(step + 1))
        pp2_steps.append(time.perf_counter() - t0)
    pp2_memory = stage_memory(pp2)
    started = time.perf_counter()
    pp2.save_pretrained(tempfile.mkdtemp(prefix="llm_scale-merged-"), merge_adapters=True)
    save_merged_s = time.perf_counter() - started
    pp2.shutdown()
    ray.shutdown()

    tokens = args.batch_size * args.seq
    medians = {k: statistics.median(s for r in v for s in r) for k, v in seconds.items()}
    medians["raypipe_pp2"] = statistics.median(pp2_steps)

    def over_baseline(stages: list[dict]) -> list[float]:  # (peak - runtime baseline) / parameter bytes
        return [(s["peak_bytes"] - baseline) / s["parameter_bytes"] for s in stages]

    def beyond_activations(stages: list[dict]) -> list[float]:  # (peak - activations - baseline) / parameters
        return [(s["peak_bytes"] - s["split"]["activations"] - baseline) / s["parameter_bytes"] for s in stages]

    result = {
        "benchmark": "llm_scale",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "model": {"shape": "Qwen2-0.5B", "layers": args.layers, "tied_head": True, "dtype": "fp32"},
        "lora": LORA,
        "batch": {"size": args.batch_size, "seq": args.seq, "tokens": tokens},
        "plain_threads": args.threads,
        "step_seconds": seconds | {"raypipe_pp2": [pp2_steps]},
        "tokens_per_s_median": {k: tokens / v for k, v in medians.items()},
        "ratio_raypipe_pp1_vs_plain_median_of_pairs": paired_ratio(seconds, "plain_peft", "raypipe_pp1"),
        "runtime_baseline_bytes": baseline,
        "pp1_stages": pp1_memory,
        "pp2_stages": pp2_memory,
        "pp1_loaded_peak_minus_baseline_over_parameters": over_baseline(pp1_loaded),
        "pp2_loaded_peak_minus_baseline_over_parameters": over_baseline(pp2_loaded),
        "plain_peak_minus_start_over_parameters": plain_peak / plain_parameter_bytes,
        "pp1_peak_minus_baseline_over_parameters": over_baseline(pp1_memory),
        "pp2_peak_minus_baseline_over_parameters": over_baseline(pp2_memory),
        "pp1_peak_minus_activations_and_baseline_over_parameters": beyond_activations(pp1_memory),
        "pp2_peak_minus_activations_and_baseline_over_parameters": beyond_activations(pp2_memory),
        "load_seconds": {"plain_peft": plain_load_s, "raypipe_pp1": pp1_load_s, "raypipe_pp2": pp2_load_s},
        "save_pretrained_merged_seconds_pp2": save_merged_s,
        "driver_rss_growth_bytes_pp1": driver_growth,
    }
    json_out.emit(result, indent=2)


def stage_peaks(directory: str, batch, args) -> dict:
    """Each stage's resident peak after `--steps` + 1 steps under LoRA at pp = 2 and pp = 4 (`--pp`; 4 microbatches, the
    batch's rows), over the whole model's bytes as saved (the safetensors index's total: the tied
    weight once): issue 76's measure, a stage holding its share. Each stage's split beside it."""
    whole = json.loads((Path(directory) / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR")
    out: dict[str, object] = {"whole_model_bytes": whole}
    for pp in args.pp:
        config = TrainConfig(pp=pp, microbatches=4, lora=LORA, optimizer=OPTIMIZER)
        started = time.perf_counter()
        with Trainer(hf.from_pretrained(directory), config=config) as t:
            t.stage_info()
            load_s = time.perf_counter() - started
            seconds = []
            for step in range(args.steps + 1):  # the first step is not timed
                began = time.perf_counter()
                t.step(*batch(step))
                seconds.append(time.perf_counter() - began)
            stages = stage_memory(t)
            shares = [proportional_set(s["pid"]) for s in stages]
        out[f"pp{pp}"] = {
            "peak_over_whole_model": [s["peak_bytes"] / whole for s in stages],
            # after the steps: each stage's resident set now, and its proportional share of it (pages
            # several processes map, as a tied weight's file pages or torch's libraries, split among them)
            "rss_now_over_whole_model": [s["Rss"] / whole for s in shares],
            "pss_now_over_whole_model": [s["Pss"] / whole for s in shares],
            "proportional_sets_mb": [{k: round(v / 1e6) for k, v in s.items()} for s in shares],
            "load_s": load_s,
            "step_s_median": statistics.median(seconds[1:]),
            "stages": stages,
        }
    ray.shutdown()
    return out


def proportional_set(pid: int) -> dict[str, int]:
    """A process's resident set now and its proportional share (Linux's smaps_rollup), in bytes."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        lines = [line.split() for line in f if line.startswith(("Rss:", "Pss"))]
    return {fields[0].rstrip(":"): int(fields[1]) * 1024 for fields in lines}


def save_memory(directory: str, batch, args) -> dict:
    """Each stage's peak over its parameter bytes at pp = 2 under LoRA: loaded, then after each save."""
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    config = TrainConfig(pp=2, microbatches=4, lora=LORA, optimizer=OPTIMIZER)
    out: dict[str, list] = {}
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        out["loaded"] = stage_memory(t)
        t.save_adapter(tempfile.mkdtemp(prefix="llm_scale-adapter-"))
        out["after_save_adapter"] = stage_memory(t)
        t.save_pretrained(tempfile.mkdtemp(prefix="llm_scale-merged-"), merge_adapters=True)
        out["after_save_pretrained_merged"] = stage_memory(t)
        t.step(*batch(0))
        out["after_a_step"] = stage_memory(t)
    ray.shutdown()
    return {
        "benchmark": "llm_scale --save-memory",
        "model": {"shape": "Qwen2-0.5B", "layers": args.layers, "dtype": "fp32"},
        "lora": LORA,
        "peak_gb": {k: [round(s["peak_bytes"] / 1e9, 3) for s in v] for k, v in out.items()},
        "parameter_gb": [round(s["parameter_bytes"] / 1e9, 3) for s in out["loaded"]],
        "growth_over_loaded_gb": {
            k: [round((s["peak_bytes"] - b["peak_bytes"]) / 1e9, 3) for s, b in zip(v, out["loaded"])]
            for k, v in out.items()
            if k != "loaded"
        },
    }


def full_fine_tuning(directory: str, batch, args) -> dict:
    """ZeRO-0 and ZeRO-3 at pp 2 x dp 2, every weight trained: per-actor memory and step time."""
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    kinds = {}
    for zero in (0, 3):
        config = TrainConfig(pp=2, dp=2, microbatches=2, zero=zero, optimizer=OPTIMIZER, step_timeout=1800)
        trainer = Trainer(hf.from_pretrained(directory), config=config)
        trainer.step(*batch(0))  # optimizer state exists from here
        times = []
        for step in range(args.rounds * args.steps):
            t0 = time.perf_counter()
            losses = trainer.step(*batch(step + 1))["loss"]
            times.append(time.perf_counter() - t0)
        actors = stage_memory(trainer)
        kinds[f"zero{zero}"] = {"step_seconds": times, "last_loss": losses, "stages": actors}
        trainer.shutdown()
    ray.shutdown()
    zero0, zero3 = kinds["zero0"]["stages"], kinds["zero3"]["stages"]

    def held(a: dict) -> int:  # the stage's split: ZeRO-3's slices and largest layer, and the optimizer state
        return a["split"]["parameters"] + a["split"]["optimizer_state"]

    return {
        "benchmark": "llm_scale --full-ft",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__},
        "model": {"shape": "Qwen2-0.5B", "layers": args.layers, "tied_head": True, "dtype": "fp32"},
        "batch": {"size": args.batch_size, "seq": args.seq, "microbatches_per_replica": 2},
        "runs": kinds,
        "parameters_plus_optimizer_zero3_over_zero0": [held(b) / held(a) for a, b in zip(zero0, zero3)],
        "peak_zero3_over_zero0": [b["peak_bytes"] / a["peak_bytes"] for a, b in zip(zero0, zero3)],
        "step_seconds_median": {k: statistics.median(v["step_seconds"]) for k, v in kinds.items()},
    }


if __name__ == "__main__":
    json_out.run(main)
