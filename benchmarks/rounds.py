"""Timing several runs side by side: warm each up, then interleave them round by round, so
background load on the machine hits them alike. Used by gpt_cpu.py and gpt_gpu.py."""

from __future__ import annotations

import time
import statistics
from typing import Callable


def interleaved(runners: dict[str, Callable[[int], None]], rounds: int, steps: int,
                warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per step of each runner (`run(step)`), one mean per round."""
    for run in runners.values():  # first steps pay for allocation, imports, autotuning
        for step in range(warmup):
            run(step)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, run in runners.items():
            started = time.perf_counter()
            for step in range(steps):
                run(1000 * r + step)
            seconds[name].append((time.perf_counter() - started) / steps)
    return seconds


def plain_twin(name: str) -> str:
    """The plain-PyTorch run doing the same microbatches as raypipe run `name` ("..._m4" -> "plain_torch_m4")."""
    return f"plain_torch_m{name.rsplit('_m', 1)[1]}"


def paired_ratio(seconds: dict[str, list[float]], base: str, other: str) -> float:
    """Median over rounds of base's step time / other's in the same round: on a machine whose
    speed drifts, neighbours in time compare more fairly than two bests taken minutes apart."""
    return statistics.median(b / o for b, o in zip(seconds[base], seconds[other]))
