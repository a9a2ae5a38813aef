"""Which way each pipeline link carries boundary values, decided on the driver once every actor
has reported where it runs (`StageActor.info`: its device and, on CUDA, which physical GPU).

Between two CUDA (or ROCm) stages on different GPUs, on one node or not, values stay on the
device: each stream (activations one way, gradients the other) gets a 2-rank NCCL group of its
own (`transport.ordered`). Every other link goes through host memory: shared memory on one
node, gloo between nodes (the actors choose, `transport.shm`). Two ranks on one GPU cannot
share an NCCL communicator (NCCL fails with "Duplicate GPU detected"), so stages that share a
GPU (`gpus_per_actor` < 1) link through host memory, and a dp, tp or tied-weight group with two
members on one GPU reduces over gloo. `TrainConfig.device_links` overrides the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raypipe.core.errors import PlacementError
from raypipe.core.protocol import ActorInfo
from raypipe.driver.cluster.topology import Topology
from raypipe.schedules.actions import Schedule, owners


@dataclass
class Stream:
    """One direction of a device link: `sender` to `receiver` (world ranks), carrying what
    virtual stage `v` sends ("F": its activations, "G": its input gradients)."""

    sender: int
    receiver: int
    v: int
    what: str
    backend: str = "nccl"  # gloo where device_links="nccl" is asked of two host stages

    @property
    def ranks(self) -> list[int]:
        return sorted((self.sender, self.receiver))


@dataclass
class LinkPlan:
    """The device links of a trainer: the streams that get a group of their own."""

    streams: list[Stream] = field(default_factory=list)

    def of(self, rank: int) -> list[tuple[int, Stream]]:
        """(index among the plan's streams, stream) for each stream `rank` sends or receives."""
        return [(i, s) for i, s in enumerate(self.streams) if rank in (s.sender, s.receiver)]


def gpu_of(info: ActorInfo) -> tuple[str, str] | None:
    """The physical GPU an actor holds: (node, GPU id), None off CUDA."""
    return (info.node_id, info.gpu) if info.gpu else None


def shares_gpu(infos: Sequence[ActorInfo], ranks: Sequence[int]) -> bool:
    """Whether two of `ranks` hold the same GPU."""
    gpus = [gpu_of(infos[r]) for r in ranks]
    held = [g for g in gpus if g is not None]
    return len(set(held)) < len(held)


def group_backend(infos: Sequence[ActorInfo], ranks: Sequence[int]) -> str:
    """A collective group's backend: nccl (rccl on ROCm) when every member holds its own GPU,
    gloo otherwise (cpu or mps members, or two members on one GPU)."""
    on_gpu = all(infos[r].device.startswith("cuda") for r in ranks)
    return "nccl" if ranks and on_gpu and not shares_gpu(infos, ranks) else "gloo"


def plan_links(
    topology: Topology, schedule: Schedule, infos: Sequence[ActorInfo], names: Sequence[str], choice: str
) -> LinkPlan:
    """The streams that go device to device under `choice` (`TrainConfig.device_links`), in an
    order every actor agrees on.

    Raises:
        PlacementError: `choice` is "nccl" and two linked CUDA stages share a GPU.
    """
    if choice == "host":
        return LinkPlan()
    owner = owners(schedule)
    plan = LinkPlan()
    for v in range(len(owner) - 1):
        if owner[v] == owner[v + 1]:
            continue  # a hand-over inside one actor
        for d in range(topology.dp):
            for t in range(topology.tp):
                a, b = topology.rank(d, owner[v], t), topology.rank(d, owner[v + 1], t)
                backend = _device_pair(infos, names, a, b, choice)
                if backend is not None:
                    plan.streams += [Stream(a, b, v, "F", backend), Stream(b, a, v + 1, "G", backend)]
    return plan


def _device_pair(infos: Sequence[ActorInfo], names: Sequence[str], a: int, b: int, choice: str) -> str | None:
    """The backend of the streams between world ranks `a` and `b`, None through host memory."""
    cuda = [infos[r].device.startswith("cuda") for r in (a, b)]
    if choice == "nccl":
        if all(cuda) and shares_gpu(infos, [a, b]):
            raise PlacementError(
                f"TrainConfig.device_links='nccl', but {names[a]} and {names[b]} share one GPU "
                f"(node {infos[a].node_id[:8]}, GPU {infos[a].gpu}) and NCCL refuses two ranks on one "
                f"device: give each stage a GPU of its own (gpus_per_actor=1), or set device_links='auto' "
                f"(host memory between them)."
            )
        if any(cuda) and not all(cuda):
            return None  # a GPU and a host device: through host memory, whatever was asked
        return "nccl" if all(cuda) else "gloo"
    return "nccl" if all(cuda) and not shares_gpu(infos, [a, b]) else None
