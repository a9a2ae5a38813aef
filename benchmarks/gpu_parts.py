"""The parts of `gpu_check.py` that no other benchmark runs, one per call, printing one JSON line:

- `llm_lora`: Qwen3-8B's shape (random bf16 weights made on the device, saved as transformers
  saves them), LoRA r = 16 on q/k/v/o: peft in this process and raypipe at pp = 1 and pp = 2
  (both stages on the one device), all three loaded at once and stepping in turn (`rounds.py`),
  the peft loop on a CPU with the one thread each actor computes with; tokens/s, raypipe over
  peft pair by pair with its spread, each stage's peak device memory, load times;
- `compile`: the GPT (GPT-2 small's shape) eager against torch.compile'd at pp = 1 and 2, eager
  and compiled alternating on one trainer (`reconfigure(compile=...)`), the compile time apart;
- `qlora`: the LLM of `llm_lora` at pp = 1 over an nf4 base (bitsandbytes).

`--tiny`: a 2-layer Qwen3 and GPT of width 64, for the CPU dry run.

    python benchmarks/gpu_parts.py llm_lora --device cuda --work /tmp/gc
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, match_actor_threads, ratio_with_spread  # noqa: E402

LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
OPTIMIZER = {"name": "adamw", "lr": 1e-4}
GiB = 2**30


def llama_config(tiny: bool):
    """Qwen3-8B's config (8.2 B parameters: 36 layers of width 4096, grouped-query attention with
    per-head q/k norms, a 151,936-token untied vocabulary), or a 2-layer Qwen3 of width 64."""
    from transformers import Qwen3Config

    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        return Qwen3Config(**shape, num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128)
    return Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def saved_llm(work: Path, tiny: bool, device: torch.device) -> tuple[str, float]:
    """The LLM's directory under `work` (made once, its weights random, made on `device`) and the
    seconds making it took."""
    from transformers import AutoModelForCausalLM

    directory = work / "llm"
    if (directory / "config.json").exists():
        return str(directory), 0.0
    started = time.perf_counter()
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(llama_config(tiny), dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="5GB")
    del model
    _free(device)
    return str(directory), time.perf_counter() - started


def tokens(tiny: bool, vocab: int):
    """The batch of step k: random token ids, (4, 1024), or (4, 32) when tiny."""
    shape = (4, 32) if tiny else (4, 1024)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(k))
        return ids, ids

    return batch, shape[0] * shape[1]


SHARE = {"cuda": {"gpus_per_actor": 0.25}, "cpu": {"cpus_per_actor": 0.5, "threads_per_actor": 1}}  # all fit at once


def timed_steps(step, warmup: int, count: int) -> list[float]:
    for k in range(warmup):
        step(k)
    seconds = []
    for k in range(count):
        started = time.perf_counter()
        step(warmup + k)
        seconds.append(time.perf_counter() - started)
    return seconds


def peft_loop(directory: str, device: torch.device):
    """The plain transformers + peft loop in this process, bf16 weights under bf16 autocast: its
    step function, the seconds loading took, and a function giving its peak memory so far."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from raypipe.nn.lora import peft_config

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(model.to(device), peft_config(LORA))
    load_s = time.perf_counter() - started
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step, load_s, lambda: _peak(device)


def raypipe_trainer(directory: str, device: torch.device, pp: int, **extra):
    """raypipe on the LLM at `pp` with every stage on the one device, and the seconds its start took."""
    from raypipe import TrainConfig, Trainer
    from raypipe.models import hf

    config = TrainConfig(
        pp=pp,
        microbatches=1 if pp == 1 else 4,
        lora=LORA,
        optimizer=OPTIMIZER,
        precision="bf16",
        devices=device.type,
        name=f"gpu-check-llm-pp{pp}{'-' + extra['quantize'] if extra else ''}",
        **SHARE[device.type],
        **extra,
    )
    started = time.perf_counter()
    trainer = Trainer(hf.from_pretrained(directory, dtype="bf16"), config=config)
    return trainer, time.perf_counter() - started


def raypipe_run(directory: str, device: torch.device, batch, warmup: int, count: int, pp: int, **extra) -> dict:
    """raypipe alone on the LLM at `pp`: median step seconds, load time, each stage's peak."""
    trainer, load_s = raypipe_trainer(directory, device, pp, **extra)
    with trainer:
        seconds = timed_steps(lambda k: trainer.step(*batch(k)), warmup, count)
        return {"step_s": statistics.median(seconds), "load_s": load_s, **_stage_memory(trainer)}


def _stage_memory(trainer) -> dict:
    info = trainer.stage_info()
    return {"peak_bytes": [i["memory"]["peak"] for i in info], "devices": [i["device"] for i in info]}


def llm_lora(args: argparse.Namespace, device: torch.device) -> dict:
    directory, made_s = saved_llm(args.work, args.tiny, device)
    batch, per_step = tokens(args.tiny, llama_config(args.tiny).vocab_size)
    rounds, steps = (2, 2) if args.tiny else (2, 4)
    match_actor_threads(device.type, SHARE[device.type].get("threads_per_actor", 1))
    peft_step, peft_load_s, peft_peak = peft_loop(directory, device)
    trainers = {f"raypipe_pp{pp}": raypipe_trainer(directory, device, pp) for pp in (1, 2)}
    try:
        runners = {"peft": lambda k: peft_step(*batch(k))}
        runners |= {name: (lambda k, t=t: t.step(*batch(k))) for name, (t, _) in trainers.items()}
        seconds = interleaved(runners, rounds, steps, warmup=2)
        runs = {"peft": {"load_s": peft_load_s, "peak_bytes": [peft_peak()]}}
        runs |= {name: {"load_s": load_s, **_stage_memory(t)} for name, (t, load_s) in trainers.items()}
    finally:
        for trainer, _ in trainers.values():
            trainer.shutdown()
    for name, run in runs.items():
        run["step_s"] = statistics.median(s for r in seconds[name] for s in r)
    rate = {k: per_step / r["step_s"] for k, r in runs.items()}
    return {
        "part": "llm_lora",
        "model": "tiny Qwen3" if args.tiny else "Qwen3-8B's shape, random bf16 weights",
        "lora": LORA,
        "tokens_per_step": per_step,
        "made_and_saved_s": made_s,
        "runs": runs,
        "tokens_per_s": rate,
        "raypipe_over_peft_tokens_per_s": {k: v / rate["peft"] for k, v in rate.items() if k != "peft"},
        "ratios": {f"{k}_over_peft": ratio_with_spread(seconds, "peft", k) for k in trainers},
        "peak_gib": {k: [round(b / GiB, 2) for b in r["peak_bytes"]] for k, r in runs.items()},
        "load_s": {k: r["load_s"] for k, r in runs.items()},
    }


def qlora(args: argparse.Namespace, device: torch.device) -> dict:
    directory, _ = saved_llm(args.work, args.tiny, device)
    batch, per_step = tokens(args.tiny, llama_config(args.tiny).vocab_size)
    warmup, count = (1, 2) if args.tiny else (2, 5)
    run = raypipe_run(directory, device, batch, warmup, count, 1, quantize="nf4")
    return {
        "part": "qlora",
        "run": run,
        "tokens_per_s": per_step / run["step_s"],
        "peak_gib": [round(b / GiB, 2) for b in run["peak_bytes"]],
    }


def compile_part(args: argparse.Namespace, device: torch.device) -> dict:
    """Eager against compiled on one trainer per pp, alternating `rounds` times."""
    from raypipe import TrainConfig, Trainer
    from raypipe.models import gpt

    if args.tiny:
        cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
        shape, rounds, count = 4, 1, 2
    else:
        cfg, shape, rounds, count = gpt.GPTConfig(vocab_size=50304, block_size=1024), 8, 2, 5
    tokens_per_step = shape * cfg.block_size

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, cfg.vocab_size, (shape, cfg.block_size + 1), generator=torch.Generator().manual_seed(k))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    share = SHARE[device.type]
    rows = []
    for pp in (1,) if args.tiny else (1, 2):
        config = TrainConfig(
            pp=pp,
            microbatches=4,
            optimizer=OPTIMIZER,
            precision="bf16" if device.type == "cuda" else "fp32",
            devices=device.type,
            name=f"gpu-check-compile-pp{pp}",
            **share,
        )
        with Trainer(gpt.layers(cfg), gpt.loss_fn, config) as trainer:

            def steps(n: int) -> list[float]:
                return [trainer.step(*batch(k))["step_time"] for k in range(n)]

            steps(1)
            trainer.reconfigure(compile=True)
            first = steps(1)[0]
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for compiled in (False, True):
                    trainer.reconfigure(compile=compiled)
                    steps(1)
                    times[compiled] += steps(count)
        eager, fast = statistics.median(times[False]), statistics.median(times[True])
        rows.append(
            {
                "pp": pp,
                "eager_tokens_per_s": tokens_per_step / eager,
                "compiled_tokens_per_s": tokens_per_step / fast,
                "compiled_over_eager_tokens_per_s": eager / fast,
                "compile_s": first - fast,
            }
        )
    return {"part": "compile", "model": f"GPT {cfg.n_layer}x{cfg.n_embd}", "rows": rows}


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["llm_lora", "compile", "qlora"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--work", type=Path, required=True, help="where the LLM's files are made and kept")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    import ray

    from raypipe import driver

    driver.connect()  # a local Ray advertising this machine's accelerators
    try:
        part = {"llm_lora": llm_lora, "compile": compile_part, "qlora": qlora}[args.part]
        json_out.emit(part(args, device))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    json_out.run(main)
