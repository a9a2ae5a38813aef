"""One long sample through a two-stage pipeline, whole and cut into sequence chunks (issue 63).

A random transformers Llama (`--layers` decoder layers, `--hidden` wide; nothing is downloaded),
batch 1 x `--tokens` tokens, pp = 2, 1F1B, SGD. Unchunked, a batch of one is one microbatch: each
stage idles while the other works. With `sequence_chunks` k the sample's chunks flow through the
stages one after another (`raypipe.nn.sequence_chunks`).

- Speed: one trainer, `reconfigure(sequence_chunks=k)` between steps, every k's steps taken in
  turn (`rounds.interleaved`), so load on the machine hits them alike: tokens/s per k (median step)
  and its ratio to k = 1, beside the ratio the schedule predicts (`schedules.timed` with each
  chunk's forward 1/k of the sample's and its backward twice that: the bubble alone).
- Memory: per k, each stage's peak of activations saved for backward (`measure_activations`),
  and, from a fresh trainer per k (its actors are new processes), each stage's peak resident
  memory (`peak_memory_bytes`, the process's max RSS after one step).
- The planner (`--auto`): a trainer built with `sequence_chunks="auto"` times the layers on the
  sample cut each way and predicts each k's step (`planning.autoschedule`); its choice and its
  predictions (ms per step, and as ratios to its k = 1) beside the measured ones.
- Recomputed (`--recompute`, the k to run so, labelled "k+r"): the same with
  `activation_checkpointing`, each chunk's forward run again in its backward, so a stage keeps
  only each chunk's input, keys and values and one chunk's activations at a time.
- ZB-H1 (`--zb`, the k to run so, labelled "k zb"): each unit's backward split into its input
  and weight halves, the weight halves filling the bubble.

    python benchmarks/sequence_chunks.py > sequence_chunks.json      # about 6 minutes on 2 cores
    python benchmarks/sequence_chunks.py --tokens 256 --layers 2 --hidden 64 --rounds 1   # small
"""

from __future__ import annotations

import argparse
import os
import platform
import re
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
from raypipe.schedules import build_schedule, timed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from rounds import interleaved  # noqa: E402

SGD = {"name": "sgd", "lr": 1e-3}


def sample(step: int, tokens: int, vocab: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (1, tokens), generator=g)
    return {"input_ids": ids}, ids.clone()


def predicted_ratio(k: int, pp: int) -> float:
    """The unchunked step's span over the chunked one's, from the schedule alone."""

    def span(chunks: int) -> float:
        costs = {"F": 1.0 / chunks, "B": 2.0 / chunks}
        return max(
            end for actor in timed(build_schedule("1f1b", pp, 1, sequence_chunks=chunks), costs) for *_, end in actor
        )

    return span(1) / span(k)


def went(trainer: Trainer) -> dict:
    """Where the trainer's last step went: `Trainer.timeline().breakdown` (ms), and per stage the
    ms its forwards and its backwards took."""
    kinds = {"F": "forward_ms", "B": "backward_ms"}
    stages = [
        {name: round(1000 * sum(e[3] - e[2] for e in events if e[0] == kind), 1) for kind, name in kinds.items()}
        for events in trainer.state.last_events
    ]
    parts = {k: round(v, 1) if isinstance(v, float) else v for k, v in trainer.timeline().breakdown.to_dict().items()}
    return {**parts, "busy_ms": [round(b, 1) for b in parts["busy_ms"]], "stages": stages}


def plan_auto(model, batch) -> dict:
    """What `sequence_chunks="auto"` plans on `batch` and predicts for each k (its log's candidates),
    what its trial then measured of the planned k and of k = 1 (ms a step), and the k it kept."""
    lines: list[str] = []
    config = TrainConfig(pp=2, optimizer=SGD, sequence_chunks="auto")
    started = time.perf_counter()
    with Trainer(model, config=config, sample=batch, log=lines.append) as trainer:
        kept = trainer.config.sequence_chunks
    planning_s = time.perf_counter() - started
    plan = next(line for line in lines if line.startswith("sequence_chunks=auto chose"))
    predicted = {}
    for line in plan.splitlines()[1:]:
        found = re.match(r"\s+1f1b, m=1(?:, sequence_chunks=(\d+))?: ([\d.]+) ms", line)
        if found:
            predicted[int(found[1] or 1)] = float(found[2])
    ratios = {k: round(predicted[1] / ms, 3) for k, ms in predicted.items()} if 1 in predicted else {}
    planned = int(re.match(r"sequence_chunks=auto chose 1f1b, m=1(?:, sequence_chunks=(\d+))?", plan)[1] or 1)
    trial = next((line for line in lines if line.startswith("sequence_chunks=auto measured")), "")
    measured = {
        int(k): [float(v) for v in ms.split(", ")] for k, ms in re.findall(r"sequence_chunks=(\d+) ([\d, ]+) ms", trial)
    }
    unchunked = re.search(r"unchunked ([\d, ]+) ms", trial)
    measured |= {1: [float(v) for v in unchunked[1].split(", ")]} if unchunked else {}
    return {
        "planned": planned,
        "kept": kept,
        "predicted_ms": predicted,
        "predicted_speedup": ratios,
        "trial_ms": measured,
        "start_s": round(planning_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--recompute", default="1,4,8,16", help="the k also run with activation checkpointing")
    parser.add_argument("--zb", default="8,16", help="the k also run under the zb-h1 schedule")
    parser.add_argument("--auto", action="store_true", help='also plan with sequence_chunks="auto"')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ray-cpus", type=int, default=2, help="the CPUs Ray is told (the machine's cores: 2)")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh trainer per k for resident memory")
    parser.add_argument(
        "--breakdown", action="store_true", help="per k, where its fastest step went (`Trainer.timeline().breakdown`)"
    )
    args = parser.parse_args()
    runs = {str(k): (int(k), False, "1f1b") for k in args.chunks.split(",")}
    runs.update({f"{k}+r": (int(k), True, "1f1b") for k in args.recompute.split(",") if k})
    runs.update({f"{k} zb": (int(k), False, "zb-h1") for k in args.zb.split(",") if k})
    ray.init(
        address="local", num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    directory = save_model(tempfile.mkdtemp(), args.layers, args.hidden, args.vocab, positions=args.tokens)
    model = hf.from_pretrained(directory)
    config = TrainConfig(pp=2, microbatches=1, optimizer=SGD, measure_activations=True)
    stashed: dict[str, list[int]] = {}
    fastest: dict[str, tuple[float, dict]] = {}  # per label, its fastest step's seconds and breakdown
    with Trainer(model, config=config) as trainer:

        def runner(label: str):
            k, recompute, schedule = runs[label]

            def run(step: int) -> None:
                trainer.reconfigure(sequence_chunks=k, activation_checkpointing=recompute, schedule=schedule)
                started = time.perf_counter()
                metrics = trainer.step(*sample(step, args.tokens, args.vocab))
                seconds = time.perf_counter() - started
                stashed[label] = [int(s["peak_stashed_bytes"]) for s in metrics["stages"]]
                if args.breakdown and seconds < fastest.get(label, (float("inf"),))[0]:
                    fastest[label] = (seconds, went(trainer))

            return run

        seconds = interleaved({label: runner(label) for label in runs}, args.rounds, args.steps, warmup=1)
    median = {label: statistics.median(s for r in seconds[label] for s in r) for label in runs}
    resident = {}
    for label, (k, recompute, schedule) in (
        {} if args.no_memory else runs.items()
    ):  # fresh actors per run: a process's max RSS only grows
        fresh = TrainConfig(
            pp=2, optimizer=SGD, sequence_chunks=k, activation_checkpointing=recompute, schedule=schedule
        )
        with Trainer(model, config=fresh) as trainer:
            metrics = trainer.step(*sample(0, args.tokens, args.vocab))
            resident[label] = [int(s["peak_memory_bytes"]) for s in metrics["stages"]]
    planned = plan_auto(model, sample(0, args.tokens, args.vocab)) if args.auto else None
    ray.shutdown()
    report = {
        "benchmark": "sequence_chunks",
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens},
        "pp": 2,
        "ray_cpus": args.ray_cpus,
        "schedule": "1f1b; zb-h1 for the labels ending zb",
        "tokens_per_s": {label: round(args.tokens / median[label], 1) for label in runs},
        "speedup_vs_unchunked": {label: round(median["1"] / median[label], 3) for label in runs if "1" in median},
        "predicted_speedup": {label: round(predicted_ratio(k, 2), 3) for label, (k, _, _) in runs.items()},
        "step_s_median": {label: round(median[label], 3) for label in runs},
        "peak_stashed_mib_per_stage": {label: [round(b / 2**20, 1) for b in stashed[label]] for label in runs},
        "peak_resident_mib_per_stage": {label: [round(b / 2**20, 1) for b in resident[label]] for label in resident},
        **({"fastest_step_breakdown": {label: parts for label, (_, parts) in fastest.items()}} if fastest else {}),
        **({"auto": planned} if planned else {}),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "python benchmarks/sequence_chunks.py",
    }
    json_out.emit(report, indent=2)


if __name__ == "__main__":
    json_out.run(main)
