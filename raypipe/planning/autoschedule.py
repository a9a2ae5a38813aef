"""Planning a run from its profiled layers (`plan_run`: `partition="profile"` or `schedule="auto"`), and
`schedule="auto"`: the schedule, model chunks and microbatches that minimise the predicted step
time within every device's memory, chosen from the layers profiled on each device kind.

For each microbatch count that divides the sample (from pp up to 8 pp), the layers are timed on
one microbatch of that size on every kind of the run (`raypipe.planning.profiling`); each schedule is then
partitioned for those times (`plan_from_profiles`: per virtual stage, memory checked) and
predicted by running its action lists with the measured durations (`raypipe.schedules.timed`),
plus a fixed engine cost per action. The cheapest candidate wins; every candidate and why the
others lost is printed. The prediction is compared with measured steps in
`tests/test_zero_bubble.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raypipe.config import TrainConfig
from raypipe.data.batches import split_batch
from raypipe.errors import ConfigError
from raypipe.layers import LayerSpec
from raypipe.planning.profiling import PlanReport, plan_from_profiles, profile_layers, profiled_plan, scheduled_seconds
from raypipe.schedules import SCHEDULES, build_schedule

# What the p2p engine adds to an action beyond its layers' compute on a loaded 2-core machine
# (`benchmarks/pipeline_efficiency.py`: 0.1-0.4 ms); counted along the busiest actor's list.
ACTION_OVERHEAD_S = 3e-4
CHUNK_CHOICES = (2,)  # chunks tried for the schedules that let the config choose


@dataclass
class Candidate:
    schedule: str
    chunks: int | None
    microbatches: int
    step_seconds: float | None  # predicted; None when it cannot run
    why_not: str = ""

    def __str__(self) -> str:
        what = self.schedule + (f" x{self.chunks} chunks" if self.chunks else "") + f", m={self.microbatches}"
        return f"{what}: " + (f"{1000 * self.step_seconds:.1f} ms" if self.step_seconds is not None else self.why_not)


@dataclass
class ScheduleChoice:
    """The winner, its plan report, and every candidate considered."""

    chosen: Candidate
    report: PlanReport
    candidates: list[Candidate] = field(default_factory=list)

    def __str__(self) -> str:
        ranked = sorted(self.candidates, key=lambda c: (c.step_seconds is None, c.step_seconds or 0.0))
        return "\n".join(
            [f"schedule=auto chose {self.chosen} predicted per step"] + [f"  {c}" for c in ranked] + [str(self.report)]
        )


def microbatch_options(rows: int, pp: int) -> list[int]:
    """Microbatch counts that divide a replica's `rows`, from pp (every stage busy) to 8 pp."""
    options = [m for m in range(pp, 8 * pp + 1) if rows % m == 0]
    return options or [m for m in range(1, rows + 1) if rows % m == 0][-1:]


def predicted_seconds(config: TrainConfig, report: PlanReport) -> float:
    """The step `report`'s plan takes under `config`'s schedule: its timed run with the profiled
    durations, plus `ACTION_OVERHEAD_S` for each action of the busiest actor."""
    schedule = build_schedule(config.schedule, config.pp, config.microbatches, config.chunks, config.extra_warmup)
    compute = scheduled_seconds(schedule, [report.profiles[k] for k in report.kinds], report.plan)
    return compute + ACTION_OVERHEAD_S * max(len(actions) for actions in schedule)


def choose(
    specs: Sequence[LayerSpec],
    loss_fn: Callable,
    x: Any,
    y: Any,
    config: TrainConfig,
    cpus: float,
    split: Callable[[Any, Any, int], tuple[list, list]],
) -> ScheduleChoice:
    """Profiles and predicts every candidate; returns the cheapest that fits.

    Args:
        x, y: a sample batch of the size training will use.
        split: `(x, y, parts) -> (inputs, targets)`, the trainer's batch splitter.

    Raises:
        ConfigError: no candidate fits (names each one's reason).
    """
    kinds = config.stage_kinds()
    rows = len(split(x, y, config.dp)[0][0]) if config.dp > 1 else _rows(x)
    candidates: list[Candidate] = []
    best: tuple[float, Candidate, PlanReport] | None = None
    for m in microbatch_options(rows, config.pp):
        inputs, targets = split(x, y, config.dp * m)
        profiles = profile_layers(specs, loss_fn, inputs[0], targets[0], config, kinds, cpus)
        for name, kind in SCHEDULES.items():
            for chunks in CHUNK_CHOICES if kind.chunks is None else (None,):
                candidate = Candidate(name, chunks, m, None)
                candidates.append(candidate)
                try:
                    cfg = config.replace(
                        schedule=name, chunks=chunks, microbatches=m, partition="profile", shard_plan=None
                    )
                    if len(specs) < config.pp * cfg.num_chunks():
                        raise ConfigError(f"{len(specs)} layers, fewer than its {config.pp * cfg.num_chunks()} chunks")
                    report = plan_from_profiles(profiles, kinds, cfg)
                except ConfigError as error:
                    candidate.why_not = str(error).split(":")[0] if "layers" not in str(error) else str(error)
                    continue
                candidate.step_seconds = predicted_seconds(cfg, report)
                if best is None or candidate.step_seconds < best[0]:
                    best = (candidate.step_seconds, candidate, report)
    if best is None:
        raise ConfigError("schedule='auto' found no schedule that fits: " + "; ".join(str(c) for c in candidates))
    return ScheduleChoice(best[1], best[2], candidates)


def _rows(x: Any) -> int:
    import torch.utils._pytree as pytree

    return next(t.shape[0] for t in pytree.tree_leaves(x) if hasattr(t, "shape"))


def plan_run(
    specs: Sequence[LayerSpec],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    sample: tuple,
    config: TrainConfig,
    cpus: float,
    log: Callable[[str], None],
) -> tuple[TrainConfig, PlanReport]:
    """The profiled plan of a run (`partition="profile"`), or with `schedule="auto"` the chosen
    schedule, chunks and microbatches too (`raypipe.planning.autoschedule`); logs what it found.

    Returns:
        (the config, with the chosen schedule under "auto"; the plan report).
    """

    def split(x: Any, y: Any, parts: int) -> tuple[list, list]:
        return split_batch(x, y, parts, config.dp, max(1, parts // config.dp))

    if config.schedule == "auto":
        choice = choose(specs, loss_fn, *sample, config, cpus, split)
        log(str(choice))
        chosen = choice.chosen
        return config.replace(
            schedule=chosen.schedule, chunks=chosen.chunks, microbatches=chosen.microbatches
        ), choice.report
    inputs, targets = split(*sample, config.dp * config.microbatches)
    report = profiled_plan(specs, loss_fn, inputs[0], targets[0], config, cpus)
    log(str(report))
    return config, report
