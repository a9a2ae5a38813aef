"""Speed-aware partitioning: profile every layer on each device kind, then split exactly.

`partition="profile"` makes each accelerator kind in the run measure every layer's
forward+backward time and memory on a real microbatch (one `LayerProfiler` actor
per kind, placed like that kind's stages). The plan is then the contiguous split
minimising the slowest stage's time, each stage timed on its own kind, among the
splits whose estimated memory fits each stage's device (`speed_aware_plan`).

The memory estimate per stage: parameters x (1 + 1 gradient + optimizer slots) +
saved activations per microbatch x the microbatches that stage keeps in flight
under the schedule (all m for GPipe, p - s for 1F1B), against 90 % of the device's
memory (times `gpus_per_actor` for a shared GPU; for cpu stages, the node's RAM
shared by the run's cpu stages). With tp > 1 layers are profiled whole, so the
estimate is high by up to the tp factor: a safe error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from raypipe.config import TrainConfig
from raypipe.devices import ray_options
from raypipe.errors import PlacementError, StageError
from raypipe.layers import LayerSpec
from raypipe.partition import Plan, speed_aware_plan, uniform_plan

MEMORY_HEADROOM = 0.9


@dataclass
class PlanReport:
    """A speed-aware plan and what it predicts.

    Attributes:
        plan: [start, end) layers per stage.
        kinds: each stage's accelerator kind.
        stage_seconds: predicted forward+backward seconds of one microbatch per stage.
        stage_memory_bytes, capacity_bytes: the estimate and the budget per stage.
        step_seconds: predicted step time: each stage once (the first microbatch's way
            through and the last one's way back) plus m - 1 more of the slowest stage;
            (m + p - 1) x the stage time when the stages are balanced.
        uniform_step_seconds: the same prediction for the uniform split, for comparison.
        profiles: the per-layer measurements of each kind (see `LayerProfiler.profile`).
    """

    plan: Plan
    kinds: list[str]
    stage_seconds: list[float]
    stage_memory_bytes: list[float]
    capacity_bytes: list[float]
    step_seconds: float
    uniform_step_seconds: float
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"speed-aware plan (partition=profile): predicted step {1000 * self.step_seconds:.1f} ms, "
                 f"uniform split {1000 * self.uniform_step_seconds:.1f} ms"]
        for s, ((a, b), kind) in enumerate(zip(self.plan, self.kinds)):
            profile = self.profiles[kind]
            where = f"{kind} ({profile['model']}{', cpu fallback' if profile['cpu_fallback'] else ''})"
            lines.append(
                f"stage {s}: layers [{a}, {b}) on {where}: {1000 * self.stage_seconds[s]:.2f} ms per microbatch, "
                f"~{self.stage_memory_bytes[s] / 2**20:,.0f} of {self.capacity_bytes[s] / 2**20:,.0f} MiB"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": [list(r) for r in self.plan], "kinds": self.kinds, "stage_seconds": self.stage_seconds,
            "stage_memory_bytes": self.stage_memory_bytes, "capacity_bytes": self.capacity_bytes,
            "step_seconds": self.step_seconds, "uniform_step_seconds": self.uniform_step_seconds,
            "profiles": self.profiles,
        }


def profile_layers(
    specs: Sequence[LayerSpec],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    x: torch.Tensor,
    target: Any,
    config: TrainConfig,
    kinds: Sequence[str],
    threads: int = 1,
    cpus: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """Per accelerator kind in `kinds`, each layer's times and bytes on one microbatch `(x, target)`."""
    import ray

    from raypipe.actors.profiler import LayerProfiler

    remote = ray.remote(LayerProfiler)
    unique = list(dict.fromkeys(kinds))
    actors = [
        remote.options(num_cpus=cpus, max_restarts=0, **ray_options(k, config.gpus_per_actor))
        .remote(k, config.allow_cpu_fallback, threads)
        for k in unique
    ]
    try:
        refs = [a.profile.remote(list(specs), config.seed, x, target, loss_fn) for a in actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=config.actor_start_timeout + config.step_timeout)
        if pending:
            missing = [unique[refs.index(r)] for r in pending]
            raise PlacementError(
                f"partition='profile': the profilers for {missing} did not finish within "
                f"{config.actor_start_timeout + config.step_timeout:.0f} s (actor_start_timeout + step_timeout); "
                f"check that the cluster has nodes of those kinds (`ray status`)."
            )
        try:
            return dict(zip(unique, ray.get(refs)))
        except ray.exceptions.RayTaskError as error:
            raise StageError(f"partition='profile' failed while profiling layers: {error}") from None
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def profiled_plan(
    specs: Sequence[LayerSpec],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    x: torch.Tensor,
    target: Any,
    config: TrainConfig,
    cpus: float,
) -> PlanReport:
    """Profiles the layers on one microbatch `(x, target)` on every device kind of `config`'s
    stages (actors reserving `cpus` each, threads as a stage would use) and plans by the times."""
    kinds = config.stage_kinds()
    threads = config.threads_per_actor or max(1, int(cpus))
    return plan_from_profiles(profile_layers(specs, loss_fn, x, target, config, kinds, threads, cpus), kinds, config)


def plan_from_profiles(
    profiles: dict[str, dict[str, Any]], kinds: Sequence[str], config: TrainConfig
) -> PlanReport:
    """The exact speed-aware plan for stages of `kinds`, and its predictions."""
    p, m = len(kinds), config.microbatches
    times = [[f + b for f, b in zip(profiles[k]["forward_s"], profiles[k]["backward_s"])] for k in kinds]
    states = 2 + _optimizer_slots(config.optimizer) / (config.dp if config.zero else 1)
    in_flight = [m if config.schedule == "gpipe" else min(m, p - s) for s in range(p)]
    cpu_stages = max(1, sum(k == "cpu" for k in kinds))
    capacity = [
        MEMORY_HEADROOM * profiles[k]["memory_bytes"] * (1 / cpu_stages if k == "cpu" else min(1.0, config.gpus_per_actor))
        for k in kinds
    ]

    def memory(s: int, a: int, b: int) -> float:
        prof = profiles[kinds[s]]
        return sum(prof["parameter_bytes"][a:b]) * states + sum(prof["activation_bytes"][a:b]) * in_flight[s]

    plan = speed_aware_plan(times, lambda s, a, b: memory(s, a, b) <= capacity[s])
    stage_seconds = [sum(times[s][a:b]) for s, (a, b) in enumerate(plan)]
    uniform = uniform_plan(len(times[0]), p)
    return PlanReport(
        plan=plan,
        kinds=list(kinds),
        stage_seconds=stage_seconds,
        stage_memory_bytes=[memory(s, a, b) for s, (a, b) in enumerate(plan)],
        capacity_bytes=capacity,
        step_seconds=pipeline_seconds(stage_seconds, m),
        uniform_step_seconds=pipeline_seconds([sum(times[s][a:b]) for s, (a, b) in enumerate(uniform)], m),
        profiles=profiles,
    )


def pipeline_seconds(stage_seconds: Sequence[float], microbatches: int) -> float:
    """The step time a pipeline with these per-microbatch stage times (forward + backward) needs
    at best: the critical path through every stage once, plus m - 1 microbatches of the slowest."""
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


def _optimizer_slots(optimizer: dict) -> int:
    """Per-element optimizer state tensors per parameter (Adam: 2 moments; SGD: momentum or none)."""
    if optimizer["name"] in ("adam", "adamw"):
        return 2
    return 1 if optimizer.get("momentum", 0) else 0

