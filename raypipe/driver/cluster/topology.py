"""The rank math of a trainer's actors: (dp replica d, stage s, tp rank t) <-> world rank,
names, neighbours and process groups, in one place.

Actors are laid out replica-major, then stage, then tp rank: rank = (d * pp + s) * tp + t,
named `stage{s}-dp{d}-tp{t}`. The actor list, the torch.distributed world and every
per-actor list the driver keeps use this one order.

Expert parallelism is carved out of the replicas, as Megatron and DeepSpeed do: replicas
b*ep .. b*ep+ep-1 form an ep group (they exchange tokens, each holding 1/ep of the experts),
and replica d holds the same experts as d +- ep, d +- 2ep, ... (its expert-data group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """pp stages x dp replicas x tp ranks; ep (dividing dp) expert-parallel ranks among the replicas."""

    pp: int
    dp: int
    tp: int
    ep: int = 1

    def rank(self, d: int, s: int, t: int) -> int:
        """The world rank of replica d, stage s, tp rank t."""
        return (d * self.pp + s) * self.tp + t

    def place(self, rank: int) -> tuple[int, int, int]:
        """(dp replica, stage, tp rank) of a world rank; the inverse of `rank`."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def names(self) -> list[str]:
        return [f"stage{s}-dp{d}-tp{t}" for d in range(self.dp) for s in range(self.pp) for t in range(self.tp)]

    def grid(self, flat: Sequence[T]) -> list[list[list[T]]]:
        """Per-rank items (actors, names, ranks) -> [replica][stage][tp rank]."""
        return [
            [list(flat[self.rank(d, s, 0) : self.rank(d, s, 0) + self.tp]) for s in range(self.pp)]
            for d in range(len(flat) // (self.pp * self.tp))
        ]

    def lead_ranks(self) -> list[int]:
        """Per stage, the rank of replica 0's tp rank 0: the actor whose timings stand for the stage."""
        return [self.rank(0, s, 0) for s in range(self.pp)]

    def dp_groups(self) -> list[list[int]]:
        """One per (stage, tp rank): that stage's tp rank across the replicas, indexed s * tp + t."""
        return [[self.rank(d, s, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        """One per (replica, stage): the stage's tp ranks within the replica, indexed d * pp + s."""
        return [[self.rank(d, s, t) for t in range(self.tp)] for d in range(self.dp) for s in range(self.pp)]

    def across_stages(self, stages: Sequence[int], d: int, t: int) -> list[int]:
        """The world ranks of replica d's tp rank t on each of `stages` (a tied weight's holders)."""
        return [self.rank(d, s, t) for s in stages]

    def ep_group(self, d: int, s: int, t: int) -> list[int]:
        """The world ranks replica d's (stage s, tp rank t) exchanges tokens with, itself included."""
        first = d - d % self.ep
        return [self.rank(e, s, t) for e in range(first, first + self.ep)]

    def expert_group(self, d: int, s: int, t: int) -> list[int]:
        """The world ranks holding the same experts as replica d's (stage s, tp rank t)."""
        return [self.rank(e, s, t) for e in range(d % self.ep, self.dp, self.ep)]

    def expert_groups(self) -> list[list[int]]:
        """Every ep group, then every expert-data group, each once (none when ep is 1)."""
        if self.ep == 1:
            return []
        places = [(d, s, t) for s in range(self.pp) for t in range(self.tp) for d in range(self.dp)]
        groups = [self.ep_group(*p) for p in places] + [self.expert_group(*p) for p in places]
        return list(dict.fromkeys(tuple(g) for g in groups))
