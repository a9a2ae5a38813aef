"""Token decoding in one process: raypipe's stage modules against transformers' `generate`.

Both sides hold the same random Llama (`--layers`, `--hidden`, 256 token ids) with the same LoRA
(r 8 on q/k/v/o, as peft injects it), and decode `--rows` rows of a `--prompt`-token prompt for
`--new` sampled tokens (temperature 1, no top-k or top-p) with a KV cache, on the machine's cores
as torch threads. transformers runs `generate` on the peft model; raypipe runs its stage modules
(`hf.from_pretrained`'s layers, LoRA applied as a stage actor applies it) as an actor decodes them
(`raypipe.nn.decoding`: `Feed`, `Picker`; the layers' shared cache). No Ray, no pipeline: what is
left is the per-token cost of raypipe's layer wrappers against the whole model's forward. The
two take turns, generation by generation; the ratio is transformers' seconds over raypipe's,
pair by pair.

    python benchmarks/decode_vs_generate.py > decode_vs_generate.json     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from dpo_throughput import LORA, save_model
from torch import nn

from raypipe.core.layers import build_layers, layer_seed
from raypipe.models import hf
from raypipe.nn import lora
from raypipe.nn.decoding import Feed, Picker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved, ratio_with_spread  # noqa: E402


def transformers_generate(directory: str, ids: torch.Tensor, new: int):
    """transformers' `generate` on the peft model, sampled, every row running `new` tokens."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora.peft_config(lora.check(LORA)))
    model.eval()
    mask = torch.ones_like(ids)

    @torch.no_grad()
    def run(step: int) -> None:
        torch.manual_seed(step)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )

    return run


def raypipe_decode(directory: str, ids: torch.Tensor, new: int):
    """raypipe's stage modules with LoRA, decoding as a stage actor does (one actor: every layer)."""
    layers = build_layers(hf.from_pretrained(directory).layers)
    module = nn.Sequential(*layers)
    lora.apply(module, lora.check(LORA), [layer_seed(0, i) for i in range(len(layers))])
    module.eval()
    caching = [layer for layer in module if hasattr(layer, "begin_cache")]

    @torch.no_grad()
    def run(step: int) -> None:
        feed, picker, shared = Feed(ids, torch.ones_like(ids), True), Picker(len(ids), 1.0, None, 1.0, step, None), {}
        for layer in caching:
            layer.begin_cache(shared)
        caches = [layer.cache for layer in caching]
        x = feed.prompt()
        for _ in range(new):
            for layer, cache in zip(caching, caches):
                layer.cache = cache
            logits = module(x)[:, -1].float()
            for layer in caching:
                layer.end_cache()
            x = feed.next(picker(logits))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "raypipe-decode-bench"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    directory = save_model(a.dir + f"-{a.layers}x{a.hidden}", a.layers, a.hidden, 256)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    torch.manual_seed(0)
    ids = torch.randint(2, 256, (a.rows, a.prompt))
    runners = {
        "transformers": transformers_generate(directory, ids, a.new),
        "raypipe": raypipe_decode(directory, ids, a.new),
    }
    seconds = interleaved(runners, a.rounds, a.steps, warmup=1)
    result = {
        "machine": {"cpus": cores, "python": platform.python_version(), "torch": torch.__version__},
        "model": {"layers": a.layers, "hidden": a.hidden, "vocab": 256, "lora": LORA},
        "decode": {"rows": a.rows, "prompt": a.prompt, "new_tokens": a.new},
        "generation_s": {name: statistics.median(s for r in per for s in r) for name, per in seconds.items()},
        "transformers_over_raypipe": ratio_with_spread(seconds, "transformers", "raypipe"),
    }
    json_out.emit(result, indent=2)


if __name__ == "__main__":
    json_out.run(main)
