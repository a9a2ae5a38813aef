"""Shard plans: which contiguous range of layers each pipeline stage holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from raypipe.core.errors import ConfigError

if TYPE_CHECKING:
    from raypipe.config import TrainConfig

Plan = list[tuple[int, int]]


def uniform_plan(num_layers: int, num_stages: int) -> Plan:
    """Layer counts that differ by at most one; the later stages take the extra layers.

    Later stages hold fewer microbatches in flight under 1F1B, so they are the
    cheaper place for the extra activations.
    """
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    return _ranges(sizes)


def balanced_plan(weights: Sequence[float], num_stages: int) -> Plan:
    """Contiguous non-empty ranges minimising the heaviest stage's total weight.

    Exact dynamic programming (O(n^2 p)); ties go to the plan whose earlier stages
    are lighter.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[s][i]: min over splits of layers [0, i) into s stages of the heaviest stage
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def speed_aware_plan(
    times: Sequence[Sequence[float]],
    fits: Callable[[int, int, int], bool] | None = None,
    boundary: Callable[[int, int], float] | None = None,
) -> Plan:
    """Contiguous non-empty ranges minimising the slowest stage, each stage at its own speed.

    `times[s][i]` is layer i's forward+backward time on stage s's device, so a slow
    device gets fewer layers; `fits(s, start, end)` says whether layers [start, end)
    fit stage s's memory; `boundary(s, end)`, a microbatch's time on the link after stage s
    when it ends before layer `end` (the link is a stage of the pipeline too, so a slow one
    moves the split to where activations are small). Exact dynamic programming (O(p n^2))
    over the prefix a stage ends at; among plans with the same slowest stage, the one whose
    earlier stages are lighter wins.

    Raises:
        ConfigError: no split fits every stage's memory.
    """
    p, n = len(times), len(times[0])
    prefix = []
    for row in times:
        acc = [0.0]
        for t in row:
            acc.append(acc[-1] + float(t))
        prefix.append(acc)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        for i in range(s, n - (p - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf or (fits is not None and not fits(s - 1, j, i)):
                    continue
                cost = max(best[s - 1][j], prefix[s - 1][i] - prefix[s - 1][j])
                if boundary is not None and s < p:
                    cost = max(cost, boundary(s - 1, i))
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    if best[p][n] == inf:
        raise ConfigError(
            f"no split of {n} layers into pp={p} stages fits every stage's device memory: use more "
            f"stages (pp), devices with more memory, activation_checkpointing=True, fewer microbatches "
            f"in flight (schedule='1f1b'), or a smaller gpus_per_actor share per device."
        )
    bounds = [n]
    for s in range(p, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [(bounds[s], bounds[s + 1]) for s in range(p)]


def check_plan(plan: Sequence[Sequence[int]], num_layers: int, num_stages: int) -> Plan:
    """Checks an explicit plan covers layers 0..n-1 once, in order, every stage non-empty.

    Raises:
        ConfigError: naming the broken range and how to fix it.
    """

    def fail(problem: str) -> ConfigError:
        return ConfigError(
            f"TrainConfig.shard_plan={[list(r) for r in plan]!r} is invalid: {problem}. "
            f"Give {num_stages} contiguous [start, end) ranges covering layers 0..{num_layers - 1}, "
            f"e.g. {[list(r) for r in uniform_plan(num_layers, num_stages)] if num_layers >= num_stages else '[[0, n)]'}."  # noqa: E501
        )

    if len(plan) != num_stages:
        raise fail(f"it has {len(plan)} ranges for pp={num_stages}")
    if num_layers < num_stages:
        raise fail(f"the model has {num_layers} layers, fewer than pp={num_stages} stages")
    expected_start = 0
    for s, (start, end) in enumerate(plan):
        if end <= start:
            raise fail(f"stage {s} range [{start}, {end}) is empty")
        if start < expected_start:
            raise fail(f"stage {s} starts at {start}, overlapping the previous stage (which ends at {expected_start})")
        if start > expected_start:
            raise fail(f"layers {expected_start}..{start - 1} belong to no stage (gap before stage {s})")
        if end > num_layers:
            raise fail(f"stage {s} ends at {end}, past the last layer ({num_layers - 1})")
        expected_start = end
    if expected_start != num_layers:
        raise fail(f"layers {expected_start}..{num_layers - 1} belong to no stage")
    return [(int(a), int(b)) for a, b in plan]


def make_plan(
    num_layers: int,
    num_stages: int,
    partition: str = "uniform",
    shard_plan: Sequence[Sequence[int]] | None = None,
    parameter_counts: Sequence[int] | None = None,
    chunks: int = 1,
    schedule: str = "",
) -> Plan:
    """The plan a config asks for: the explicit one, or one computed by `partition`. `num_stages`
    counts virtual stages: pp x `chunks` (the model chunks each actor holds under `schedule`)."""
    if shard_plan is not None:
        return check_plan(shard_plan, num_layers, num_stages)
    if num_layers < num_stages and chunks > 1:
        pp = num_stages // chunks
        raise ConfigError(
            f"TrainConfig.pp={pp} is invalid with schedule={schedule!r}: it gives each stage {chunks} model chunks, "
            f"{num_stages} in all, but the model has only {num_layers} layers. Use pp <= {num_layers // chunks}, or "
            f"a schedule of one chunk per stage (1f1b, gpipe, zb-h1)."
        )
    if num_layers < num_stages:
        raise ConfigError(
            f"TrainConfig.pp={num_stages} is invalid: the model has only {num_layers} layers; use pp <= {num_layers}."
        )
    if partition == "parameters":
        if parameter_counts is None:
            raise ValueError("partition='parameters' needs parameter_counts")
        return balanced_plan(parameter_counts, num_stages)
    return uniform_plan(num_layers, num_stages)


def _ranges(sizes: Sequence[int]) -> Plan:
    plan, start = [], 0
    for size in sizes:
        plan.append((start, start + size))
        start += size
    return plan


def is_profiled(config: TrainConfig) -> bool:
    """Whether a `TrainConfig` plans from profiled layers (`partition="profile"`, `schedule="auto"`
    or `sequence_chunks="auto"`, with no explicit `shard_plan`), which needs a sample batch."""
    planned = config.partition == "profile" or "auto" in (config.schedule, config.sequence_chunks)
    return planned and config.shard_plan is None


def first_plan(specs: Sequence[Any], config: TrainConfig, has_sample: bool) -> tuple[Plan, list[bool | None], bool]:
    """A trainer's plan before any actor starts, checked against the layers and tp.

    Returns:
        (the plan, which layers have a tp plan, whether partition="profile" will replace the
        plan once the profilers ran; until then the plan is uniform, to check pp).

    Raises:
        ConfigError: no sample for a profiled plan, a plan that does not fit the layers, a tp
            that does not split them, or a stage whose layers have no tp plan.
    """
    from raypipe.core.layers import parameter_counts
    from raypipe.nn.moe import check_expert_parallel
    from raypipe.nn.plan import check_stages_split, check_tensor_parallel

    profiled = is_profiled(config)
    if profiled and not has_sample:
        autos = [f"{name}='auto'" for name in ("schedule", "sequence_chunks") if getattr(config, name) == "auto"]
        what = autos[0] if autos else "partition='profile'"
        raise ConfigError(
            f"TrainConfig.{what} needs a sample batch to time the layers on: pass "
            "Trainer(..., sample=(x, y)) with a batch like those you will train on, or use "
            "partition='uniform' or 'parameters'."
        )
    counts = parameter_counts(specs) if config.partition == "parameters" and config.shard_plan is None else None
    # one range per virtual stage: with model chunks (interleaved-1f1b, zb-v) pp x chunks of them
    plan = make_plan(
        len(specs),
        config.pp * config.num_chunks(),
        "uniform" if profiled else config.partition,
        config.shard_plan,
        counts,
        config.num_chunks(),
        config.schedule,
    )
    tp_splits = check_tensor_parallel(specs, config.tp)
    check_expert_parallel(specs, config.ep)
    if not profiled:
        check_stages_split(tp_splits, plan, config.tp)
    return plan, tp_splits, profiled
