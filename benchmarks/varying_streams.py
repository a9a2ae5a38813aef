"""Microbatches of differing shapes between two stages on one node: what their messages cost.

A step's microbatches differ in shape when each is padded to its own longest row, when a
caller passes microbatches of any sizes (`Trainer.step` takes lists), or when
`sequence_chunks` cuts a sequence into unequal parts. Such a stream is *varying*: each message
describes itself. This times one Llama (`--layers` x `--hidden`, nothing downloaded) at pp = 2
on one node, two trainers side by side, steps interleaved (`rounds.interleaved`): one moving
boundaries through shared memory (`same_node_transport="shm"`, the default), one through gloo
over loopback. Each takes an even step (4 microbatches of 2 rows x `--tokens`) and an uneven
one (the same rows, each microbatch 8 tokens shorter than the one before); per label, the
median step and the ms its stages spent in messages (`Trainer.timeline().breakdown.messages_ms`,
of the fastest step).

Then sequence chunks (`--no-chunked` skips them): one sample of `--chunk-tokens` tokens, and
one a token shorter, through a 4 x 64 Llama at pp = 2 whole and in 8 chunks, one trainer per
transport (shm, then gloo: what a link between nodes uses), steps interleaved. 2,048 tokens
cut in 8 are equal chunks; 2,047 are not (seven of 256 tokens, then 255), so that stream varies.

    python benchmarks/varying_streams.py > varying_streams.json     # about 2 minutes on 2 cores
    python benchmarks/varying_streams.py --chunks-only --chunk-transports gloo --rounds 8   # the chunks over gloo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from dpo_throughput import save_model

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved  # noqa: E402

SHRINK = {"even": 0, "uneven": 8}  # tokens each microbatch is shorter than the one before


def batch(step: int, tokens: int, shrink: int, vocab: int) -> tuple[list[dict], list[torch.Tensor]]:
    """Four microbatches of 2 rows, the first `tokens` long, each next `shrink` tokens shorter."""
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(3, vocab, (2, tokens - m * shrink), generator=g) for m in range(4)]
    return [{"input_ids": i} for i in ids], [i.clone() for i in ids]


def chunks_of_unequal_length(args: argparse.Namespace, transport: str) -> dict:
    """One sample whole and in 8 chunks, `args.chunk_tokens` long and a token shorter, between
    stages linked by `transport` (`same_node_transport`): per label ("k@tokens") the median step
    and the median of its messages' ms, and the ratios. Each turn takes two steps of its kind and
    times the second, as in a run of such samples (a stream's previous step decides what its
    receiver posts ahead)."""
    from sequence_chunks import SGD, sample

    tokens = args.chunk_tokens
    model = hf.from_pretrained(save_model(tempfile.mkdtemp(), 4, 64, args.vocab, tokens))
    runs = {f"{k}@{n}": (k, n) for n in (tokens, tokens - 1) for k in (1, 8)}
    timed: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    config = TrainConfig(pp=2, microbatches=1, optimizer=SGD, same_node_transport=transport)
    with Trainer(model, config=config) as trainer:

        def runner(label: str):
            k, n = runs[label]

            def run(step: int) -> None:
                trainer.reconfigure(sequence_chunks=k)
                trainer.step(*sample(step, n, args.vocab))
                started = time.perf_counter()
                trainer.step(*sample(step + 1, n, args.vocab))
                timed[label].append((time.perf_counter() - started, trainer.timeline().breakdown.messages_ms))

            return run

        interleaved({label: runner(label) for label in runs}, args.rounds, args.steps, warmup=1)
    median = {label: statistics.median(s for s, _ in steps) for label, steps in timed.items()}
    return {
        "transport": transport,
        "model": {"layers": 4, "hidden": 64, "vocab": args.vocab},
        "step_ms_median": {label: round(1000 * s, 1) for label, s in median.items()},
        "messages_ms_median": {
            label: round(statistics.median(m for _, m in steps), 1) for label, steps in timed.items()
        },
        "speedup_vs_unchunked": {n: round(median[f"1@{n}"] / median[f"8@{n}"], 3) for n in (tokens, tokens - 1)},
        "unequal_vs_equal_chunks": round(median[f"8@{tokens - 1}"] / median[f"8@{tokens}"], 3),
    }


def microbatches_of_differing_shapes(args: argparse.Namespace) -> dict:
    """Two trainers (shm, gloo) each taking even and uneven steps, interleaved: per label the median
    step and the messages' ms of its fastest step, and the ratios."""
    model = hf.from_pretrained(save_model(tempfile.mkdtemp(), args.layers, args.hidden, args.vocab, args.tokens))
    configs = {
        transport: TrainConfig(
            pp=2, microbatches=4, optimizer={"name": "sgd", "lr": 1e-3}, same_node_transport=transport
        )
        for transport in ("shm", "gloo")
    }
    trainers = {transport: Trainer(model, config=config) for transport, config in configs.items()}
    messages: dict[str, float] = {}
    fastest: dict[str, float] = {}
    try:

        def runner(transport: str, shape: str):
            trainer, label = trainers[transport], f"{transport} {shape}"

            def run(step: int) -> None:
                started = time.perf_counter()
                trainer.step(*batch(step, args.tokens, SHRINK[shape], args.vocab))
                seconds = time.perf_counter() - started
                if seconds < fastest.get(label, float("inf")):
                    fastest[label] = seconds
                    messages[label] = trainer.timeline().breakdown.messages_ms

            return run

        runners = {f"{t} {s}": runner(t, s) for t in trainers for s in SHRINK}
        seconds = interleaved(runners, args.rounds, args.steps, warmup=2)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
    median = {label: statistics.median(s for r in runs for s in r) for label, runs in seconds.items()}
    return {
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens},
        "pp": 2,
        "microbatches": 4,
        "shorter_by": SHRINK,
        "step_ms_median": {label: round(1000 * s, 1) for label, s in median.items()},
        "messages_ms_fastest_step": {label: round(ms, 1) for label, ms in messages.items()},
        "uneven_vs_even": {t: round(median[f"{t} uneven"] / median[f"{t} even"], 3) for t in trainers},
        "shm_vs_gloo_uneven": round(median["gloo uneven"] / median["shm uneven"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--no-chunked", dest="chunked", action="store_false", help="skip the sequence chunks")
    parser.add_argument("--chunks-only", action="store_true", help="only the sequence chunks")
    parser.add_argument("--chunk-transports", default="shm,gloo", help="the chunks' transports, comma-separated")
    args = parser.parse_args()
    # two trainers of two actors each on the machine's cores: Ray is told four CPUs, and each
    # actor's threads still fit the cores (`planning.threads`)
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    shapes = {} if args.chunks_only else microbatches_of_differing_shapes(args)
    transports = args.chunk_transports.split(",")
    chunked = [chunks_of_unequal_length(args, t) for t in transports] if args.chunked or args.chunks_only else None
    ray.shutdown()
    json_out.emit(
        {
            "benchmark": "varying_streams",
            **shapes,
            **({"sequence_chunks": chunked} if chunked else {}),
            "command": "python " + " ".join(sys.argv),
        },
        indent=2,
    )


if __name__ == "__main__":
    json_out.run(main)
