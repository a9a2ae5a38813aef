"""What a stage actor sets up once it has joined the trainer's world: the groups it is in (by
members), its tied weights' groups, and its links to its pipeline neighbours: device streams on
groups of their own where the driver planned them (`raypipe.driver.links.ways`), shared memory to
neighbours on this node, gloo to the others."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from raypipe.actors.optim.optimizer import OptimizerState
    from raypipe.actors.stage_model import StageModel


@dataclass
class Neighbours:
    """An actor's links: `links` (neighbour's world rank -> "nccl", "gloo (ordered)", "shm" or
    "gloo"), `streams` ((sending virtual stage, "F" or "G") -> (group, device), for
    `step_list.links_for`), the neighbours on shared memory, and whether the step's closing
    agreement goes through pipes."""

    links: dict[int, str] = field(default_factory=dict)
    streams: dict[tuple[int, str], object] = field(default_factory=dict)
    shm_peers: list[int] = field(default_factory=list)
    agrees_through_pipes: bool = False


def by_members(groups: Sequence[Sequence[int]], joined: Sequence[object]) -> dict[tuple[int, ...], object]:
    """The groups this rank joined, keyed by their sorted members; the first of equal members wins,
    so a device stream's group (listed last) never shadows a tied weight's group of the same pair."""
    mine: dict[tuple[int, ...], object] = {}
    for g, group in zip(groups, joined):
        if group is not None:
            mine.setdefault(tuple(sorted(g)), group)
    return mine


def connect(
    rank: int,
    neighbours: Sequence[int],
    streams: Sequence[tuple[int, int, int, int, str]],
    joined: Sequence[object],
    backends: Sequence[str],
    device: torch.device,
    same_node_transport: str,
    timeout: float,
) -> Neighbours:
    """Links to every neighbour: `streams` ((group index, sender, receiver, sending virtual stage,
    "F" or "G")) on their groups, warmed up now; the other neighbours through shared memory on
    this node (unless `same_node_transport` is "gloo") or gloo."""
    from raypipe.transport import agree, ordered, shm

    out = Neighbours()
    for index, sender, receiver, v, what in streams:
        nccl = backends[index] == "nccl"
        out.streams[(v, what)] = (joined[index], device if nccl else torch.device("cpu"))
        out.links[receiver if sender == rank else sender] = "nccl" if nccl else "gloo (ordered)"
    ordered.warm_up(
        [(i, joined[i], [a, b]) for i, a, b, _, _ in streams],
        rank,
        device if any(backends[i] == "nccl" for i, *_ in streams) else torch.device("cpu"),
    )
    host = [n for n in neighbours if n not in out.links]
    out.shm_peers = shm.connect(rank, host, timeout, enabled=same_node_transport == "shm")
    out.links.update({n: "shm" if n in out.shm_peers else "gloo" for n in host})
    out.agrees_through_pipes = agree.connect(rank, timeout, enabled=same_node_transport == "shm")
    return out


def join_tied(
    model: StageModel,
    optim: OptimizerState,
    rank: int,
    tied_groups: Sequence[tuple[int, list[int]]],
    mine: dict[tuple[int, ...], Any],
) -> None:
    """Keeps each cross-stage tied weight's group, copies the first holder's values, and counts
    the weight once in the gradient norm (on its first holder). A frozen weight every holder read
    from the model's files is equal already and not copied: the copy would write every page of a
    file view (`raypipe.models.hf.tensor_files`), making it the process's own."""
    import torch.distributed as dist

    copies = set()
    for g, ranks in tied_groups:
        param, group = model.tied[g], mine[tuple(sorted(ranks))]
        if param.requires_grad or not model.from_files:  # the same on every holder: a shared choice
            with torch.no_grad():
                dist.broadcast(param.data, src=ranks[0], group=group)
        optim.tied.append((param, group))
        if rank != ranks[0]:
            copies.add(id(param))
    model.norm_params = [p for p in model.norm_params if id(p) not in copies]
