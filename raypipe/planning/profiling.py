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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from raypipe.config import TrainConfig
from raypipe.config.engines import engine_kind
from raypipe.core.devices import ray_options
from raypipe.core.env import gradient_hand_on
from raypipe.core.errors import PlacementError, StageError
from raypipe.core.layers import LayerSpec, LossFunction
from raypipe.data.sequence_units import cut_microbatch
from raypipe.planning.links import Link, boundary_bytes, message_seconds
from raypipe.planning.partition import Plan, speed_aware_plan, uniform_plan
from raypipe.planning.threads import fitting_threads, node_cpus, packed_on_node
from raypipe.schedules import SCHEDULES, Action, Schedule
from raypipe.schedules.early_gradients import early_is_faster, hand_on_mode

if TYPE_CHECKING:
    import ray
    from ray.actor import ActorHandle

MEMORY_HEADROOM = 0.9


@dataclass
class PlanReport:
    """A speed-aware plan and what it predicts.

    Attributes:
        plan: [start, end) layers per stage (per virtual stage, with model chunks).
        kinds: each stage's accelerator kind.
        stages: with model chunks, the stage (actor) holding each virtual stage.
        stage_seconds: predicted forward+backward seconds of one microbatch per stage.
        stage_memory_bytes, capacity_bytes: the estimate and the budget per stage.
        step_seconds: predicted step time: each stage once (the first microbatch's way
            through and the last one's way back) plus m - 1 more of the slowest stage;
            (m + p - 1) x the stage time when the stages are balanced.
        uniform_step_seconds: the same prediction for the uniform split, for comparison.
        profiles: the per-layer measurements of each kind (see `LayerProfiler.profile`).
        link_wire: the measured links the plan was made for (`raypipe.planning.links`), each with
            the seconds its boundary messages take on it per step (its share of the step is
            this over `step_seconds`); empty when no link was measured.
        profiled_microbatches: under schedule="auto", every microbatch count's profiles (to plan
            again once the links are measured, without profiling again); not in `to_dict`.
        unchunked_fits: under sequence_chunks="auto", whether the chosen plan fits every device's
            memory with its microbatches uncut (what `driver.run.chunk_trial` may run them as).
    """

    plan: Plan
    kinds: list[str]
    stage_seconds: list[float]
    stage_memory_bytes: list[float]
    capacity_bytes: list[float]
    step_seconds: float
    uniform_step_seconds: float
    profiles: dict[str, dict[str, object]] = field(default_factory=dict)
    stages: list[int] = field(default_factory=list)
    link_wire: list[tuple[Link, float]] = field(default_factory=list)
    profiled_microbatches: dict[int, dict[str, dict[str, object]]] = field(default_factory=dict)
    unchunked_fits: bool = True

    def __str__(self) -> str:
        uniform = self.plan == uniform_plan(self.plan[-1][1], len(self.plan))
        how = "the uniform split, which the profiles find fastest" if uniform else "layers split by their cost"
        lines = [
            f"speed-aware plan from profiled layers ({how}): predicted step {1000 * self.step_seconds:.1f} ms, "
            f"uniform split {1000 * self.uniform_step_seconds:.1f} ms"
        ]
        chunked = bool(self.stages)
        for s, ((a, b), kind) in enumerate(zip(self.plan, self.kinds)):
            profile = self.profiles[kind]
            where = f"{kind} ({profile['model']}{', cpu fallback' if profile['cpu_fallback'] else ''})"
            name = f"virtual stage {s} (stage {self.stages[s]})" if chunked else f"stage {s}"
            lines.append(
                f"{name}: layers [{a}, {b}) on {where}: {1000 * self.stage_seconds[s]:.2f} ms per microbatch, "
                f"~{self.stage_memory_bytes[s] / 2**20:,.0f} of {self.capacity_bytes[s] / 2**20:,.0f} MiB"
            )
        for link, wire in self.link_wire:
            lines.append(
                f"{link}: {1000 * wire:.1f} ms of messages per step, {wire / self.step_seconds:.0%} of the step"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {
            "plan": [list(r) for r in self.plan],
            "kinds": self.kinds,
            "stage_seconds": self.stage_seconds,
            "stage_memory_bytes": self.stage_memory_bytes,
            "capacity_bytes": self.capacity_bytes,
            "step_seconds": self.step_seconds,
            "uniform_step_seconds": self.uniform_step_seconds,
            "profiles": self.profiles,
            "stages": self.stages,
            "links": [
                {**link.to_dict(), "wire_seconds": wire, "share_of_step": wire / self.step_seconds}
                for link, wire in self.link_wire
            ],
        }


def profile_layers(
    specs: Sequence[LayerSpec],
    loss_fn: LossFunction,
    x: torch.Tensor,
    target: object,
    config: TrainConfig,
    kinds: Sequence[str],
    cpus: float = 1.0,
    counts: Sequence[int | None] = (None,),
) -> dict[int | None, dict[str, dict[str, object]]]:
    """Per sequence chunk count in `counts` (None: the microbatch as it is; `sequence_chunks="auto"`
    tries several, by the same profilers), per accelerator kind in `kinds` (each stage's), each
    layer's times and bytes on one microbatch `(x, target)` (with a count k, per unit of it cut in k
    along the sequence: `LayerProfiler.profile`), timed with the threads a stage of that kind will
    get (`raypipe.planning.threads`: its node's CPUs shared among the stages that pack there). On a
    cluster of one node, each CPU profile also says how many of its cores one pipeline replica's
    actors share (`shared_cores`: the cores over dp x tp), which bounds a step from below. Where a
    layer cannot run on sequence chunks (`sequence_chunks.check_chunkable`), a count above 1 is
    answered with why (`refused`): "auto" then keeps the sequence whole, and says why."""
    import ray

    from raypipe.actors.profiler import LayerProfiler

    remote = ray.remote(LayerProfiler)
    unique = list(dict.fromkeys(kinds))
    actors = [
        remote.options(num_cpus=cpus, max_restarts=0, **ray_options(k, config.gpus_per_actor)).remote(
            k, config.allow_cpu_fallback
        )
        for k in unique
    ]
    try:
        asked = [a.cores.remote() for a in actors]  # asked with the nodes: one wait for both
        nodes = _wait(actors, [a.node_id.remote() for a in actors], unique, config.actor_start_timeout, "placed")
        cores = _wait(actors, asked, unique, config.actor_start_timeout, "placed")
        cpus_of = node_cpus()
        stages_of_kind = {k: kinds.count(k) * config.dp * config.tp for k in unique}
        threads = [
            config.threads_per_actor
            or fitting_threads(cpus_of.get(n, 1.0), packed_on_node(cpus_of.get(n, 1.0), cpus, stages_of_kind[k]), c)
            for n, k, c in zip(nodes, unique, cores)
        ]
        codecs = (config.compress_activations, config.compress_gradients)
        split = config.schedule == "auto" or SCHEDULES[config.schedule].split_backward  # I and W timed apart
        by_count = {}
        for count in counts:
            inputs, targets, extra = x, target, {"codecs": codecs, "split": split, "lora": config.lora}
            if count is not None:  # the microbatch's units, timed as a stage runs them
                inputs, targets, _ = cut_microbatch(x, target, count, loss_fn)
                extra = {"lora": config.lora, "sequence_chunks": count, "warmup": 1, "repeats": 3, "split": split}
            refs = [
                a.profile.remote(list(specs), config.seed, inputs, targets, loss_fn, t, **extra)
                for a, t in zip(actors, threads)
            ]
            profiles = dict(zip(unique, _wait(actors, refs, unique, config.step_timeout, "finished")))
            if len(cpus_of) == 1:  # one node: a pipeline's actors share its cores with the other replicas'
                for profile in profiles.values():
                    if "cpu_s" in profile:
                        profile["shared_cores"] = profile["cores"] / (config.dp * config.tp)
            by_count[count] = profiles
        return by_count
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _wait(
    actors: list[ActorHandle], refs: list[ray.ObjectRef], kinds: list[str], timeout: float, what: str
) -> list[Any]:
    """The profilers' answers to `refs`, or an error naming the kinds whose profiler did not answer."""
    import ray

    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        missing = [kinds[refs.index(r)] for r in pending]
        raise PlacementError(
            f"partition='profile': the profilers for {missing} were not {what} within {timeout:.0f} s "
            f"({'actor_start_timeout' if what == 'placed' else 'step_timeout'}); "
            f"check that the cluster has nodes of those kinds (`ray status`)."
        )
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        raise StageError(f"partition='profile' failed while profiling layers: {error}") from None


def profiled_plan(
    specs: Sequence[LayerSpec],
    loss_fn: LossFunction,
    x: torch.Tensor,
    target: object,
    config: TrainConfig,
    cpus: float,
) -> PlanReport:
    """Profiles the layers on one microbatch `(x, target)` on every device kind of `config`'s
    stages (actors reserving `cpus` each, threads as a stage will get) and plans by the times."""
    kinds = config.stage_kinds()
    return plan_from_profiles(profile_layers(specs, loss_fn, x, target, config, kinds, cpus)[None], kinds, config)


def plan_from_profiles(
    profiles: dict[str, dict[str, Any]],
    kinds: Sequence[str],
    config: TrainConfig,
    links: Mapping[tuple[int, int], Link] | None = None,
) -> PlanReport:
    """The exact speed-aware plan for stages of `kinds`, and its predictions.

    With model chunks the plan has one range per virtual stage, each timed on its actor's kind;
    an actor's memory budget is shared equally by its chunks, and each chunk keeps the
    activations of as many microbatches as the schedule stashes for it at most.

    `links`: the measured links between stages, by (sender, receiver) stage (`planning.links`).
    A link is then a stage of the pipeline too: the split minimises the slowest of stages and
    links, is refined against the step predicted with every message timed on its link, and the
    report gives each link's wire time per step.
    """
    from raypipe.schedules import build_schedule, owners, peak_in_flight

    k = sequence_units_of(config)  # with k > 1 the profiles are per unit, m k of them a step
    m = config.microbatches
    schedule = build_schedule(config.schedule, config.pp, m, config.chunks, config.extra_warmup, k)
    owner = owners(schedule)
    stage_of = [owner[v] for v in range(len(owner))]
    chunks = config.num_chunks()
    actor_kinds, kinds = list(kinds), [kinds[s] for s in stage_of]  # per actor; per virtual stage
    p = len(kinds)
    times = [[f + b for f, b in zip(profiles[k]["forward_s"], profiles[k]["backward_s"])] for k in kinds]
    links, by_virtual = dict(links or {}), [profiles[k] for k in kinds]
    states = 2 + _optimizer_slots(config.optimizer) / (config.dp if config.zero else 1)
    in_flight = [peak_in_flight([a for a in schedule[stage_of[v]] if a.stage == v]) for v in range(p)]
    cpu_stages = max(1, sum(k == "cpu" for k in actor_kinds))
    capacity = [
        MEMORY_HEADROOM
        * profiles[k]["memory_bytes"]
        / chunks
        * (1 / cpu_stages if k == "cpu" else min(1.0, config.gpus_per_actor))
        for k in kinds
    ]

    def memory(s: int, a: int, b: int) -> float:
        prof = profiles[kinds[s]]
        return sum(prof["parameter_bytes"][a:b]) * states + sum(prof["activation_bytes"][a:b]) * in_flight[s]

    def fits(s: int, a: int, b: int) -> bool:
        return memory(s, a, b) <= capacity[s]

    early = k == 1 and hands_on_early(config, by_virtual, schedule)  # a chunk's backward runs whole

    def step_seconds(split: Plan) -> float:
        compressed = (config.compress_activations, config.compress_gradients) != ("none", "none")
        simple = chunks == 1 and k == 1 and not SCHEDULES[config.schedule].split_backward
        if simple and not links and not compressed:
            return pipeline_seconds([sum(times[s][a:b]) for s, (a, b) in enumerate(split)], m)
        transfer = message_seconds(links, by_virtual, split, config) if links else None
        return scheduled_seconds(schedule, by_virtual, split, transfer, early)

    def link_seconds(v: int, end: int) -> float:  # a microbatch on the busier way of the link after v
        a, b = stage_of[v], stage_of[v + 1]
        forward, backward = boundary_bytes(by_virtual[v], end, config)
        return max(
            links[(a, b)].seconds(forward) if (a, b) in links else 0.0,
            links[(b, a)].seconds(backward) if (b, a) in links else 0.0,
        )

    plan = speed_aware_plan(times, fits, link_seconds if links else None)
    uniform = uniform_plan(len(times[0]), p)
    if chunks > 1 or links:  # an actor's load is the sum of its chunks, and links are timed as messages
        starts = [plan, uniform] + ([speed_aware_plan(times, fits)] if links else [])
        plan = min((refine(start, step_seconds, fits) for start in starts), key=step_seconds)
    stage_seconds = [k * sum(times[s][a:b]) for s, (a, b) in enumerate(plan)]  # a microbatch's k units
    return PlanReport(
        plan=plan,
        kinds=list(kinds),
        stage_seconds=stage_seconds,
        stage_memory_bytes=[memory(s, a, b) for s, (a, b) in enumerate(plan)],
        capacity_bytes=capacity,
        step_seconds=step_seconds(plan),
        uniform_step_seconds=step_seconds(uniform),
        profiles=profiles,
        stages=stage_of if chunks > 1 else [],
        link_wire=_link_wire(links, by_virtual, plan, stage_of, m * k, config),
    )


def _link_wire(
    links: Mapping[tuple[int, int], Link],
    profiles: Sequence[dict[str, object]],
    plan: Plan,
    stage_of: Sequence[int],
    microbatches: int,
    config: TrainConfig,
) -> list[tuple[Link, float]]:
    """Each measured link with the seconds a step's messages take on it under `plan`."""
    if not links:  # (and profiles from before output sizes were recorded need none)
        return []
    message = message_seconds(links, profiles, plan, config)
    wire = dict.fromkeys(links, 0.0)
    for v in range(len(plan) - 1):
        a, b = stage_of[v], stage_of[v + 1]
        for key, what, sender in (((a, b), "F", v), ((b, a), "G", v + 1)):
            if key in links:
                wire[key] += microbatches * message(*key, what, sender)
    return [(links[key], seconds) for key, seconds in sorted(wire.items())]


def pipeline_seconds(stage_seconds: Sequence[float], microbatches: int) -> float:
    """The step time a pipeline with these per-microbatch stage times (forward + backward) needs
    at best: the critical path through every stage once, plus m - 1 microbatches of the slowest."""
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


def refine(plan: Plan, cost: Callable[[Plan], float], fits: Callable[[int, int, int], bool]) -> Plan:
    """Moves one boundary between neighbouring (virtual) stages by one layer at a time while that
    lowers `cost` and the stages still `fit`: a local search over contiguous splits, for when a
    stage's time is not what decides the step (model chunks share an actor)."""
    best, best_cost = list(plan), cost(plan)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for shift in (-1, 1):
                cut = best[i][1] + shift
                if not best[i][0] < cut < best[i + 1][1]:
                    continue
                trial = best[:i] + [(best[i][0], cut), (cut, best[i + 1][1])] + best[i + 2 :]
                if fits(i, *trial[i]) and fits(i + 1, *trial[i + 1]) and (c := cost(trial)) < best_cost - 1e-12:
                    best, best_cost, improved = trial, c, True
    return best


def hands_on_early(config: TrainConfig, profiles: Sequence[dict[str, Any]], schedule: Schedule) -> bool:
    """Whether `config`'s actors will send a whole backward's input gradient before its weight
    gradients (`Executor.may_hand_on_early`), as they choose it (`raypipe.actors.step.hand_on`): only
    on the engines that run action lists, uncompiled, training their weights (not LoRA's adapters
    alone, not measured under tp > 1: `early_gradients.hand_on_mode`); then always with
    RAYPIPE_EARLY_GRADIENTS=1, else where `schedule` timed with every chunk costing the profiled
    layers' mean (the first layer left out: nothing waits for its input gradient) ends sooner so
    (`early_gradients.early_is_faster`, which each actor asks with its own timings)."""
    mode = hand_on_mode(gradient_hand_on(), config.tp)
    if mode == "late" or not engine_kind(config.engine).whole_step_calls or config.compile or config.lora:
        return False
    if mode == "early":
        return True
    if not profiles or any("input_s" not in p for p in profiles):
        return False

    def per_chunk(key: str) -> float:  # each profile holds every layer: a chunk's share of them
        return sum(sum(p[key][1:]) for p in profiles) / len(profiles) ** 2

    costs = (per_chunk(k) for k in ("forward_s", "backward_s", "input_s", "weight_s"))
    return early_is_faster(schedule, *costs)


def scheduled_seconds(
    schedule: Schedule,
    profiles: Sequence[dict[str, Any]],
    plan: Plan,
    transfer: Callable[[int, int, str, int], float] | None = None,
    early_gradients: bool = True,
) -> float:
    """The step time of `schedule` run with each virtual stage's measured forward and backward
    (`profiles`: per virtual stage, its kind's; a split backward's I and W as profiled apart, or
    half the backward each where they were not; the first stage's all at W, as it runs it), each
    boundary message taking `transfer`'s time on its link (`schedules.timed`), and the action
    that sends it to another actor the time compressing and restoring it takes (profiled where
    the config compresses boundaries; charged to the sender). `early_gradients`: a whole backward
    runs split and hands its input gradient on after its I part (`hands_on_early`)."""
    from raypipe.schedules import owners, timed

    owner = owners(schedule)

    def codec(v: int, to: int, key: str) -> float:  # v's message to virtual stage `to`, if it leaves the actor
        if to not in owner or owner[to] == owner[v]:
            return 0.0
        sender = min(v, to)  # the boundary is the output of the earlier stage's last layer
        return profiles[sender].get(key, [0.0] * plan[sender][1])[plan[sender][1] - 1]

    def seconds(action: Action) -> float:
        v = action.stage
        a, b = plan[v]
        prof = profiles[v]
        if action.kind == "F":
            return sum(prof["forward_s"][a:b]) + codec(v, v + 1, "codec_forward_s")
        backward = sum(prof["backward_s"][a:b])
        if action.kind == "B":
            if early_gradients and v > 0 and "input_s" in prof:  # it runs split (`hands_on_early`)
                backward = sum(prof["input_s"][a:b]) + sum(prof["weight_s"][a:b])
            return backward + codec(v, v - 1, "codec_backward_s")
        if v == 0:  # the first stage's inputs take no gradient: its whole backward runs at W
            return 0.0 if action.kind == "I" else backward
        if "input_s" not in prof:  # profiled without the split: half each
            return backward / 2 + (codec(v, v - 1, "codec_backward_s") if action.kind == "I" else 0.0)
        if action.kind == "I":
            return sum(prof["input_s"][a:b]) + codec(v, v - 1, "codec_backward_s")
        return sum(prof["weight_s"][a:b])

    return max(end for run in timed(schedule, seconds, transfer, early_gradients) for _, _, end in run)


def sequence_units_of(config: TrainConfig) -> int:
    """A microbatch's units along the sequence under `config` (1 while "auto" is not chosen)."""
    return config.sequence_chunks if isinstance(config.sequence_chunks, int) else 1


def _optimizer_slots(optimizer: dict) -> int:
    """Per-element optimizer state tensors per parameter (Adam: 2 moments; SGD: momentum or none)."""
    if optimizer["name"] in ("adam", "adamw"):
        return 2
    return 1 if optimizer.get("momentum", 0) else 0
