"""ZeRO stage 1: which data-parallel replica steps which parameter, and sharing the result.

Every replica holds every parameter and the full (averaged) gradients; only the
optimizer state is split. Replica r steps the parameters it owns, then each owner
broadcasts its parameters to the others, so the replicas stay identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def owners(params: Sequence[torch.nn.Parameter], dp_size: int) -> list[int]:
    """The owning dp rank of each parameter: greedy by size, in order, so every replica agrees."""
    load = [0] * dp_size
    result = []
    for p in params:
        rank = load.index(min(load))
        result.append(rank)
        load[rank] += p.numel()
    return result


def broadcast_from_owners(
    params: Sequence[torch.nn.Parameter],
    owner_ranks: Sequence[int],
    global_ranks: Sequence[int],
    group: dist.ProcessGroup,
) -> None:
    """Sends each parameter from its owner (a dp rank) to the other replicas of the group."""
    with torch.no_grad():
        for p, owner in zip(params, owner_ranks):
            dist.broadcast(p.data, src=global_ranks[owner], group=group)
