"""Elastic training (issue 38): a run that loses a node, and finds no node to take its actors
within `TrainConfig.replace_wait`, goes on with what is left; it grows back once a node joins.

- Shrinking drops the lost actors' replicas when another replica survives whole: dp' < dp
  replicas of dp x m / dp' microbatches each, so a step is the same mean over the same samples
  and the trajectory is unchanged. Otherwise it drops their stages: pp' < pp, the layers split
  again by the run's own partitioner (its profiles when it has them) over the stages left, each
  keeping its device kind. Never below `min_pp` / `min_dp`, and never moving a layer to a kind
  its stage's kind does not allow (another kind, or the CPU without `allow_cpu_fallback`).
- The recovery then restores the surviving replicas' state (`replicas`) or the last checkpoint
  into the new topology; both load into another topology exactly, so the losses are those of an
  uninterrupted run.
- Growing back: at a step boundary of a shrunk run, if a node joined the cluster since the
  shrink, the actors stop and start again in the configured topology, at once from the state
  they hand over in memory (`replicas`), or, where they cannot (ZeRO, `restore_from_replicas`
  off), at the next checkpoint from it; if it does not place within `actor_start_timeout`
  (measured: with 1 s, a group released a moment before sometimes does not reserve again in
  time), the shrunk topology starts again from the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray

from raypipe.config import TrainConfig
from raypipe.core.errors import ConfigError, PlacementError, RaypipeError
from raypipe.driver import chunks
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.checkpoints import restore_point
from raypipe.driver.cluster import nodes
from raypipe.driver.run import replicas
from raypipe.driver.run_state import RunState
from raypipe.planning.partition import first_plan
from raypipe.planning.profiling import plan_from_profiles
from raypipe.schedules import build_schedule

Plan = list[tuple[int, int]]


@dataclass
class Shrunk:
    """What a shrunk run grows back to: the configured topology and split, and the nodes alive
    when it last shrank (or last failed to grow), so that only a node joining since triggers it."""

    config: TrainConfig
    plan: Plan
    nodes: set[str]


def shape(config: TrainConfig) -> str:
    return f"pp={config.pp} x dp={config.dp} ({config.microbatches} microbatches)"


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def place(group: ActorGroup, placed: dict[str, str], gone: set[str], log: Callable[[str], None]) -> None:
    """Starts the stopped `group` after its nodes `gone` were lost (`placed`: actor name -> node
    before the loss): in its own topology when nodes take the lost actors within `replace_wait`,
    else in the largest smaller one that places (`smaller`).

    Raises:
        PlacementError: nothing smaller places, or a limit (min_pp, min_dp, a device kind, the
            memory a profiled plan needs) forbids shrinking; names each reason.
    """
    config, plan_before = group.config, list(group.plan)
    try:
        group.start(reserve_wait=config.replace_wait)
        return
    except PlacementError as failure:
        waited = failure
    lost = {group.topology.place(group.names.index(name))[:2] for name, node in placed.items() if node in gone}
    reasons: list[str] = []
    full = group.shrunk or Shrunk(config, plan_before, set())
    for candidate, plan in smaller(group, lost, reasons):
        log(
            f"raypipe: elastic: no node took the actors of {nodes.describe(placed, gone)} within "
            f"{config.replace_wait:g} s (TrainConfig.replace_wait); shrinking from {shape(config)} to "
            f"{shape(candidate)}, layers {plan}"
        )
        group.reshape(candidate, plan)
        try:
            group.start()
        except PlacementError as failure:
            reasons.append(f"{shape(candidate)} did not place either: {failure}")
            continue
        full.nodes = alive_nodes()
        group.shrunk = full
        return
    group.reshape(config, plan_before)
    raise PlacementError(
        f"{waited} -- and the elastic run (TrainConfig.elastic) cannot shrink: {'; '.join(reasons)}"
    ) from None


def smaller(group: ActorGroup, lost: set[tuple[int, int]], reasons: list[str]) -> list[tuple[TrainConfig, Plan]]:
    """The topologies to go on with after losing the actors of (replica, stage) pairs `lost`,
    preferred first: fewer replicas (the trajectory kept), then fewer stages. Why any other is
    not possible goes to `reasons`."""
    config, found = group.config, []
    replicas, stages = {d for d, _ in lost}, {s for _, s in lost}
    if len(replicas) < config.dp:  # a replica survives whole
        total, dp = config.dp * config.microbatches, config.dp - len(replicas)
        while dp >= config.min_dp and (total % dp or dp % config.ep):
            dp -= 1
        if dp < config.min_dp:
            reasons.append(f"dp={config.dp - len(replicas)} would go below TrainConfig.min_dp={config.min_dp}")
        else:
            try:
                found.append((config.replace(dp=dp, microbatches=total // dp), list(group.plan)))
            except ConfigError as error:
                reasons.append(f"dp={dp}: {error}")
    pp = config.pp - len(stages)
    if pp < config.min_pp:
        reasons.append(f"pp={pp} would go below TrainConfig.min_pp={config.min_pp}")
    elif config.shard_plan is not None:
        reasons.append("TrainConfig.shard_plan fixes the split of its pp stages; fewer stages need none")
    else:
        try:
            found.append(fewer_stages(group, sorted(stages)))
        except (ConfigError, PlacementError) as error:
            reasons.append(f"pp={pp}: {error}")
    return found


def fewer_stages(group: ActorGroup, lost: list[int]) -> tuple[TrainConfig, Plan]:
    """The config and split without stages `lost`: the others keep their kinds and quantization,
    the layers are split again as the run's plan was made.

    Raises:
        ConfigError: the schedule does not fit fewer stages, or a layer would move to a device
            kind its own does not allow.
        PlacementError: a profiled plan finds the stages left too small for the model's memory.
    """
    config = group.config
    kept = [s for s in range(config.pp) if s not in lost]
    kinds = config.stage_kinds()
    per_stage = isinstance(config.quantize, list)
    config2 = config.replace(
        pp=len(kept),
        devices=config.devices if isinstance(config.devices, str) else [kinds[s] for s in kept],
        quantize=[config.quantize[s] for s in kept] if per_stage else config.quantize,
    )
    plan, _, profiled = first_plan(group.specs, config2, True)
    if profiled and group.report is not None:
        plan = plan_from_profiles(group.report.profiles, config2.stage_kinds(), config2).plan
    before, after = layer_kinds(config, group.plan), layer_kinds(config2, plan)
    for layer, (was, now) in enumerate(zip(before, after)):
        if was != now and not (now == "cpu" and config.allow_cpu_fallback):
            raise ConfigError(
                f"layer {layer} runs on a {was} stage and would move to a {now} one, which "
                f"TrainConfig.devices={config.devices!r} does not allow (allow_cpu_fallback lets any "
                f"move to the CPU): bring back a node with {was}"
            )
    return config2, plan


def layer_kinds(config: TrainConfig, plan: Plan) -> list[str]:
    """The device kind each layer runs on under `config` and its split `plan` (per virtual stage)."""
    schedule = build_schedule(
        config.schedule, config.pp, config.microbatches, config.chunks, config.extra_warmup, config.sequence_chunks
    )
    kinds, out = config.stage_kinds(), {}
    for stage, ranges in enumerate(chunks.actor_plan(plan, schedule)):
        for start, end in ranges:
            out.update({layer: kinds[stage] for layer in range(start, end)})
    return [out[layer] for layer in sorted(out)]


def grow_back(group: ActorGroup, run: RunState, where: str | None, log: Callable[[str], None]) -> None:
    """At a step boundary of a shrunk run (`where`: the checkpoint just written, else None): back
    to the configured topology when a node joined since the shrink, at once with the actors' state
    handed over in memory (`replicas`), or else at a checkpoint from it; otherwise nothing. If the
    configured topology does not place within `actor_start_timeout`, the shrunk one starts again
    from the same state, until another node joins."""
    shrunk = group.shrunk
    small, small_plan, full = group.config, group.plan, shrunk.config
    grown = small.replace(
        pp=full.pp, dp=full.dp, microbatches=full.microbatches, devices=full.devices, quantize=full.quantize
    )
    memory = replicas.why_not(small, lost=False) is None and replicas.why_not(grown, lost=False) is None
    if (where is None and not memory) or not alive_nodes() - shrunk.nodes:
        return
    held = replicas.take(group, set(), run.step_count, log, lost=False) if memory else None
    if held is None and where is None:
        return
    log(
        f"raypipe: elastic: a node joined; growing back from {shape(small)} to {shape(grown)} at step "
        f"{run.step_count} ({'from memory' if held is not None else where})"
    )
    group.shutdown()
    group.reshape(grown, shrunk.plan)
    try:  # within actor_start_timeout: a node has joined, and a group just released frees its bundles slowly
        group.start()
        group.shrunk = None
    except PlacementError as failure:
        log(f"raypipe: elastic: {shape(grown)} did not place ({failure}); going on at {shape(small)}")
        group.reshape(small, small_plan)
        group.start()
        shrunk.nodes = alive_nodes()
    if held is not None and replicas.restore(group, held, log):
        return
    if where is None:  # the state did not load: the run's last checkpoint, and the steps since replayed
        found = restore_point(group.config.checkpoint_dir, run)
        if found is None:
            raise RaypipeError(f"growing back at step {run.step_count}: the actors' state did not load, no checkpoint")
        where = str(found[0])
    group.load(where, None, run, log)
