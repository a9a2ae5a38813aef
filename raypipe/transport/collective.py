"""Rendezvous and process groups among stage actors.

One torch.distributed world per trainer: the ranks meet through a Ray actor that holds
the world's keys (`ray_store`: no rendezvous port is opened), and each actor then joins the
world and builds the subgroups it belongs to with `new_group` (a collective call
every rank makes for every group, in the same order). `ray.util.collective`
would put an actor in one group only; subgroups of one world let an actor be in a
dp group and a tp group at once. The world itself is gloo (it carries control
traffic such as gathering checkpoint shards); each subgroup takes the backend of
its members' tensors: gloo for cpu and mps, nccl (rccl on ROCm) for cuda (`links.group_backend`).
Device links between GPU stages are subgroups too: two ranks, one per stream (`links`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from raypipe.transport.gloo import forget_streams
from raypipe.transport.ray_store import RayStore

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# torch DDP's default bucket size: large enough to amortise a collective's latency,
# small enough that the first buckets go out while later gradients are still copied.
BUCKET_BYTES = 25 * 1024 * 1024

# The world's store, held while the world lives: torch keeps only its C++ side, and a Python store
# whose Python object was collected answers torch's calls (every later `new_group`) with "Not implemented".
_store: RayStore | None = None


def gloo_interface(ip: str) -> str | None:
    """The network interface holding `ip`, this node's Ray address, for gloo to bind to.

    Without GLOO_SOCKET_IFNAME gloo binds to the address this host's name resolves to, which
    on many hosts (Debian's /etc/hosts, most containers) is 127.0.x.x: every rank would then
    advertise a loopback address to the others and ranks on other nodes could not connect.
    """
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    return None


def join_world(
    keeper: ActorHandle,
    world_size: int,
    rank: int,
    groups: Sequence[Sequence[int]],
    timeout: float,
    backends: Sequence[str] | None = None,
) -> list[dist.ProcessGroup | None]:
    """Joins the trainer's world and creates every subgroup; returns, per subgroup, the group
    where this rank is in it, else None.

    The ranks meet through `keeper` (a `ray_store.StoreKeeper`, so no rendezvous port is opened);
    gloo's and NCCL's own connections bind to the interface of this node's Ray address.

    Args:
        groups: every subgroup of the world (each a list of ranks), in one agreed order.
        timeout: seconds a collective may wait for its peers before failing.
        backends: each group's backend (`links.group_backend`); gloo if omitted.
    """
    import ray

    interface = gloo_interface(ray.util.get_node_ip_address())
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface is not None and variable not in os.environ:  # the user's choice wins
            os.environ[variable] = interface
    forget_streams()  # a peer process of the new world remembers no earlier step
    global _store
    _store = RayStore(keeper, timeout)
    dist.init_process_group(
        "gloo",
        store=_store,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout),
    )
    mine: list[dist.ProcessGroup | None] = []
    for ranks, backend in zip(groups, backends or ["gloo"] * len(groups)):
        group = dist.new_group(sorted(ranks), backend=backend)
        mine.append(group if rank in ranks else None)
    return mine


def listening_ports() -> set[tuple[str, int]]:
    """The TCP (address, port) pairs this process listens on."""
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(os.getpid()).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }


def leave_world() -> None:
    global _store
    forget_streams()
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None


def bucket_plan(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped into consecutive buckets of about `bucket_bytes`; a bucket
    is flattened into one tensor, so a change of dtype also closes it."""
    buckets: list[list[int]] = []
    nbytes = 0
    for i, t in enumerate(tensors):
        if not buckets or nbytes >= bucket_bytes or t.dtype != tensors[buckets[-1][0]].dtype:
            buckets.append([])
            nbytes = 0
        buckets[-1].append(i)
        nbytes += t.numel() * t.element_size()
    return buckets


def all_reduce_mean(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Averages tensors in place across `group`, flattened into buckets of ~`bucket_bytes`."""
    for bucket in bucket_plan(tensors, bucket_bytes):
        _reduce_bucket([tensors[i] for i in bucket], group, size)


def _reduce_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
