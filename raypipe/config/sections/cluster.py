"""`TrainConfig.cluster`: where the actors run and how they reach each other."""

from __future__ import annotations

from raypipe.config.checks import check_choice, check_devices, check_int, check_positive, fail
from raypipe.config.choices import (
    DEVICE_LINKS,
    PLACEMENTS,
    SAME_NODE_TRANSPORTS,
    DeviceLinks,
    Placement,
    SameNodeTransport,
)
from raypipe.config.sections.base import Section, section


@section("cluster")
class ClusterConfig(Section):
    """Where the actors run, what each reserves, and how boundary tensors travel between them.

    Attributes:
        devices: the accelerator kind of every stage ("cpu", "cuda", "rocm", "mps"), or a
            list with one kind per stage. A cuda/rocm/mps stage asks Ray for that custom
            resource (and `num_gpus` for cuda/rocm) on a node labelled with the kind.
        gpus_per_actor: the share of one device each accelerator stage takes (0.5 puts
            two stages on one GPU).
        allow_cpu_fallback: let a cuda/rocm/mps stage run on the CPU when its node has
            no such device (tests and demos); the actor reports that it did.
        cpus_per_actor: logical CPUs each stage actor reserves; None fits the actors into the
            cluster's CPUs (at most 1 each).
        threads_per_actor: torch intra-op threads per actor; None shares each node's CPUs, at most
            its OS cores, among the trainer's actors there (the reservation inside a Tune trial).
        actor_start_timeout: seconds to wait for every actor to be placed and built.
        placement: how the actors are reserved, all or nothing, in one Ray placement group:
            "pack" (as few nodes as possible), "spread" (across nodes where possible) or
            "strict_spread" (one actor per node). A trainer that does not fit holds nothing
            while it waits, so two trainers on one cluster never each hold half.
        same_node_transport: how p2p and compiled move boundary tensors between neighbouring
            stages on one node: "shm" (shared memory and a pipe: one copy, no TCP, microbatches
            of differing shapes too; streams too large for /dev/shm fall back to gloo) or
            "gloo" (loopback TCP). Stages on
            different nodes always use gloo. With "shm" the step's closing agreement (global
            norm, failures) also goes through pipes when every actor is on one node.
        probe_links: measure the rate and latency each way of every link between neighbouring
            stages on different nodes when the actors start (a fraction of a second per link,
            over gloo; `Trainer.links()`, `stage_info()`). With partition="profile" or
            schedule="auto" the trainer then plans again for the measured links: the split moves
            to where boundaries are small or links fast, and "auto" picks the schedule, the
            microbatches and `extra_warmup` that hide the link (the actors restart once when
            the split or the chunks change). False: a link-blind plan, nothing measured.
        device_links: how p2p and compiled move boundary tensors between two CUDA (or ROCm)
            stages: "auto" keeps them on the device, over NCCL (RCCL), when the two stages hold
            different GPUs (on one node or not), and goes through host memory otherwise
            (NCCL refuses two ranks on one GPU); "host" always goes through host memory
            (`same_node_transport`, gloo between nodes); "nccl" puts every link on NCCL's
            in-order streams, an error where two linked stages share a GPU (on CPU and MPS
            stages those streams run over gloo: how the tests check them without a GPU).
    """

    devices: str | list[str] = "cpu"
    gpus_per_actor: float = 1.0
    allow_cpu_fallback: bool = False
    cpus_per_actor: float | None = None
    threads_per_actor: int | None = None
    actor_start_timeout: float = 60.0
    placement: Placement = "pack"
    same_node_transport: SameNodeTransport = "shm"
    probe_links: bool = True
    device_links: DeviceLinks = "auto"

    def __post_init__(self) -> None:  # one kind per stage: `validation.check_across`
        check_devices(self.devices)
        if not isinstance(self.devices, str):
            self.normalise("devices", list(self.devices))
        check_positive("gpus_per_actor", self.gpus_per_actor)
        for name in ("allow_cpu_fallback", "probe_links"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, getattr(self, name), "give true or false.")
        check_positive("cpus_per_actor", self.cpus_per_actor, allow_none=True)
        if self.threads_per_actor is not None:
            check_int("threads_per_actor", self.threads_per_actor, 1)
        check_positive("actor_start_timeout", self.actor_start_timeout)
        check_choice("placement", self.placement, PLACEMENTS)
        check_choice("same_node_transport", self.same_node_transport, SAME_NODE_TRANSPORTS)
        check_choice("device_links", self.device_links, DEVICE_LINKS)
