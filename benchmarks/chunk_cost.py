"""What a sequence chunk costs, without Ray: the layers of `sequence_chunks.py`'s Llama split in two as
a pp = 2 trainer splits them, run in this process on one thread, forward and backward of one sample cut
into k chunks (`raypipe.nn.sequence_chunks.Sequence`, as a stage runs them), per stage and k.

A pipeline of chunks can at best hide the bubble; every unit it adds costs what the layers' Python and
smaller matrix products cost per chunk. This separates that cost from the two stages' running at once
(`sequence_chunks.py` measures the pipeline): the ratio of a k's total to k = 1's is what the chunks
themselves add. Beside it, transformers' own decoder layer's cost per call on a few tokens
(`per_call_ms`, no raypipe around it) and the ratio k - 1 more calls of every layer give at that
cost alone (`floor_vs_unchunked`): what any chunking of these layers pays in eager PyTorch; the
rest of the ratio is raypipe's chunk machinery and the smaller matrix products. `--ops` also counts,
per k, the operators a step dispatches and the time inside the matrix products and attention kernels
(torch's profiler, a few steps after the timed ones): where that arithmetic stays put as k grows, what
k adds is the cost of calling more, smaller operators, not arithmetic. From each chunk's own
time, the step two stages would take on them with messages free (`two_stage_span`) and k = 1's
over it (`bound_vs_unchunked`): the most a pp = 2 pipeline of these chunks can gain, whatever
its schedule and transport. `--also-made` runs
each k a second way, interleaved, with every layer's arguments and the embedding made by
transformers' prologue each step as before they were kept (`made_vs_kept`).

    python benchmarks/chunk_cost.py --layers 6 --hidden 128 > chunk_cost.json   # ~1 min on 2 cores
    python benchmarks/chunk_cost.py --layers 4 --hidden 64 --chunks 1,8 --also-made   # ~1 min
    python benchmarks/chunk_cost.py --layers 4 --hidden 64 --chunks 1,8 --ops         # ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from dpo_throughput import save_model
from sequence_chunks import sample

from raypipe.core.layers import build_layer
from raypipe.data.sequence_units import cut_microbatch
from raypipe.models import hf
from raypipe.models.hf import argument_memo, embedding_alone, skeleton
from raypipe.nn.sequence_chunks import Sequence
from raypipe.planning.partition import uniform_plan
from raypipe.schedules import build_schedule, timed
from raypipe.transport.tree import map_tensors, tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved  # noqa: E402


def boundary(out: object) -> object:
    """A stage's output as the next stage receives it: its floating tensors detached, taking gradients."""
    return map_tensors(lambda t: t.detach().requires_grad_() if t.is_floating_point() else t, out)


def one_step(stages: list, loss_fn, x: dict, y: torch.Tensor, k: int) -> list[list[float]]:
    """Forward and backward of one sample cut in k on both stages, in the order the pipeline runs
    them (forwards in chunk order, backwards in reverse); seconds of each chunk, per stage, forward
    then backward: [stage 0 forwards, stage 1 forwards, stage 0 backwards, stage 1 backwards]."""
    units, targets, weights = cut_microbatch(x, y, k, loss_fn)
    sequences = [Sequence(k), Sequence(k)]
    clock = [[0.0] * k for _ in range(4)]  # stage 0 forward, stage 1 forward, stage 0 backward, stage 1 backward
    sent, received, losses = [], [], []
    for c, unit in enumerate(units):
        started = time.perf_counter()
        out = sequences[0].forward(c, stages[0], unit) if k > 1 else stages[0](unit)
        sent.append(out)
        received.append(boundary(out))
        clock[0][c] = time.perf_counter() - started
        started = time.perf_counter()
        logits = sequences[1].forward(c, stages[1], received[c]) if k > 1 else stages[1](received[c])
        losses.append(loss_fn(logits, targets[c]) * weights[c])
        clock[1][c] = time.perf_counter() - started
    for c in reversed(range(k)):
        started = time.perf_counter()
        pairs = [(losses[c], torch.ones(())), *sequences[1].roots(c)]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        clock[3][c] = time.perf_counter() - started
        started = time.perf_counter()
        pairs = [(a, b.grad) for a, b in zip(tensors(sent[c]), tensors(received[c])) if b.grad is not None]
        pairs += sequences[0].roots(c)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        clock[2][c] = time.perf_counter() - started
    return clock


def two_stage_span(chunk_ms: list[list[float]]) -> float:
    """The step of two stages running these chunks (ms of each, as `one_step` gives them) under
    1F1B's chunked schedule, as `schedules.timed` runs it with messages free and nothing else on
    the cores: the best any schedule of these chunks reaches on two stages. What is left of the
    bubble is stage 0's first forward and stage 1's last forward and backward."""
    f0, f1, b0, b1 = chunk_ms
    ms = {(0, "F"): f0, (1, "F"): f1, (0, "B"): b0, (1, "B"): b1}
    schedule = build_schedule("1f1b", 2, 1, sequence_chunks=len(f0))
    return max(end for actor in timed(schedule, lambda a: ms[a.stage, a.kind][a.microbatch]) for *_, end in actor)


@contextlib.contextmanager
def made_afresh(afresh: bool):
    """Inside, with `afresh`: every layer's arguments and the embedding made by transformers' prologue
    each step, none kept (`argument_memo`, `embedding_alone` off): the cost before they were kept."""
    if not afresh:
        yield
        return
    get, known = argument_memo.get, embedding_alone.known
    argument_memo.get, embedding_alone.known = (lambda key: None), (lambda config, embedding: False)
    try:
        yield
    finally:
        argument_memo.get, embedding_alone.known = get, known


def per_call_ms(layer: torch.nn.Module, width: int, tokens: int = 32, rounds: int = 30) -> list[float]:
    """transformers' own decoder layer (`layer.block`, no raypipe around it) on `tokens` tokens,
    median ms of its forward and its backward: what any chunk pays per layer before its arithmetic,
    the floor of k chunks' cost in eager PyTorch ((k - 1) more calls per layer)."""
    hidden = torch.randn(1, tokens, width, requires_grad=True)
    positions = torch.arange(tokens).unsqueeze(0)
    args, kwargs = skeleton.layer_inputs(
        layer.config, [layer.index], hidden, {"attention_mask": None, "position_ids": positions, "use_cache": False}
    )[layer.index]
    times: list[tuple[float, float]] = []
    for _ in range(rounds):
        started = time.perf_counter()
        out = layer.block(hidden, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        middle = time.perf_counter()
        out.sum().backward()
        times.append((middle - started, time.perf_counter() - middle))
    return [round(1000 * statistics.median(t[i] for t in times[3:]), 3) for i in (0, 1)]


ARITHMETIC = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def operators(stages: list, loss_fn, x: dict, y: torch.Tensor, k: int, steps: int = 3) -> dict:
    """Per step of k chunks, under torch's profiler: how many operators it dispatches, the ms inside
    the matrix products and attention kernels (forward and backward: the arithmetic) and inside every
    other op (each op's self time), and its wall ms with the profiler on (which adds its own cost per op)."""
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        for _ in range(steps):
            one_step(stages, loss_fn, x, y, k)
    wall = time.perf_counter() - started
    events = profiled.key_averages()
    arithmetic = sum(e.self_cpu_time_total for e in events if e.key.startswith(ARITHMETIC))
    return {
        "ops": round(sum(e.count for e in events) / steps),
        "arithmetic_ms": round(arithmetic / 1000 / steps, 1),
        "other_ops_ms": round((sum(e.self_cpu_time_total for e in events) - arithmetic) / 1000 / steps, 1),
        "profiled_wall_ms": round(1000 * wall / steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--also-made",
        action="store_true",
        help="each k also with every layer's arguments and embedding made afresh each step, as before "
        "argument_memo and embedding_alone (side by side, interleaved)",
    )
    parser.add_argument(
        "--ops", action="store_true", help="per k, the operators a step dispatches and the time inside them"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a stage actor with one core
    model = hf.from_pretrained(save_model(tempfile.mkdtemp(), args.layers, args.hidden, args.vocab, args.tokens))
    layers = [build_layer(spec, 0, i) for i, spec in enumerate(model.layers)]
    stages = [torch.nn.Sequential(*layers[a:b]) for a, b in uniform_plan(len(layers), 2)]
    x, y = sample(0, args.tokens, args.vocab)
    counts = [int(k) for k in args.chunks.split(",")]
    labels = {str(k): (k, True) for k in counts} | ({f"{k} made": (k, False) for k in counts} if args.also_made else {})
    clocks: dict[str, list[list[list[float]]]] = {label: [] for label in labels}

    def runner(label: str):
        k, kept = labels[label]

        def run(step: int) -> None:
            with made_afresh(not kept):
                clocks[label].append(one_step(stages, model.loss_fn, x, y, k))

        return run

    interleaved({label: runner(label) for label in labels}, args.rounds, 1, warmup=1)
    chunk_ms = {  # per label, each chunk's median ms per stage and direction
        label: [[1000 * statistics.median(c[i][u] for c in runs[1:]) for u in range(len(runs[0][i]))] for i in range(4)]
        for label, runs in clocks.items()
    }
    ms = {label: [round(sum(part), 1) for part in parts] for label, parts in chunk_ms.items()}
    span = {label: two_stage_span(parts) for label, parts in chunk_ms.items() if "made" not in label}
    first = str(min(counts))
    ops = {str(k): operators(stages, model.loss_fn, x, y, k) for k in counts} if args.ops else None
    decoder = next(layer for layer in layers if hasattr(layer, "block"))
    floor = per_call_ms(decoder, args.hidden)
    calls = args.layers * sum(floor)  # one more call of each decoder layer, forward and backward, per chunk
    json_out.emit(
        {
            "benchmark": "chunk_cost",
            "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens},
            "ms_per_stage": {
                k: {"forward": v[:2], "backward": v[2:], "total": round(sum(v), 1)} for k, v in ms.items()
            },
            "total_vs_unchunked": {k: round(sum(v) / sum(ms[first]), 3) for k, v in ms.items() if "made" not in k},
            # each k's step on two stages with free messages (`two_stage_span`), and k = 1's over it:
            # the most a pp = 2 pipeline of these chunks can gain
            "two_stage_span_ms": {k: round(v, 1) for k, v in span.items()},
            "bound_vs_unchunked": {k: round(span[first] / v, 3) for k, v in span.items()},
            **(
                {  # each k's total with arguments made afresh over kept (argument_memo, embedding_alone)
                    "made_vs_kept": {str(k): round(sum(ms[f"{k} made"]) / sum(ms[str(k)]), 3) for k in counts},
                    "made_total_vs_unchunked": {
                        str(k): round(sum(ms[f"{k} made"]) / sum(ms[f"{first} made"]), 3) for k in counts
                    },
                }
                if args.also_made
                else {}
            ),
            # transformers' own cost per decoder layer call, and what k - 1 more calls of every layer
            # add over k = 1 at that cost alone: the part of the ratio above that eager PyTorch sets
            "per_call_ms": {"tokens": 32, "forward": floor[0], "backward": floor[1]},
            "floor_vs_unchunked": {str(k): round(1 + (k - 1) * calls / sum(ms[first]), 3) for k in counts},
            **({"operators_per_step": ops} if ops else {}),
            "threads": 1,
            "command": "python benchmarks/chunk_cost.py",
        },
        indent=2,
    )


if __name__ == "__main__":
    json_out.run(main)
