"""What crosses between the driver and the actors, as typed values.

The driver (`raypipe.driver`) and the actors (`raypipe.actors`) run in different processes and
know each other only through these types: an actor is built from an `ActorSpec`, joins the
trainer's world by a `WorldSpec` and trains by `StageSettings`; a step call goes out
(`StepCall`, or for the compiled engine one `CompiledCall` for all actors), each actor's
`StepReport` comes back, and an actor stopped by a neighbour's failure raises `PeerStopped` so
the driver can find the stage that failed first by type. After a node loss each surviving actor
describes the state it hands over with a `HeldState` (the state itself goes from actor to actor
through Ray's object store).

Every type here is frozen: a value is built once by its sender and read by its receiver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raypipe.core.env import gradient_hand_on
from raypipe.core.errors import StageError
from raypipe.core.layers import LossFunction

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "ActorInfo",
    "ActorSpec",
    "CompiledCall",
    "HeldState",
    "PeerStopped",
    "RunCall",
    "RunStep",
    "StageSettings",
    "StepCall",
    "StepReport",
    "StepTimings",
    "WorldSpec",
]


@dataclass(frozen=True)
class ActorSpec:
    """What one stage actor is built with (`StageActor(spec)`).

    Attributes:
        name: the actor's name, "stage{s}-dp{d}-tp{t}", used in every error it raises.
        stage: its pipeline stage; num_stages: the pipeline depth.
        specs: the `LayerSpec`s of the layers it holds, chunk after chunk.
        start: global index of its first layer (seeds and state_dict keys count from there).
        seed: the run seed; threads: torch intra-op threads for its process.
        loss_fn: `loss_fn(output, target) -> scalar`, for the actor holding the last virtual stage.
        dp_rank, dp_size: its place among the data-parallel replicas of its stage.
        tp_rank, tp_size: its place in the stage's tensor-parallel group.
        device_kind: "cpu", "cuda", "rocm" or "mps", what it was placed for.
        allow_cpu_fallback: run on the CPU when the node has no such device.
        tied: the model's groups of tied weights' keys (`raypipe.models.model.Model.tied`).
        lora: `TrainConfig.lora`; quantize: its stage's `TrainConfig.quantize` ("nf4", "int8").
        chunks: the (virtual stage, start, end) ranges it holds with model chunks, else empty;
            num_virtual: how many virtual stages the schedule has.
        ep_size: `TrainConfig.ep`: replica d is expert-parallel rank d % ep_size.
    """

    name: str
    stage: int
    num_stages: int
    specs: list
    start: int
    seed: int
    threads: int
    loss_fn: LossFunction | None = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    device_kind: str = "cpu"
    allow_cpu_fallback: bool = False
    tied: tuple = ()
    lora: dict | None = None  # `TrainConfig.lora`: peft's LoraConfig fields
    quantize: str | None = None
    chunks: tuple = ()
    num_virtual: int | None = None
    ep_size: int = 1


@dataclass(frozen=True)
class WorldSpec:
    """How one actor joins its trainer's torch.distributed world (`StageActor.join`).

    Attributes:
        keeper: the world's rendezvous, a `transport.ray_store.StoreKeeper` actor; world_size: every
            actor; rank: this one's.
        groups: every subgroup's world ranks, in the order all actors create them; backends:
            each one's backend ("gloo", "nccl"), None for gloo everywhere.
        dp_group, tp_group: its stage's replicas (same tp rank), its stage's tp ranks.
        timeout: seconds a collective may wait.
        neighbours: the world ranks of its pipeline neighbours.
        same_node_transport: "shm" links neighbours on its node through shared memory, "gloo" not.
        tied_groups: (tied group index, its holders' world ranks, lowest stage first) for each
            weight it shares with other stages.
        ep_group: the ranks its MoE layers exchange tokens with; expert_group: the replicas
            holding the same experts (ep > 1 only).
        streams: (index in `groups`, sender, receiver, sending virtual stage, "F" or "G") for each
            device link stream it is in (`raypipe.driver.links.ways`).
    """

    keeper: ActorHandle
    world_size: int
    rank: int
    groups: list
    dp_group: list
    tp_group: list
    timeout: float
    backends: list | None = None
    neighbours: tuple = ()
    same_node_transport: str = "shm"
    tied_groups: tuple = ()
    ep_group: tuple = ()
    expert_group: tuple = ()
    streams: tuple = ()


@dataclass(frozen=True, kw_only=True)
class StepCall:
    """One actor's share of a p2p step (`StageActor.run_actions`), sent as one argument.

    Ray serializes each argument of a call on its own: one value instead of eight separate
    arguments took 0.41-0.48 instead of 0.67-0.76 ms to submit here, and the round trip
    0.6-1.5 ms less (`benchmarks/call_arguments.py`). An `ObjectRef` inside it is not resolved
    by Ray: the actor fetches `inputs` and `targets` itself when they come by reference.
    """

    call_id: int
    step: int
    actions: list  # (kind "F", "B", "I" or "W", microbatch, virtual stage), in order
    inputs: object  # the first virtual stage's actor: the replica's packed microbatches (or an ObjectRef)
    targets: object  # the last virtual stage's actor: the packed targets (or an ObjectRef)
    peers: list  # the world rank holding each virtual stage, for this actor's replica and tp rank
    after: int | None = None  # the call id of the step queued ahead of this one
    varying: bool = False  # the step's microbatches differ in shape: boundary messages describe themselves
    weights: list[float] | None = None  # last stage: each microbatch's loss weight (`Executor.forward`), or None

    @classmethod
    def for_stage(
        cls,
        *,
        call_id: int,
        step: int,
        actions: list,
        peers: list,
        batch: tuple[object, object],
        weights: list[float] | None,
        varying: bool,
        holds_first: bool,
        holds_last: bool,
        after: int | None = None,
    ) -> StepCall:
        """The one way a step's call is made (p2p engine, compiled graph, actor-driven run): the
        replica's `batch` (inputs, targets) and loss `weights` cut to what the actor's virtual
        stages use, the inputs for the first stage's holder, targets and weights for the last's."""
        inputs, targets = batch
        return cls(
            call_id=call_id,
            step=step,
            actions=actions,
            inputs=inputs if holds_first else None,
            targets=targets if holds_last else None,
            peers=peers,
            after=after,
            varying=varying,
            weights=weights if holds_last else None,
        )


@dataclass(frozen=True)
class CompiledCall:
    """One step for every actor of a compiled graph ("compiled" engine): the graph has one
    input, so it carries every actor's action list and every replica's batch."""

    call_id: int
    step: int
    lists: dict[str, tuple[list, list]]  # actor name -> (its actions, its peers), as in `StepCall`
    inputs: list  # per replica, its packed microbatches
    targets: list  # per replica, its packed targets
    varying: bool
    weights: list  # per replica, its microbatches' loss weights or None

    def for_actor(self, name: str, replica: int, holds_first: bool, holds_last: bool) -> StepCall:
        """The `StepCall` the p2p engine would have sent the actor `name` of `replica`."""
        actions, peers = self.lists[name]
        return StepCall.for_stage(
            call_id=self.call_id,
            step=self.step,
            actions=actions,
            peers=peers,
            batch=(self.inputs[replica], self.targets[replica]),
            weights=self.weights[replica],
            varying=self.varying,
            holds_first=holds_first,
            holds_last=holds_last,
        )


@dataclass(frozen=True)
class RunCall:
    """A run of `steps` steps an actor drives itself (`StageActor.run_steps`), one call per actor
    for the whole run: each step's batch comes from the `reader` actor (`DatasetReader.batch`),
    boundaries from its neighbours, and what the driver books goes to the `board` actor
    (`StepBoard.report`) instead of back through the call.

    Attributes:
        call_id, step: the call id and 0-based step of the run's first step (then one more each).
        actions, peers: as in `StepCall`, the same for every step of the run.
        replica: its dp replica (which of a batch's parts it takes); rank: its world rank.
        cut: (dp, microbatches) the reader cuts each batch for.
        reports: it reports every step to the board (a stage lead, or the last stage's tp rank 0);
            the others report only the steps they save.
        saves: 0-based step -> the directory its checkpoint files go to (`checkpoints.begin_save`).
        timeout: seconds it waits for a batch from the reader (`TrainConfig.step_timeout`).
    """

    call_id: int
    step: int
    steps: int
    actions: list
    peers: list
    reader: ActorHandle
    board: ActorHandle
    replica: int
    rank: int
    cut: tuple
    reports: bool
    saves: dict
    timeout: float


@dataclass(frozen=True)
class RunStep:
    """One step of an actor-driven run as the board hands it to the driver once every reporter of
    it has reported: the reporters' `StepReport`s by world rank, the losses in world-rank order
    (already weighted), the batch's samples and tokens, each actor's checkpoint part on a saving
    step (`save_checkpoint`'s answer, or {"error": text}), and the seconds since the step before."""

    step: int
    reports: dict
    losses: list
    samples: int
    tokens: int | None
    saves: dict
    seconds: float


@dataclass(frozen=True, kw_only=True)
class StepTimings:
    """What one actor timed and counted in a step (`Executor.timing`, MoE routing, compile), read by
    `raypipe.observe.metrics.stage_metrics`. The fields of a feature not in use stay None."""

    forward_s: float = 0.0  # seconds in forwards
    backward_s: float = 0.0  # seconds in backwards (input and weight gradients)
    first_start: float = math.inf  # wall clock of its first action's start (the bubble's window)
    last_end: float = 0.0  # and of its last action's end
    peak_stashed: int = 0  # microbatches kept for their backward at once
    peak_awaiting_weight: int = 0  # split backwards: microbatches between input and weight gradient
    sent_bytes: int = 0  # activations and input gradients sent to neighbours
    fp32_sent_bytes: int = 0  # of those, the float32 ones a narrower boundary_dtype would halve
    peak_activation_bytes: int = 0  # the stash's peak bytes (the memory split's activations)
    peak_stashed_bytes: int | None = None  # TrainConfig.measure_activations: the same, reported
    all_to_all_s: float = 0.0  # MoE: seconds in all-to-all
    all_to_all_bytes: int | None = None  # MoE: bytes it sent
    experts: dict | None = None  # MoE: per layer, assignments each expert received and those dropped
    compiled: dict | None = None  # TrainConfig.compile: compiled graphs and graph breaks so far


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """One actor's answer to a step: what its optimizer did, what it timed, and the losses it
    computed (the last stage's tp rank 0 only). `halted`: the step was not run because the one
    queued ahead of it was not applied; nothing else in the report is then meaningful."""

    losses: list[float] | None = None
    objective: list[dict[str, float]] | None = None  # with the losses: per microbatch, the objective's metric sums
    halted: bool = False
    lr: float = 0.0
    grad_norm: float = 0.0
    skipped: bool = False  # non-finite loss or gradients: the update was not applied
    loss_scale: float = 1.0  # fp16's dynamic loss scale after the step
    timing: StepTimings = field(default_factory=StepTimings)
    events: list[tuple] = field(default_factory=list)  # (action, start, end) as this actor ran them
    peak_memory_bytes: int = 0
    memory: dict = field(default_factory=dict)  # peak_memory_bytes split (`raypipe.actors.step.memory.memory_split`)


@dataclass(frozen=True, kw_only=True)
class ActorInfo:
    """Where a stage actor runs and what it holds (`StageActor.info`; `Trainer.stage_info()` gives
    these as dicts, each link keyed by the neighbour's name)."""

    name: str
    stage: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    layers: tuple[int, int] | list[tuple[int, int]] | None = (
        None  # its [start, end) range, or the list of them with model chunks
    )
    virtual_stages: list = field(default_factory=list)
    parameters: int = 0
    node_id: str = ""
    pid: int = 0
    device: str = "cpu"
    gpu: str | None = None  # which physical GPU (its UUID), to keep NCCL off a shared one
    device_kind: str = "cpu"
    cpu_fallback: bool = False
    threads: int = 1
    cores: int = 0  # the cores its process may run on (`devices.usable_cores`): its node's threads are bounded by them
    dtype: str = "float32"
    weights_read: dict = field(default_factory=dict)  # checkpoint tensors its layers read when built: key -> bytes
    shm_peers: list = field(default_factory=list)
    listening: list = field(default_factory=list)  # "host:port" its world's own connections listen on (gloo, NCCL)
    links: dict = field(default_factory=dict)  # neighbour's world rank -> the transport of that link
    agrees_through_pipes: bool = False
    parameter_bytes: int = 0
    experts: dict = field(default_factory=dict)  # MoE layer -> the experts this actor holds
    trainable_parameters: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    memory: dict = field(default_factory=dict)  # its peak memory split, as of its last step (or its load)

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class HeldState:
    """What a surviving actor hands over after a node loss (`StageActor.hand_over`), told to the
    driver, which picks for each new actor the survivors holding its layers.

    Attributes:
        name, tp_rank: the actor; ep_rank: its expert-parallel rank (which experts its layers hold).
        layers: the global indices of the layers whose state it hands over.
        completed: the optimizer steps its weights include (the last applied step's index + 1): a
            step that failed before its closing agreement is not among them.
        nbytes: the size of what it hands over (weights, optimizer state, masters).
    """

    name: str
    tp_rank: int
    ep_rank: int
    layers: tuple
    completed: int
    nbytes: int


class PeerStopped(StageError):
    """An actor stopped its step because another actor of the world failed earlier in it: never
    the root cause (`raypipe.driver.results.root_failure` skips it)."""


@dataclass(frozen=True)
class StageSettings:
    """The settings a stage actor trains by (`StageActor.configure`): what a running trainer may change
    between steps without rebuilding actors (`Trainer.reconfigure`; which `TrainConfig` fields may
    change: `raypipe.config.validation.RECONFIGURABLE`)."""

    microbatches: int  # the step's units: microbatches x sequence chunks
    optimizer: dict
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    grad_clip: float | None = None
    precision: str = "fp32"
    boundary_dtype: str = "fp32"  # "auto": fp32 until the driver chooses (`driver.links.advice`)
    compress_activations: str = "none"
    compress_gradients: str = "none"
    activation_checkpointing: bool = False
    compile: bool = False
    # when a whole backward hands its input gradient on: "measured", "early" or "late" (`env.gradient_hand_on`)
    gradient_hand_on: str = "measured"
    # the step's schedule as (name, pp, microbatches, chunks, extra_warmup, sequence_chunks): what
    # `hand_on` times both ways
    schedule_spec: tuple | None = None
    measure_activations: bool = False
    zero: int = 0
    dp_bucket_bytes: int = 25 * 2**20
    # a non-finite step ends training (TrainConfig.nonfinite="error", not fp16's loss scaling):
    # steps queued behind it must not run
    stop_on_nonfinite: bool = True
    sequence_chunks: int = 1  # each microbatch's units along the sequence (`raypipe.nn.sequence_chunks`)

    @classmethod
    def from_config(cls, c: Any) -> StageSettings:
        """The settings of a `TrainConfig`."""
        return cls(
            microbatches=c.microbatches * c.sequence_chunks,
            optimizer=dict(c.optimizer),
            lr_schedule=dict(c.lr_schedule),
            grad_clip=c.grad_clip,
            precision=c.precision,
            boundary_dtype=c.boundary_dtype,
            compress_activations=c.compress_activations,
            compress_gradients=c.compress_gradients,
            activation_checkpointing=c.activation_checkpointing,
            compile=c.compile,
            gradient_hand_on=gradient_hand_on(),
            schedule_spec=(c.schedule, c.pp, c.microbatches, c.chunks, c.extra_warmup, c.sequence_chunks),
            measure_activations=c.measure_activations,
            zero=c.zero,
            dp_bucket_bytes=max(1, int(c.dp_bucket_mb * 2**20)),
            stop_on_nonfinite=stops_on_nonfinite(c),
            sequence_chunks=c.sequence_chunks,
        )


def stops_on_nonfinite(config: Any) -> bool:
    """Whether a non-finite step ends training: nonfinite="error", except under fp16, whose
    loss scaling skips such steps by design."""
    return config.nonfinite == "error" and config.precision != "fp16"
