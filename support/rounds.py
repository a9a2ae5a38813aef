"""Timing several runs side by side: warm each up, then take their steps in turn (one step
of each, then the next step of each, ...), so background load on the machine hits them
alike. The order rotates every turn, so no runner always follows the same one (the
plain loop right after an actor's block, say, finding the caches the actor left).
Used by gpt_cpu.py, gpt_gpu.py and the GPU check's parts: a baseline run in the benchmark's own
process computes with the threads one actor gets (`match_actor_threads`), so a ratio compares
the same work, and every ratio is reported with its spread (`ratio_with_spread`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    runners: dict[str, Callable[[int], None]], rounds: int, steps: int, warmup: int = 3
) -> dict[str, list[list[float]]]:
    """Seconds of each step of each runner (`run(step)`): `[round][step]` per runner.

    Runners alternate step by step, so two runners' step i of a round ran within
    about a second of each other, on the same machine load; turn i starts with runner
    i mod n.
    """
    names = list(runners)
    for run in runners.values():  # first steps pay for allocation, imports, autotuning
        for step in range(warmup):
            run(step)
    seconds: dict[str, list[list[float]]] = {name: [] for name in runners}
    for r in range(rounds):
        for per_round in seconds.values():
            per_round.append([])
        for step in range(steps):
            turn = r * steps + step
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                run = runners[name]
                started = time.perf_counter()
                run(1000 * r + step)
                seconds[name][r].append(time.perf_counter() - started)
    return seconds


def round_means(seconds: dict[str, list[list[float]]]) -> dict[str, list[float]]:
    """Mean seconds per step of each runner, one per round."""
    return {name: [statistics.fmean(r) for r in per_round] for name, per_round in seconds.items()}


def plain_twin(name: str, flavour: str = "torch") -> str:
    """The plain-PyTorch run doing the same microbatches as raypipe run `name` ("..._m4" ->
    "plain_torch_m4"; with `flavour="fused"`, "plain_fused_m4")."""
    return f"plain_{flavour}_m{name.rsplit('_m', 1)[1]}"


def paired_ratio(seconds: dict[str, list[list[float]]], base: str, other: str) -> float:
    """Median over all steps of base's step time / other's same step (same round, same
    index): on a machine whose speed drifts, neighbours in time compare more fairly
    than two bests taken minutes apart."""
    return statistics.median(_pairs(seconds, base, other))


def ratio_with_spread(seconds: dict[str, list[list[float]]], base: str, other: str) -> dict:
    """base's step time over other's, pair by pair: the median, the lowest and highest pair, and
    how many pairs (a ratio with a wide spread is noise, whatever its median)."""
    pairs = sorted(_pairs(seconds, base, other))
    return {"median": statistics.median(pairs), "spread": [pairs[0], pairs[-1]], "pairs": len(pairs)}


def _pairs(seconds: dict[str, list[list[float]]], base: str, other: str) -> list[float]:
    return [b / o for rb, ro in zip(seconds[base], seconds[other]) for b, o in zip(rb, ro)]


def match_actor_threads(device: str, threads_per_actor: int = 1) -> None:
    """On a CPU, make this process compute with the torch threads one actor is given, so an
    in-process baseline and a pp = 1 trainer do the same work with the same cores (the
    process's default, every core, made a plain loop look 4x slower or 20x faster beside the
    actors). On a GPU the device does the work and nothing changes."""
    if device == "cpu":
        import torch

        torch.set_num_threads(threads_per_actor)
