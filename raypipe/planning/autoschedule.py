"""Planning a run from its profiled layers (`plan_run`: `partition="profile"` or `schedule="auto"`), and
`schedule="auto"`: the schedule, model chunks and microbatches that minimise the predicted step
time within every device's memory, chosen from the layers profiled on each device kind.

For each microbatch count that divides the sample (from pp up to 8 pp), the layers are timed on
one microbatch of that size on every kind of the run (`raypipe.planning.profiling`); each schedule is then
partitioned for those times (`plan_from_profiles`: per virtual stage, memory checked) and
predicted by running its action lists with the measured durations (`raypipe.schedules.timed`),
plus a fixed engine cost per action. The cheapest candidate wins; every candidate and why the
others lost is printed. The prediction is compared with measured steps in
`tests/parity/test_zero_bubble.py`.

Once the trainer has measured the links between its stages (`raypipe.driver.links.measure`), it
ranks the candidates again from the same profiles with every boundary message timed on its link
(`rank`), and tries more forwards in flight too (`TrainConfig.extra_warmup`, 1F1B-ordered
schedules), which keep a slow link busy while a gradient comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raypipe.config import TrainConfig
from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec, LossFunction
from raypipe.data.batches import split_batch
from raypipe.planning.links import Link, message_seconds
from raypipe.planning.profiling import (
    PlanReport,
    hands_on_early,
    plan_from_profiles,
    profile_layers,
    profiled_plan,
    scheduled_seconds,
    sequence_units_of,
)
from raypipe.schedules import SCHEDULES, SEQUENCE_CHUNKED, Schedule, build_schedule

# What the p2p engine adds to an action beyond its layers' compute on a loaded 2-core machine
# (`benchmarks/pipeline_efficiency.py`: 0.1-0.4 ms); counted along the busiest actor's list.
ACTION_OVERHEAD_S = 3e-4
# The CPU an action costs beyond its layers (the call, its messages, Python), where cores bound
# the step, and what a step costs per stage beyond its actions (the optimizer step, the closing
# agreement, the report, the driver's calls): fitted to the main job's GPT on 2 cores
# (`benchmarks/auto_schedule.py`, docs/BENCHMARKS.md).
ACTION_CPU_S = 5e-4
STEP_OVERHEAD_S = 6e-3
TIE = 1e-3  # predictions this close are a tie, decided by memory
CHUNK_CHOICES = (2,)  # chunks tried for the schedules that let the config choose
SEQUENCE_CHUNK_CHOICES = (1, 2, 4, 8, 16)  # sequence_chunks="auto" tries these ...
MIN_CHUNK_TOKENS = 32  # ... where each chunk keeps at least this many tokens
EXTRA_WARMUP_CHOICES = (0, 1, 2)  # tried where links were measured (without them more only costs memory)


@dataclass
class Candidate:
    schedule: str
    chunks: int | None
    microbatches: int
    step_seconds: float | None  # predicted; None when it cannot run
    why_not: str = ""
    extra_warmup: int = 0
    sequence_chunks: int = 1

    def __str__(self) -> str:
        what = self.schedule + (f" x{self.chunks} chunks" if self.chunks else "") + f", m={self.microbatches}"
        what += f", sequence_chunks={self.sequence_chunks}" if self.sequence_chunks > 1 else ""
        what += f", extra_warmup={self.extra_warmup}" if self.extra_warmup else ""
        return f"{what}: " + (f"{1000 * self.step_seconds:.1f} ms" if self.step_seconds is not None else self.why_not)


@dataclass
class ScheduleChoice:
    """The winner, its plan report, and every candidate considered."""

    chosen: Candidate
    report: PlanReport
    candidates: list[Candidate] = field(default_factory=list)

    def __str__(self) -> str:
        ranked = sorted(self.candidates, key=lambda c: (c.step_seconds is None, c.step_seconds or 0.0))
        what = "schedule=auto" if len({c.schedule for c in self.candidates}) > 1 else "sequence_chunks=auto"
        return "\n".join(
            [f"{what} chose {self.chosen} predicted per step"] + [f"  {c}" for c in ranked] + [str(self.report)]
        )


def microbatch_options(rows: int, pp: int) -> list[int]:
    """Microbatch counts that divide a replica's `rows`, from pp (every stage busy) to 8 pp."""
    options = [m for m in range(pp, 8 * pp + 1) if rows % m == 0]
    return options or [m for m in range(1, rows + 1) if rows % m == 0][-1:]


def predicted_seconds(
    config: TrainConfig, report: PlanReport, links: Mapping[tuple[int, int], Link] | None = None
) -> float:
    """The step `report`'s plan takes under `config`'s schedule: its timed run with the profiled
    durations (each message on its measured link, with `links`), plus `ACTION_OVERHEAD_S` for
    each action of the busiest actor."""
    units = sequence_units_of(config)
    schedule = build_schedule(
        config.schedule, config.pp, config.microbatches, config.chunks, config.extra_warmup, units
    )
    profiles = [report.profiles[k] for k in report.kinds]
    transfer = message_seconds(links, profiles, report.plan, config) if links else None
    early = units == 1 and hands_on_early(config, profiles, schedule)  # a sequence chunk's backward runs whole
    compute = scheduled_seconds(schedule, profiles, report.plan, transfer, early)
    busiest = compute + ACTION_OVERHEAD_S * max(len(actions) for actions in schedule)
    return max(busiest, cores_bound(schedule, profiles, report.plan)) + STEP_OVERHEAD_S * config.pp


def cores_bound(schedule: Schedule, profiles: Sequence[dict[str, Any]], plan: Sequence[tuple[int, int]]) -> float:
    """The least time the step's CPU work takes on the cores its actors share (`shared_cores`,
    profiled on a one-node cluster): every virtual stage's layers' CPU seconds on every
    microbatch, and `ACTION_CPU_S` per action, over those cores; 0 when not known. When there
    are fewer cores than actors computing, this and not the schedule's critical path sets the
    step: the bubble is then time another actor computes in."""
    cores = [p.get("shared_cores") for p in profiles]
    if not cores or any(c is None or "cpu_s" not in p for c, p in zip(cores, profiles)):
        return 0.0
    microbatches = len({a.microbatch for actions in schedule for a in actions})
    work = microbatches * sum(sum(p["cpu_s"][a:b]) for p, (a, b) in zip(profiles, plan))
    return (work + ACTION_CPU_S * sum(len(actions) for actions in schedule)) / min(cores)


def choose(
    specs: Sequence[LayerSpec],
    loss_fn: Callable,
    x: object,
    y: object,
    config: TrainConfig,
    cpus: float,
    split: Callable[[Any, Any, int], tuple[list, list]],
) -> ScheduleChoice:
    """Profiles every microbatch count (the config's under a named schedule) and, under
    `sequence_chunks="auto"`, every sequence chunk count (`sequence_chunk_options`) on it;
    predicts every candidate; returns the cheapest that fits.

    Args:
        x, y: a sample batch of the size training will use.
        split: `(x, y, parts) -> (inputs, targets)`, the trainer's batch splitter.

    Raises:
        ConfigError: no candidate fits (names each one's reason).
    """
    kinds = config.stage_kinds()
    rows = len(split(x, y, config.dp)[0][0]) if config.dp > 1 else _rows(x)
    counts = microbatch_options(rows, config.pp) if config.schedule == "auto" else [config.microbatches]
    profiled: dict[Any, dict[str, dict[str, Any]]] = {}
    for m in counts:
        inputs, targets = split(x, y, config.dp * m)
        # under "auto", each chunk count timed on the microbatch cut in k; else the microbatch as it is
        cuts = sequence_chunk_options(inputs[0]) if config.sequence_chunks == "auto" else [None]
        for k, profiles in profile_layers(specs, loss_fn, inputs[0], targets[0], config, kinds, cpus, cuts).items():
            profiled[m if k is None else (m, k)] = profiles
    return rank(profiled, specs, config)


def sequence_chunk_options(x: object) -> list[int]:
    """The sequence chunk counts `sequence_chunks="auto"` tries on a microbatch `x`: those of
    `SEQUENCE_CHUNK_CHOICES` that leave each chunk `MIN_CHUNK_TOKENS` tokens or more."""
    from raypipe.data.sequence_units import sequence_length

    length = sequence_length(x)
    return [k for k in SEQUENCE_CHUNK_CHOICES if k == 1 or length // k >= MIN_CHUNK_TOKENS]


def rank(
    profiled: dict[int, dict[str, dict[str, object]]],
    specs: Sequence[LayerSpec],
    config: TrainConfig,
    links: Mapping[tuple[int, int], Link] | None = None,
) -> ScheduleChoice:
    """Every candidate predicted from the profiles of each microbatch count (`profiled`: keyed by
    it, or by (it, sequence chunks) under `sequence_chunks="auto"`), with each boundary message
    timed on its measured link where `links` are given; the cheapest wins. Under a named schedule
    only it is tried.

    Raises:
        ConfigError: no candidate fits (names each one's reason).
    """
    kinds = config.stage_kinds()
    candidates: list[Candidate] = []
    best: tuple[float, Candidate, PlanReport] | None = None
    names = [n for n in SCHEDULES if config.schedule in ("auto", n)]
    warmups = (0,) if config.schedule == "auto" else (config.extra_warmup or 0,)
    for key, profiles in profiled.items():
        m, k = key if isinstance(key, tuple) else (key, None)
        # a layer that cannot run on sequence chunks (the profiler's answer, `check_chunkable`'s words)
        refused = next(
            (p["refused"].split(": ", 1)[-1].split(". Use ")[0] for p in profiles.values() if "refused" in p), None
        )
        for name in names if k in (None, 1) else [n for n in names if n in SEQUENCE_CHUNKED]:
            kind = SCHEDULES[name]
            for chunks in CHUNK_CHOICES if kind.chunks is None else (None,):
                for extra in EXTRA_WARMUP_CHOICES if links and kind.extra_warmup else warmups:
                    candidate = Candidate(name, chunks, m, None, extra_warmup=extra, sequence_chunks=k or 1)
                    candidates.append(candidate)
                    if refused is not None:
                        candidate.why_not = refused
                        continue
                    try:
                        cfg = config.replace(
                            schedule=name,
                            chunks=chunks,
                            microbatches=m,
                            extra_warmup=extra,
                            sequence_chunks=k or 1,
                            partition="profile",
                            shard_plan=None,
                        )
                        if len(specs) < config.pp * cfg.num_chunks():
                            raise ConfigError(
                                f"{len(specs)} layers, fewer than its {config.pp * cfg.num_chunks()} chunks"
                            )
                        report = plan_from_profiles(profiles, kinds, cfg, links)
                    except ConfigError as error:
                        candidate.why_not = str(error).split(":")[0] if "layers" not in str(error) else str(error)
                        continue
                    candidate.step_seconds = predicted_seconds(cfg, report, links)
                    if best is None or _better(candidate.step_seconds, report, best[0], best[2]):
                        best = (candidate.step_seconds, candidate, report)
    if best is None:
        raise ConfigError("'auto' found no schedule that fits: " + "; ".join(str(c) for c in candidates))
    best[2].profiled_microbatches = profiled
    chosen = best[1]
    best[2].unchunked_fits = any(
        c.step_seconds is not None and c.sequence_chunks == 1 and c.microbatches == chosen.microbatches
        for c in candidates
    )
    return ScheduleChoice(chosen, best[2], candidates)


def _better(seconds: float, report: PlanReport, best_seconds: float, best: PlanReport) -> bool:
    """Whether a candidate beats the best so far: faster by more than `TIE`, or as fast and
    lighter on its fullest device (GPipe and 1F1B tie where the cores, not the schedule, set the
    step: 1F1B, stashing fewer microbatches, then wins)."""
    if seconds < best_seconds * (1 - TIE):
        return True
    return seconds <= best_seconds * (1 + TIE) and max(report.stage_memory_bytes) < max(best.stage_memory_bytes)


def _rows(x: object) -> int:
    import torch.utils._pytree as pytree

    return next(t.shape[0] for t in pytree.tree_leaves(x) if hasattr(t, "shape"))


def plan_run(
    specs: Sequence[LayerSpec],
    loss_fn: LossFunction,
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

    def split(x: object, y: object, parts: int) -> tuple[list, list]:
        return split_batch(x, y, parts, config.dp, max(1, parts // config.dp))

    if config.schedule == "auto" or config.sequence_chunks == "auto":
        choice = choose(specs, loss_fn, *sample, config, cpus, split)
        log(str(choice))
        return chosen_config(config, choice.chosen), choice.report
    inputs, targets = split(*sample, config.dp * config.microbatches)
    report = profiled_plan(specs, loss_fn, inputs[0], targets[0], config, cpus)
    log(str(report))
    return config, report


def chosen_config(config: TrainConfig, chosen: Candidate) -> TrainConfig:
    """`config` with the candidate's schedule, chunks, microbatches, warm-up and sequence chunks."""
    return config.replace(
        schedule=chosen.schedule,
        chunks=chosen.chunks,
        microbatches=chosen.microbatches,
        extra_warmup=chosen.extra_warmup,
        sequence_chunks=chosen.sequence_chunks,
    )


def plan_for_links(
    asked: TrainConfig,
    running: TrainConfig,
    report: PlanReport,
    specs: Sequence[LayerSpec],
    links: Mapping[tuple[int, int], Link],
) -> tuple[TrainConfig, PlanReport, float, float, str]:
    """The plan for the measured `links`, from the profiles the link-blind plan `report` was made
    from (no profiling again): under `asked.schedule == "auto"` the schedule, chunks, microbatches
    and extra warm-up too; else the split alone.

    Returns:
        (the config to run, its plan report, the predicted step on these links of the link-blind
        plan and of this one, the planner's account in words).
    """
    blind = predicted_seconds(running, report, links)
    if asked.schedule == "auto" or asked.sequence_chunks == "auto":
        choice = rank(report.profiled_microbatches, specs, asked, links)
        c = choice.chosen
        return chosen_config(running, c), choice.report, blind, c.step_seconds or 0.0, str(choice)
    new = plan_from_profiles(report.profiles, running.stage_kinds(), running, links)
    return running, new, blind, predicted_seconds(running, new, links), str(new)
