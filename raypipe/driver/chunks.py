"""Model chunks on the driver: which layers each actor holds when a schedule gives actors several
virtual stages (interleaved-1f1b, zb-v), and the order inference walks them.

`plan` is always per virtual stage (one [start, end) range each, in virtual-stage order);
without chunks virtual stage s is actor s and every function here is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raypipe.core.errors import ConfigError
from raypipe.schedules import Schedule, owners, virtual_stages

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def actor_plan(plan: Sequence[tuple[int, int]], schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per actor, the layer ranges of the virtual stages it holds (chunk 0 first)."""
    return [[tuple(plan[v]) for v in stages] for stages in virtual_stages(schedule)]


def actor_chunks(plan: Sequence[tuple[int, int]], schedule: Schedule, actor: int) -> list[tuple[int, int, int]]:
    """(virtual stage, start, end) of each chunk `actor` holds; what a StageActor is built with."""
    return [(v, *plan[v]) for v in virtual_stages(schedule)[actor]]


def inference_group(
    topology: Any, actors: Sequence[ActorHandle], names: Sequence[str]
) -> tuple[list[list[Any]], list[list[str]]]:
    """Per stage, the actors (and names) a forward-only pass calls: replica 0's tp ranks, and under
    expert parallelism those of replicas 1..ep-1 beside them with the same inputs, since their MoE
    layers route tokens through all of them (rank 0's output goes on). `topology`: a `Topology`."""
    grid, labels = topology.grid(actors), topology.grid(names)
    return (
        [[a for d in range(topology.ep) for a in grid[d][s]] for s in range(topology.pp)],
        [[n for d in range(topology.ep) for n in labels[d][s]] for s in range(topology.pp)],
    )


def inference_path(
    stages: Sequence[ActorHandle], names: Sequence[object], schedule: Schedule
) -> tuple[list[object], list[object], list[int] | None]:
    """One replica's actors (per stage, its tp ranks) and names in virtual-stage order, and the
    virtual stage each call runs (None without chunks): the path a forward-only pass takes."""
    owner = owners(schedule)
    if all(owner[v] == v for v in owner):
        return list(stages), list(names), None
    order = [owner[v] for v in range(len(owner))]
    return [stages[a] for a in order], [names[a] for a in order], list(range(len(owner)))


def check_same_layout(old: Schedule, new: Schedule, name: str) -> None:
    """A schedule change between steps must keep each actor's layers.

    Raises:
        ConfigError: the new schedule places virtual stages differently.
    """
    if virtual_stages(old) != virtual_stages(new):
        raise ConfigError(
            f"schedule={name!r} places model chunks as {virtual_stages(new)}, but this trainer's "
            f"actors hold {virtual_stages(old)}: changing chunks needs a new Trainer (save a "
            f"checkpoint, then load it into one built with the new schedule)."
        )
