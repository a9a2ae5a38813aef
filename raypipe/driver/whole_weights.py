"""The whole model's weights through the driver: gathered from the stages with tensor-parallel
shards merged, and cut by stage to load them. Both pass every tensor through the driver's
memory; checkpoints (`save`/`load`) are the way for a model that does not fit there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import ConfigError, StageError
from raypipe.driver.results import gather
from raypipe.nn import ShardSpec, merge

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raypipe.driver.actor_group import ActorGroup


def merged(stages: Sequence[Sequence[Any]], method: str, tp: int) -> dict[str, torch.Tensor]:
    """Calls `method` ("state_dict" or "gradients") on one replica's actors (per stage, every
    tp rank) and merges tensor-parallel shards by key."""
    calls = [getattr(a, method).remote() for stage in stages for a in stage]
    specs_refs = [stage[0].tensor_shards.remote() for stage in stages] if tp > 1 else []
    values = gather(calls + specs_refs, method)
    parts, specs = values[: len(calls)], {}
    for part in values[len(calls) :]:
        specs.update(part)
    result: dict[str, torch.Tensor] = {}
    for s in range(len(stages)):
        shards = parts[s * tp : (s + 1) * tp]
        for key, value in shards[0].items():
            spec = specs.get(key)
            result[key] = merge([p[key] for p in shards], ShardSpec(*spec)) if spec else value
    return result


def merged_replicas(
    grid: Sequence[Sequence[Sequence[object]]], method: str, tp: int, ep: int
) -> dict[str, torch.Tensor]:
    """`merged` of replica 0 (`grid`: [replica][stage][tp rank]), with the experts replicas 1..ep-1
    hold under expert parallelism (each holds its share of every MoE layer's)."""
    result: dict[str, torch.Tensor] = {}
    for d in range(ep):
        result.update(merged(grid[d], method, tp))
    return result


def load_into(
    actors: Sequence[ActorHandle], state: dict[str, torch.Tensor], plan: Sequence[Sequence[tuple[int, int]]], tp: int
) -> None:
    """Loads full-model weights into every actor, each stage getting the keys of its layers
    (`plan`: per stage, the layer ranges it holds, `raypipe.driver.chunks.actor_plan`).

    Raises:
        KeyError: a key names no layer of the model, or a stage's key is missing.
    """
    parts: list[dict[str, torch.Tensor]] = [{} for _ in plan]
    stray = []
    for key, value in state.items():
        index = key.split(".", 1)[0]
        stage = stage_of(plan, int(index)) if index.isdigit() else None
        if stage is None:
            stray.append(key)
        else:
            parts[stage][key] = value
    if stray:
        layers = max(end for ranges in plan for _, end in ranges) if plan else 0
        raise KeyError(
            f"load_state_dict: keys {stray[:5]} name no layer of this {layers}-layer "
            f"model; keys look like '<layer index>.<parameter>', as state_dict() gives them."
        )
    import ray

    refs = [ray.put(part) for part in parts]  # sent once, read by the check and the load
    per_actor = [refs[(i // tp) % len(plan)] for i in range(len(actors))]
    problems = sorted(
        {
            p
            for found in gather(
                [a.check_state_dict.remote(r) for a, r in zip(actors, per_actor)], "load_state_dict check", actors
            )
            for p in found
        }
    )
    if problems:  # all or nothing: no actor has changed a weight yet
        raise KeyError(
            f"load_state_dict: the weights do not fit this model, nothing was loaded: "
            f"{'; '.join(problems[:8])}{f'; and {len(problems) - 8} more' if len(problems) > 8 else ''}"
        )
    try:
        gather([a.load_state_dict.remote(r) for a, r in zip(actors, per_actor)], "load_state_dict")
    except StageError as error:
        raise KeyError(str(error)) from None


def stage_of(plan: Sequence[Sequence[tuple[int, int]]], layer: int) -> int | None:
    """The stage holding global layer `layer` (`plan`: per stage, its layer ranges), or None."""
    for s, ranges in enumerate(plan):
        if any(start <= layer < end for start, end in ranges):
            return s
    return None


def load_group(group: ActorGroup, state: dict[str, torch.Tensor]) -> None:
    """`load_into` every actor of `group` (an `ActorGroup`): `Trainer.load_state_dict`, and a
    recovery loading it again."""
    load_into(group.actors, state, group.actor_plan(), group.config.tp)


def named(state: dict[str, torch.Tensor], keys: str, model: object, specs: Sequence[object]) -> dict[str, torch.Tensor]:
    """`state` under raypipe's keys (`keys="raypipe"`), or under transformers' own names for a
    transformers model (`"transformers"`: as its `PreTrainedModel.state_dict()` names them; a tied
    head once)."""
    if keys == "raypipe":
        return state
    exporter = getattr(model, "exporter", None)
    if keys != "transformers" or exporter is None or not hasattr(exporter, "plan"):
        raise ConfigError(
            f"state_dict(keys={keys!r}) is invalid: give 'raypipe', or 'transformers' for a model of raypipe.models.hf."
        )
    names = exporter.names(specs)
    return {names[k]: v for k, v in state.items() if names.get(k)}
