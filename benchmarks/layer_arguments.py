"""What making a transformers decoder layer's arguments costs, and what keeping them saves
(`raypipe.models.hf.argument_memo`): transformers' prologue (its base model's forward up to the
layer: rotary embeddings, masks, cache positions) per call at Qwen2-0.5B's shape, with and without
padding; then a stage's decoder layers, forward and backward on one padded microbatch in this
process on one thread, with the arguments made once per attention type (as now) and once per layer
(as before), interleaved.

    python benchmarks/layer_arguments.py                        # ~1 min on 2 cores
    python benchmarks/layer_arguments.py --layers 12 --hidden 256 --batch 4 --tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from dpo_throughput import save_model

from raypipe.core.layers import build_layer
from raypipe.models import hf
from raypipe.models.hf import argument_memo, skeleton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


def prologue_ms(shapes: list[tuple[int, int]], rounds: int = 20) -> dict[str, float]:
    """transformers' prologue for one decoder layer at Qwen2-0.5B's shape (896 wide, 14 heads, 2 KV
    heads), median ms a call, per (batch, tokens) without a mask and with a quarter of a row padded."""
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    out = {}
    for batch, tokens in shapes:
        hidden = torch.zeros(batch, tokens, 896)
        mask = torch.ones(batch, tokens, dtype=torch.long)
        mask[0, : tokens // 4] = 0
        for name, m in (("plain", None), ("padded", mask)):
            inputs = {"attention_mask": m, "position_ids": torch.arange(tokens)[None], "use_cache": False}
            times = []
            for _ in range(rounds + 2):
                started = time.perf_counter()
                skeleton.layer_inputs(config, [0], hidden, inputs)
                times.append(time.perf_counter() - started)
            out[f"{batch}x{tokens} {name}"] = round(1000 * statistics.median(times[2:]), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a stage actor with one core
    model = hf.from_pretrained(save_model(tempfile.mkdtemp(), args.layers, args.hidden, 256, args.tokens))
    layers = [build_layer(spec, 0, i) for i, spec in enumerate(model.layers)]
    stage = torch.nn.Sequential(*[layer for layer in layers if hasattr(layer, "block")])
    mask = torch.ones(args.batch, args.tokens, dtype=torch.long)
    mask[::2, : args.tokens // 4] = 0  # every other row a quarter padded
    shared = argument_memo._shared

    def per_layer(*a: object) -> tuple:  # as before: each layer made its own
        argument_memo._recent.clear()
        return shared(*a)

    seconds: dict[str, list[float]] = {"per type": [], "per layer": []}
    for r in range(args.rounds + 2):
        for name in seconds:
            argument_memo._shared = shared if name == "per type" else per_layer
            x = {
                "hidden_states": torch.randn(args.batch, args.tokens, args.hidden, requires_grad=True),
                "attention_mask": mask.clone(),  # a new microbatch's
                "position_ids": torch.arange(args.tokens)[None],
            }
            started = time.perf_counter()
            stage(x)["hidden_states"].sum().backward()
            if r >= 2:
                seconds[name].append(time.perf_counter() - started)
    argument_memo._shared = shared
    ms = {name: round(1000 * statistics.median(s), 1) for name, s in seconds.items()}
    json_out.emit(
        {
            "benchmark": "layer_arguments",
            "prologue_ms_qwen2_0_5b": prologue_ms([(4, 512), (8, 256), (1, 2048)]),
            "model": {"layers": args.layers, "hidden": args.hidden, "batch": args.batch, "tokens": args.tokens},
            "padded_forward_backward_ms": ms,
            "per_layer_vs_per_type": round(ms["per layer"] / ms["per type"], 3),
            "threads": 1,
            "command": "python benchmarks/layer_arguments.py",
        },
        indent=2,
    )


if __name__ == "__main__":
    json_out.run(main)
