"""torch.compile'd layers against eager ones (`TrainConfig.compile`, inductor on CPU): the main job's
GPT (4 blocks of 128, batch 32 x 64 tokens) and a transformers Llama of the same width (4 decoder
layers, grouped-query attention), each at pp = 1 and 2 (1F1B, 4 microbatches; at pp = 2 also
DualPipeV, whose split backward a compiled stage runs whole at I).

One Trainer per model and pp; eager and compiled alternate on it (`reconfigure(compile=...)`)
`--rounds` times, `--steps` steps each after one warm-up step, so a drifting load hits both alike.
Reported: median step and tokens/s of each, their ratio (compiled over eager, above 1: faster),
and the compile time apart (the first compiled step less a compiled step; the inductor cache
on disk, `/tmp/torchinductor_<user>`, makes later runs cheaper, so `--fresh-cache` empties it
first, for the cold figure).

    python benchmarks/compile_cpu.py [--rounds 3] [--steps 5] [--fresh-cache]
"""

from __future__ import annotations

import argparse
import getpass
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ray
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import gpt, hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

BATCH, SEQ, VOCAB = 32, 64, 256


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def llama(directory: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def steps(trainer: Trainer, count: int) -> list[float]:
    return [trainer.step(*batch(k))["step_time"] for k in range(count)]


def measure(name: str, make, pp: int, schedule: str, rounds: int, count: int) -> dict:
    config = TrainConfig(
        pp=pp,
        microbatches=4,
        schedule=schedule,
        optimizer={"name": "adamw", "lr": 1e-3},
        cpus_per_actor=0.01,
        name=f"compile-{name}-pp{pp}",
    )
    with make(config) as trainer:
        steps(trainer, 1)
        trainer.reconfigure(compile=True)
        started = time.perf_counter()
        first = steps(trainer, 1)[0]
        compile_s = time.perf_counter() - started
        graphs = trainer.step(*batch(0))["stages"][0]["compiled"]
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for compiled in (False, True):
                trainer.reconfigure(compile=compiled)
                steps(trainer, 1)
                times[compiled] += steps(trainer, count)
    eager, fast = statistics.median(times[False]), statistics.median(times[True])
    return {
        "model": name,
        "pp": pp,
        "schedule": schedule,
        "eager_step_s": eager,
        "compiled_step_s": fast,
        "eager_tokens_per_s": BATCH * SEQ / eager,
        "compiled_tokens_per_s": BATCH * SEQ / fast,
        "compiled_over_eager_tokens_per_s": eager / fast,
        "compile_s": first - fast,
        "first_compiled_step_wall_s": compile_s,
        "stage0_compiled": graphs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fresh-cache", action="store_true", help="empty the inductor cache first")
    args = parser.parse_args()
    if args.fresh_cache:
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"), ignore_errors=True)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    cfg = gpt.GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128, block_size=SEQ)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        path = llama(directory)
        makers = {
            "gpt": lambda c: Trainer(gpt.layers(cfg), gpt.loss_fn, c),
            "llama": lambda c: Trainer(hf.from_pretrained(path), config=c),
        }
        for name, make in makers.items():
            for pp, schedule in ((1, "1f1b"), (2, "1f1b"), (2, "dualpipe-v")):
                row = measure(name, make, pp, schedule, args.rounds, args.steps)
                rows.append(row)
                json_out.emit(row)
    ray.shutdown()
    json_out.emit({"benchmark": "compile_cpu", "cores": os.cpu_count(), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    json_out.run(main)
