"""The StageActor: one pipeline stage, living in its own Ray actor process.

It builds only its own layers, runs forward and backward per microbatch when the
engine asks, keeps each microbatch's activations exactly until its backward, and
steps its optimizer from global gradient statistics that every stage receives, so
all stages agree on clipping and fp16 overflow without a driver round trip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raypipe.runtime.transport import agree
from raypipe.actors import zero
from raypipe.actors.memory import count_saved_bytes, max_rss_bytes
from raypipe.devices import SERVING_ENV
from raypipe.errors import StageError
from raypipe.layers import LayerSpec, build_layer
from raypipe.nn import TensorParallelGroup, merge, parallelize, shard, shard_specs
from raypipe.nn.group import building
from raypipe.runtime.transport import PeerFailed
from raypipe.optim import LossScaler, build_optimizer, learning_rate
from raypipe.runtime.transport.wire import StepCall, pack, unpack

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StageSettings:
    """What a running trainer may change between steps without rebuilding actors."""

    microbatches: int
    optimizer: dict
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    grad_clip: float | None = None
    precision: str = "fp32"
    boundary_dtype: str = "fp32"
    activation_checkpointing: bool = False
    measure_activations: bool = False
    zero: int = 0
    dp_bucket_bytes: int = 25 * 2**20
    # a non-finite step ends training (TrainConfig.nonfinite="error", not fp16's loss scaling):
    # steps queued behind it must not run
    stop_on_nonfinite: bool = True


class StageActor:
    """Holds layers [start, end) of the model and runs their forward and backward.

    Args:
        stage: this stage's index; num_stages: the pipeline depth.
        specs: the specs of layers [start, start + len(specs)).
        start: global index of the first layer, used for seeds and state_dict keys.
        seed: the run seed.
        threads: torch intra-op threads for this process.
        loss_fn: `loss_fn(output, target) -> scalar`, given to the last stage only.
        name: the actor's name, used in error messages.
        dp_rank, dp_size: this actor's place among the data-parallel replicas of its stage.
        tp_rank, tp_size: its place in the stage's tensor-parallel group; layers with a
            `tp_plan` keep this rank's shard, the others are replicated.
        device_kind: "cpu", "cuda", "rocm" or "mps", what the stage was placed for.
        allow_cpu_fallback: run on the CPU when the node has no such device.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        specs: Sequence[LayerSpec],
        start: int,
        seed: int,
        threads: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        name: str,
        dp_rank: int = 0,
        dp_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        device_kind: str = "cpu",
        allow_cpu_fallback: bool = False,
    ) -> None:
        torch.set_num_threads(threads)
        self.stage, self.num_stages, self.start, self.name = stage, num_stages, start, name
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.dp_group, self.dp_ranks = None, [0]
        self.shm_peers: list[int] = []  # neighbours' world ranks linked through shared memory (`join`)
        self.agrees_through_pipes = False  # the step's closing all-reduce: pipes on one node, else gloo (`join`)
        self.tp = TensorParallelGroup(tp_rank, tp_size)
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.device_kind = device_kind
        os.environ[SERVING_ENV] = device_kind
        self.device, self.fallback = _resolve_device(name, device_kind, allow_cpu_fallback)
        self.module = nn.Sequential(*[self._build(spec, seed, start + j) for j, spec in enumerate(specs)])
        self.module.to(self.device)
        # local state-dict key -> how its tensor splits across tp ranks (absent: replicated)
        self.shard_specs = shard_specs(self.module)
        self.sharded_params = {id(p) for k, p in self.module.named_parameters() if k in self.shard_specs}
        # the parameters, listed once (walking the module tree costs ~0.15 ms a time); they stay the
        # same objects for the actor's life: loading a state dict copies into them
        self.params = list(self.module.parameters())
        # those counted in the global gradient norm: a split parameter's shards each count,
        # a replicated one counts once, on tp rank 0
        self.norm_params = [p for p in self.params if self.tp.rank == 0 or id(p) in self.sharded_params]
        torch.manual_seed(seed * 7919 + stage)  # dropout and other in-forward randomness
        self.settings: StageSettings | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = LossScaler()
        self.current_call = -1
        self.unapplied_call: int | None = None  # the last p2p step whose update was not applied
        self.losses_finite = True
        self.timing: dict[str, float] = {}
        self.events: list[tuple[str, int, float, float]] = []
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stash_bytes: dict[int, int] = {}  # per stashed microbatch, bytes autograd saved for backward

    def __repr__(self) -> str:  # Ray's dashboard and logs show this as the actor's repr
        if not hasattr(self, "module"):
            return "StageActor(starting)"
        return f"StageActor({self.name}, layers [{self.start}, {self.start + len(self.module)}))"

    # ----- set-up -------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Where this actor runs and what it holds (also proves the actor started)."""
        import ray

        return {
            "name": self.name,
            "stage": self.stage,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp.rank,
            "layers": (self.start, self.start + len(self.module)),
            "parameters": sum(p.numel() for p in self.module.parameters()),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": str(self.device),
            "device_kind": self.device_kind,
            "cpu_fallback": self.fallback,
            "threads": torch.get_num_threads(),
            "shm_peers": list(self.shm_peers),
            "agrees_through_pipes": self.agrees_through_pipes,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in self.module.parameters()),
            "optimizer_state_bytes": sum(
                v.numel() * v.element_size()
                for state in (self.optimizer.state.values() if self.optimizer else [])
                for v in state.values() if torch.is_tensor(v)
            ),
        }

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's address and a free port, which every actor then joins."""
        from raypipe.runtime.collective import rendezvous_address

        return rendezvous_address()

    def join(self, address: str, port: int, world_size: int, rank: int,
             groups: list[list[int]], dp_group: list[int], tp_group: list[int], timeout: float,
             backends: list[str] | None = None, neighbours: Sequence[int] = (),
             same_node_transport: str = "shm") -> list[int]:
        """Joins the trainer's torch.distributed world, keeps its dp and tp groups, and links
        to its pipeline `neighbours` (world ranks) on this node through shared memory
        (`raypipe.runtime.transport.shm`) unless `same_node_transport` is "gloo"; with "shm" and the whole
        world on this node, the step's closing agreement goes through pipes (`transport.agree`).

        Returns:
            The neighbours linked through shared memory (the others use gloo).
        """
        from raypipe.runtime.transport import shm
        from raypipe.runtime.collective import join_world

        mine = join_world(address, port, world_size, rank, groups, timeout, backends)
        self.dp_group, self.dp_ranks = mine.get(tuple(dp_group)), list(dp_group)
        self.tp.group, self.tp_ranks = mine.get(tuple(tp_group)), list(tp_group)
        self.shm_peers = shm.connect(rank, neighbours, timeout, enabled=same_node_transport == "shm")
        self.agrees_through_pipes = agree.connect(rank, timeout, enabled=same_node_transport == "shm")
        return self.shm_peers

    def configure(self, settings: StageSettings, reset_optimizer: bool = False) -> None:
        """Applies new settings; keeps optimizer state unless the optimizer kind changes."""
        old = self.settings
        same_kind = old is not None and old.optimizer["name"] == settings.optimizer["name"]
        keep_state = same_kind and not reset_optimizer
        if keep_state and old.zero != settings.zero and self.dp_size > 1:
            # ZeRO switched on or off: every replica of the stage gets the whole state, then
            # keeps its new share (configure runs on every actor, so the group meets here).
            state = self._dp_union(self._optimizer_state_by_param() if self.optimizer is not None else {})
            self.settings = settings
            self.optimizer = None
            params = self._owned_params()
            if params:
                self.optimizer = build_optimizer(params, settings.optimizer)
                names = {p: name for name, p in self.module.named_parameters()}
                for p in params:
                    if names[p] in state:
                        self.optimizer.state[p] = {
                            k: v.to(p.device) if torch.is_tensor(v) and v.shape == p.shape else v
                            for k, v in state[names[p]].items()
                        }
            return
        self.settings = settings
        if not keep_state:
            self.scaler = LossScaler()
        params = self._owned_params()
        if not params:  # parameter-free layers, or (ZeRO) a share that came out empty
            self.optimizer = None
        elif self.optimizer is None or not keep_state:
            self.optimizer = build_optimizer(params, settings.optimizer)
        else:
            for group in self.optimizer.param_groups:
                group.update({k: v for k, v in settings.optimizer.items() if k != "name"})

    # ----- one step -------------------------------------------------------------

    def forward(self, call_id: int, microbatch: int, x: torch.Tensor, target: Any = None) -> Any:
        """Runs the stage on one microbatch and keeps what its backward needs.

        Returns:
            The output activation (detached, in `boundary_dtype`) on inner stages; the
            microbatch's unscaled loss as a float on the last stage. tp ranks other
            than 0 return None: they end with the same activation, and the next stage
            gets one copy.
        """
        self._begin(call_id)
        out = self._forward(microbatch, unpack(x), unpack(target))
        return pack(_to_host(out)) if self.is_last or self.tp.rank == 0 else None

    def backward(self, call_id: int, microbatch: int, grad: torch.Tensor | None = None) -> Any:
        """Back-propagates one microbatch, frees its activations, returns the input gradient
        (None on the first stage, and on tp ranks other than 0)."""
        grad_in = self._backward(microbatch, unpack(grad))
        return pack(_to_host(grad_in)) if self.tp.rank == 0 else None

    def run_actions(self, call: StepCall) -> Any:
        """Runs this stage's whole step ("p2p" engine): its action list `call.actions` in
        order, then the gradient reduction and the optimizer step, agreed on with every
        actor of the world.

        Activations come from world rank `call.prev_rank` and go to `call.next_rank`,
        gradients the other way, through shared memory on one node and gloo between nodes
        (`raypipe.runtime.transport`); stage 0 takes `call.inputs[m]`, the last stage
        `call.targets[m]`. After a failure the actor still
        makes every send and receive of its list (sending poison), so no neighbour
        hangs; then every actor learns through one all-reduce that the step failed, none
        steps its optimizer, and each raises (the failed stage its own error).

        `call.after`: the call id of the step the driver queued this one behind. When that
        step's update was not applied (it failed, or was non-finite and
        `settings.stop_on_nonfinite`), this one does not run either: every actor knows
        it from the same agreement, so all of them answer `(None, {"halted": True})`
        without touching their neighbours.

        Returns:
            (the microbatch losses on the last stage's tp rank 0, else None; the
            optimizer report, as `optimizer_step` returns it).
        """
        import ray

        from raypipe.runtime import transport

        call_id, step, actions, inputs, targets, prev_rank, next_rank, after = call
        if after is not None and after == self.unapplied_call:
            self.unapplied_call = call_id  # and so on down the queue
            return None, {"halted": True}
        self._begin(call_id)
        # stored once for several tp ranks: Ray resolves only top-level references
        inputs, targets = (ray.get(v) if isinstance(v, ray.ObjectRef) else v for v in (inputs, targets))
        inputs, targets = unpack(inputs), unpack(targets)
        forwards = [m for kind, m in actions if kind == "F"]
        backwards = [m for kind, m in actions if kind == "B"]
        activations = transport.inbox(prev_rank, [2 * m for m in forwards]) if self.stage > 0 else None
        gradients = transport.inbox(next_rank, [2 * m + 1 for m in backwards]) if not self.is_last else None
        to_next = transport.outbox(next_rank, len(forwards)) if not self.is_last else None
        to_prev = transport.outbox(prev_rank, len(backwards)) if self.stage > 0 else None
        losses, failure = [], None
        for kind, m in actions:
            if kind == "F":
                out = None
                try:
                    x = inputs[m] if activations is None else activations.take()
                    if failure is None:
                        out = self._forward(m, x, targets[m] if self.is_last else None)
                except Exception as error:  # noqa: BLE001 - kept, raised after the list is done
                    failure = failure or error
                if to_next is None:
                    losses.append(out)
                else:
                    failure = _send_or_poison(to_next, out, 2 * m, failure)
                if activations is not None:
                    activations.refill()
            else:
                grad_in = None
                try:
                    grad = None if gradients is None else gradients.take()
                    if failure is None:
                        grad_in = self._backward(m, grad)
                except Exception as error:  # noqa: BLE001
                    failure = failure or error
                if to_prev is not None:
                    failure = _send_or_poison(to_prev, grad_in, 2 * m + 1, failure)
                if gradients is not None:
                    gradients.refill()
        for box in (to_next, to_prev):
            if box is not None:
                box.wait()
        report = self._finish_step(step, failure)
        return (losses if self.is_last and self.tp.rank == 0 else None), report

    def run_compiled(self, payload: dict[str, Any]) -> Any:
        """`run_actions` as a node of the trainer's compiled graph ("compiled" engine):
        the payload holds every actor's list and every replica's batch; this actor runs its own.

        Returns `run_actions`' result, or the exception it raised: a compiled graph reports
        one node's exception as every node's, and the driver needs each actor's own to
        name the stage that failed first."""
        actions, prev_rank, next_rank = payload["lists"][self.name]
        try:
            return self.run_actions(StepCall(
                payload["call_id"], payload["step"], actions,
                payload["inputs"][self.dp_rank] if self.stage == 0 else None,
                payload["targets"][self.dp_rank] if self.is_last else None, prev_rank, next_rank,
            ))
        except Exception as error:  # noqa: BLE001 - handed to the driver, which raises it
            return error if isinstance(error, StageError) else StageError(f"{self.name}: {type(error).__name__}: {error}")

    def _finish_step(self, step: int, failure: Exception | None) -> dict[str, Any]:
        """Reduces gradients over dp, then agrees with every actor through one all-reduce on
        the global gradient norm, non-finite values and failures (`transport.agree`: pipes when
        the world shares a node, else gloo), and steps (or raises) alike."""
        import torch.distributed as dist

        if self.dp_size > 1:  # a collective: every replica gets here, failed or not
            self.reduce_gradients()
        sq, finite = self.grad_stats() if failure is None else (0.0, True)
        # replicas hold the same reduced gradients: the norm counts replica 0's
        votes = torch.tensor([sq if self.dp_rank == 0 else 0.0, float(not finite), float(failure is not None)],
                             dtype=torch.float64)
        if dist.is_initialized():  # a lone actor (pp = dp = tp = 1) has no world to agree with
            votes = agree.all_sum(votes)
        if votes[2] > 0:
            self.unapplied_call = self.current_call
            self.stash.clear()
            self.stash_bytes.clear()
            if failure is None or isinstance(failure, PeerFailed):
                raise StageError(f"{self.name} stopped: world ranks failed earlier in this step "
                                 f"(see that stage's error)")
            raise failure
        finite = votes[1] == 0
        if not finite and self.settings.stop_on_nonfinite:
            self.unapplied_call = self.current_call
        return self._apply_step(step, math.sqrt(float(votes[0])) if finite else math.nan, bool(finite))

    def _forward(self, microbatch: int, x: torch.Tensor, target: Any) -> Any:
        started = time.time()
        try:
            x = self._received(x)
            if self.stage > 0 and x.is_floating_point():
                x.requires_grad_(True)
            with self._autocast(), count_saved_bytes(self.settings.measure_activations) as saved:
                if self.settings.activation_checkpointing and torch.is_grad_enabled():
                    out = checkpoint(self.module, x, use_reentrant=False)
                else:
                    out = self.module(x)
                if not self.is_last:
                    self._stash(microbatch, (x, out), saved.bytes)
                    self._timed("forward_s", started, microbatch)
                    return self._send(out)
                loss = self.loss_fn(out, target.to(self.device) if torch.is_tensor(target) else target)
            scale = self.scaler.scale if self.settings.precision == "fp16" else 1.0
            self._stash(microbatch, (x, loss.float() * (scale / self.settings.microbatches)), saved.bytes)
            value = float(loss.detach())
            self.losses_finite = self.losses_finite and math.isfinite(value)
            self._timed("forward_s", started, microbatch)
            return value
        except Exception as error:
            raise self._error("F", microbatch, error) from error

    def _backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        started = time.time()
        try:
            x, out = self.stash.pop(microbatch)
            self.stash_bytes.pop(microbatch, None)
            if out.requires_grad:
                torch.autograd.backward(out, None if self.is_last else grad.to(out.device, out.dtype))
            self._timed("backward_s", started, microbatch)
            return self._send(x.grad) if x.requires_grad else None
        except Exception as error:
            raise self._error("B", microbatch, error) from error

    def reduce_gradients(self) -> None:
        """Averages this stage's gradients over its data-parallel replicas, in buckets.

        The engine queues it right after the stage's own last backward, so a stage
        reduces while earlier stages are still running backward. Every replica
        reaches it even when a step failed (it takes no references), so the
        collective never waits for a peer that skipped it.
        """
        params = self._trainable()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        from raypipe.runtime.collective import all_reduce_mean

        all_reduce_mean([p.grad for p in params], self.dp_group, self.dp_size, self.settings.dp_bucket_bytes)

    def grad_stats(self, *finished: Any) -> tuple[float, bool]:
        """Unscales fp16 gradients and returns (sum of squared gradients, all finite).

        `finished` are the first stage's backward results: Ray runs this only once all
        of them succeeded, so a failed step never reaches the optimizer.
        """
        grads = self._grads()
        if self.settings.precision == "fp16" and grads:
            torch._foreach_div_(grads, self.scaler.scale)
        sq = _sum_of_squares([p.grad.detach() for p in self.norm_params if p.grad is not None])
        return sq, math.isfinite(sq) and self.losses_finite

    def optimizer_step(self, step: int, *stats: tuple[float, bool]) -> dict[str, Any]:
        """One optimizer step from every actor's gradient statistics (same on all actors).

        `stats` come replica by replica, each replica's stages in order, each stage's
        tp ranks in order.

        Non-finite statistics (a NaN or infinite gradient or loss anywhere) skip the
        update on every stage alike; under fp16 they also halve the loss scale.
        """
        finite = all(s[1] for s in stats)  # every actor of every replica
        # replicas hold the same (reduced) gradients: the norm comes from the first one's stages
        total_norm = math.sqrt(sum(s[0] for s in stats[: self.num_stages * self.tp.size])) if finite else math.nan
        return self._apply_step(step, total_norm, finite)

    def _apply_step(self, step: int, total_norm: float, finite: bool) -> dict[str, Any]:
        """Clips to the global norm and steps, or skips alike everywhere when not `finite`."""
        settings = self.settings
        lr = learning_rate(step, settings.optimizer["lr"], settings.lr_schedule)
        if settings.precision == "fp16":
            self.scaler.update(found_inf=not finite)
        skipped = not finite
        if not skipped and self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if settings.grad_clip is not None:
                coef = settings.grad_clip / (total_norm + 1e-6)
                grads = self._grads()
                if coef < 1.0 and grads:
                    torch._foreach_mul_(grads, coef)
            self.optimizer.step()
        if not skipped and self._zero_active():
            self._broadcast_owned()
        self.stash.clear()
        self.stash_bytes.clear()
        return {"lr": lr, "grad_norm": total_norm, "skipped": skipped, "loss_scale": self.scaler.scale,
                "timing": dict(self.timing), "events": list(self.events), "peak_memory_bytes": _peak_memory_bytes(self.device)}

    @torch.no_grad()
    def forward_only(self, x: torch.Tensor, target: Any = None) -> Any:
        """Inference through this stage (eval mode, no activations kept).

        Returns the output, or on the last stage the loss as a float when a target is given.
        """
        self.module.eval()
        x, target = unpack(x), unpack(target)
        try:
            with self._autocast():
                out = self.module(self._received(x))
                if self.is_last and target is not None:
                    return float(self.loss_fn(out, target.to(self.device) if torch.is_tensor(target) else target))
            if self.tp.rank != 0:  # the same output as rank 0's, which is the one passed on
                return None
            return pack(_to_host(out.float() if self.is_last else out))
        except Exception as error:
            raise self._error("F", -1, error) from error
        finally:
            self.module.train()

    # ----- weights --------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under global keys (`"<layer index>.<name>"`); this tp rank's shards."""
        return {self._global_key(k): v.detach().clone() for k, v in self.module.state_dict().items()}

    def tensor_shards(self) -> dict[str, tuple[int, int]]:
        """Global key -> (dim, chunks) of every tensor split across tp ranks, for merging."""
        return {self._global_key(k): (spec.dim, spec.chunks) for k, spec in self.shard_specs.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads this stage's full (unsplit) weights from global keys, keeping this rank's shards.

        Every key of the stage must be present.
        """
        local = self._shard_state({self._local_key(k): v for k, v in state.items()})
        result = self.module.load_state_dict(local, strict=False)
        if result.missing_keys or result.unexpected_keys:
            missing = [self._global_key(k) for k in result.missing_keys]
            unexpected = [self._global_key(k) for k in result.unexpected_keys]
            raise StageError(
                f"{self.name}: load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients (as the optimizer used them) under global keys; this rank's shards."""
        return {
            self._global_key(k): p.grad.detach().clone()
            for k, p in self.module.named_parameters()
            if p.grad is not None
        }

    # ----- ZeRO stage 1 -----------------------------------------------------------

    def _zero_active(self) -> bool:
        return bool(self.settings and self.settings.zero) and self.dp_size > 1

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    def _owned_params(self) -> list[nn.Parameter]:
        """The parameters this actor's optimizer steps: all of them, or its ZeRO-1 share."""
        params = self._trainable()
        if not self._zero_active():
            return params
        return [p for p, owner in zip(params, zero.owners(params, self.dp_size)) if owner == self.dp_rank]

    def _broadcast_owned(self) -> None:
        params = self._trainable()
        zero.broadcast_from_owners(params, zero.owners(params, self.dp_size), self.dp_ranks, self.dp_group)

    # ----- checkpoints ------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Writes this stage's layers, their optimizer state and its RNG state.

        Returns:
            {"files": relative path -> {"sha256", "bytes"}, "loss_scaler": {...}}.
        """
        from raypipe import checkpoint as ckpt

        states = self._optimizer_state_by_layer()
        if self._zero_active():  # each replica holds a share: dp rank 0 writes the union
            import torch.distributed as dist

            shares = [None] * self.dp_size if self.dp_rank == 0 else None
            dist.gather_object(states, shares, dst=self.dp_ranks[0], group=self.dp_group)
            if self.dp_rank == 0:
                for share in shares:
                    for index, state in share.items():
                        states[index].update(state)
        if self.dp_rank != 0:  # replicas hold the same weights; replica 0 writes them
            return {"files": {}, "loss_scaler": dataclasses.asdict(self.scaler)}
        models = {self.start + j: layer.state_dict() for j, layer in enumerate(self.module)}
        if self.tp.size > 1:  # tp rank 0 merges the shards: checkpoints hold whole tensors
            models, states = self._merge_tp_shards(models, states)
            if self.tp.rank != 0:
                return {"files": {}, "loss_scaler": dataclasses.asdict(self.scaler)}
        root = Path(directory)
        if not root.is_dir():
            import ray

            raise StageError(
                f"{self.name} on node {ray.get_runtime_context().get_node_id()[:12]} cannot see the "
                f"checkpoint directory {directory}: multi-node runs need a directory every node shares."
            )
        files = {}
        for j in range(len(self.module)):
            index = self.start + j
            files[ckpt.layer_file("model", index)] = ckpt.save_tensors(
                root / ckpt.layer_file("model", index), models[index]
            )
            files[ckpt.layer_file("optim", index)] = ckpt.save_tensors(
                root / ckpt.layer_file("optim", index), states[index]
            )
        rng = f"rng/stage-{self.stage}.pt"
        files[rng] = ckpt.save_tensors(root / rng, {"torch": torch.get_rng_state()})
        return {"files": files, "loss_scaler": dataclasses.asdict(self.scaler)}

    def _merge_tp_shards(self, models: dict[int, dict], states: dict[int, dict]) -> tuple[dict, dict]:
        """Gathers every tp rank's layer weights and optimizer state; rank 0 gets them merged."""
        import torch.distributed as dist

        parts = [None] * self.tp.size if self.tp.rank == 0 else None
        dist.gather_object((models, states), parts, dst=self.tp_ranks[0], group=self.tp.group)
        if self.tp.rank != 0:
            return models, states
        for index in models:
            j = index - self.start
            for name in models[index]:
                spec = self.shard_specs.get(f"{j}.{name}")
                if spec is not None:
                    models[index][name] = merge([p[0][index][name] for p in parts], spec)
            for name, state in states[index].items():
                spec = self.shard_specs.get(f"{j}.{name}")
                for key, value in state.items():
                    if spec is not None and _is_per_element(value):
                        state[key] = merge([p[1][index][name][key] for p in parts], spec)
        return models, states

    def _shard_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors under local keys -> this tp rank's shards (replicated ones unchanged)."""
        if self.tp.size == 1:
            return local
        return {k: shard(v, self.shard_specs[k], self.tp.rank, self.tp.size) if k in self.shard_specs else v
                for k, v in local.items()}

    def _optimizer_state_by_param(self) -> dict[str, dict]:
        """Module parameter name -> optimizer state, for the parameters this actor steps."""
        return {  # per-element state through host memory: the gather pickles it
            name: {k: v.cpu() if torch.is_tensor(v) else v for k, v in self.optimizer.state[p].items()}
            for name, p in self.module.named_parameters()
            if p in self.optimizer.state
        }

    def _dp_union(self, state: dict[str, dict]) -> dict[str, dict]:
        """The union of every dp replica's `state` (each holds a disjoint ZeRO share)."""
        import torch.distributed as dist

        shares: list[Any] = [None] * self.dp_size
        dist.all_gather_object(shares, state, group=self.dp_group)
        union: dict[str, dict] = {}
        for share in shares:
            union.update(share)
        return union

    def _optimizer_state_by_layer(self) -> dict[int, dict[str, dict]]:
        """Global layer index -> parameter name -> optimizer state, for the parameters this actor steps."""
        states: dict[int, dict[str, dict]] = {}
        for j, layer in enumerate(self.module):
            states[self.start + j] = {
                name: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.optimizer.state[p].items()}
                for name, p in layer.named_parameters()
                if self.optimizer is not None and p in self.optimizer.state
            }
        return states

    def load_checkpoint(self, directory: str, loss_scaler: dict, restore_rng: bool) -> None:
        """Loads this stage's layers and optimizer state from a verified checkpoint."""
        from raypipe import checkpoint as ckpt

        root = Path(directory)
        try:
            for j, layer in enumerate(self.module):
                index = self.start + j
                weights = ckpt.load_tensors(root / ckpt.layer_file("model", index))
                layer.load_state_dict(
                    {k[len(f"{j}.") :]: v for k, v in self._shard_state({f"{j}.{k}": v for k, v in weights.items()}).items()}
                )
                state = ckpt.load_tensors(root / ckpt.layer_file("optim", index))
                if self.optimizer is not None:
                    stepped = {p for group in self.optimizer.param_groups for p in group["params"]}
                    for name, p in layer.named_parameters():
                        if p in stepped and name in state:
                            spec = self.shard_specs.get(f"{j}.{name}")
                            self.optimizer.state[p] = {
                                k: shard(v, spec, self.tp.rank, self.tp.size)
                                if spec is not None and self.tp.size > 1 and _is_per_element(v) else v
                                for k, v in state[name].items()
                            }
                        else:
                            self.optimizer.state.pop(p, None)
            if restore_rng:
                torch.set_rng_state(ckpt.load_tensors(root / f"rng/stage-{self.stage}.pt")["torch"])
        except StageError:
            raise
        except Exception as error:
            raise StageError(f"{self.name} could not load {directory}: {type(error).__name__}: {error}") from error
        self.scaler = LossScaler(**loss_scaler)

    # ----- helpers ---------------------------------------------------------------

    def _begin(self, call_id: int) -> None:
        if call_id != self.current_call:
            self.current_call = call_id
            self.losses_finite = True
            self.timing = {"forward_s": 0.0, "backward_s": 0.0, "first_start": math.inf, "last_end": 0.0,
                           "peak_stashed": 0, "sent_bytes": 0}
            if self.settings.measure_activations:
                self.timing["peak_stashed_bytes"] = 0
            self.stash_bytes.clear()
            self.events: list[tuple[str, int, float, float]] = []
            self.stash.clear()
            for p in self.params:  # as module.zero_grad(set_to_none=True), without walking the module tree
                p.grad = None

    def _stash(self, microbatch: int, entry: tuple, saved_bytes: int | None) -> None:
        """Keeps a microbatch for its backward and updates this step's peak count (and bytes, when measured)."""
        self.stash[microbatch] = entry
        self.timing["peak_stashed"] = max(self.timing["peak_stashed"], len(self.stash))
        if saved_bytes is not None:
            self.stash_bytes[microbatch] = saved_bytes
            self.timing["peak_stashed_bytes"] = max(self.timing["peak_stashed_bytes"], sum(self.stash_bytes.values()))

    def _send(self, t: torch.Tensor) -> torch.Tensor:
        """A boundary tensor as it leaves for another stage: detached, in `boundary_dtype`, counted
        in this step's `sent_bytes`. It stays on this stage's device: the p2p engine copies it
        straight into its host message buffer, the refs engine moves it to host (`_to_host`)."""
        t = t.detach()
        dtype = AUTOCAST_DTYPES.get(self.settings.boundary_dtype)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        self.timing["sent_bytes"] = self.timing.get("sent_bytes", 0) + t.numel() * t.element_size()
        return t

    def _received(self, x: torch.Tensor) -> torch.Tensor:
        """A boundary tensor on this stage's device; one sent in a narrower `boundary_dtype` is
        computed on in float32 again."""
        x = x.to(self.device)
        if self.settings.boundary_dtype != "fp32" and x.dtype == AUTOCAST_DTYPES[self.settings.boundary_dtype]:
            x = x.float()
        return x

    def _timed(self, kind: str, started: float, microbatch: int) -> None:
        """Records one action: its duration in this step's totals, and (kind, microbatch,
        start, end) in wall-clock seconds since the epoch for the step's timeline."""
        ended = time.time()
        self.events.append(("F" if kind == "forward_s" else "B", microbatch, started, ended))
        self.timing[kind] += ended - started
        self.timing["first_start"] = min(self.timing["first_start"], started)
        self.timing["last_end"] = ended

    def _autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.settings.precision)
        if dtype is None:  # building a disabled torch.autocast costs ~25 us per action on a slow core
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _build(self, spec: LayerSpec, seed: int, index: int) -> nn.Module:
        """Builds the whole layer under its seed, then keeps this tp rank's shard of it."""
        try:
            with building(self.tp):
                return parallelize(build_layer(spec, seed, index), self.tp)
        except Exception as error:
            raise StageError(f"layer {index} {spec!r} failed to build: {type(error).__name__}: {error}") from error

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _global_key(self, local: str) -> str:
        index, _, rest = local.partition(".")
        return f"{self.start + int(index)}.{rest}"

    def _local_key(self, key: str) -> str:
        index, _, rest = key.partition(".")
        return f"{int(index) - self.start}.{rest}"

    def _error(self, kind: str, microbatch: int, error: Exception) -> StageError:
        if isinstance(error, StageError):
            return error
        return StageError(
            f"{self.name} failed at {self.stage}{kind}{microbatch}: {type(error).__name__}: {error}"
        )


def _sum_of_squares(grads: list[torch.Tensor]) -> float:
    """The sum of squares of all `grads` (one stage: one device), the tensors' norms taken
    together with torch's foreach kernel (for the main job's GPT on CPU: ~0.4 ms a step,
    against ~0.75 through `torch.nn.utils.get_total_norm` and ~1.4 for a pow-and-sum per
    tensor). Narrower dtypes are widened first, so bf16 gradients are measured in float32."""
    if not grads:
        return 0.0
    wide = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads]
    norms = torch.stack(torch._foreach_norm(wide))  # float64 if any gradient is
    return float(torch.linalg.vector_norm(norms).double()) ** 2


def _send_or_poison(box: Any, t: torch.Tensor | None, tag: int, failure: Exception | None) -> Exception | None:
    """Sends `t`, or poison once this step failed (also when `t` cannot be sent); returns the failure."""
    if failure is None:
        try:
            box.send(t, tag)
            return None
        except ValueError as error:  # checked before anything went out
            failure = error
    box.send(None, tag)
    return failure


def _resolve_device(name: str, kind: str, allow_cpu_fallback: bool) -> tuple[torch.device, bool]:
    """The torch device for a stage placed for `kind`, and whether it fell back to the CPU.

    Ray sets the visible devices of cuda/rocm actors, so their device is always cuda:0.
    """
    import ray

    if kind in ("cuda", "rocm") and torch.cuda.is_available():
        return torch.device("cuda", 0), False
    if kind == "mps" and torch.backends.mps.is_available():
        return torch.device("mps"), False
    if kind == "cpu":
        return torch.device("cpu"), False
    if allow_cpu_fallback:
        return torch.device("cpu"), True
    node = ray.get_runtime_context().get_node_id()[:12]
    raise StageError(
        f"{name} was placed for {kind} on node {node}, but torch there sees no {kind} device "
        f"(torch {torch.__version__}, cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)}). "
        f"Install a {kind} build of torch on that node, fix the node's advertised resources "
        f"(`raypipe node-resources`), or set TrainConfig.allow_cpu_fallback=True for a test."
    )


def _to_host(t: Any) -> Any:
    """Boundary tensors cross to other stages (maybe another kind of device) through host
    memory; anything but a device tensor (a loss as a float, None) passes unchanged."""
    return t.cpu() if torch.is_tensor(t) and t.device.type != "cpu" else t


def _is_per_element(value: Any) -> bool:
    """Optimizer state shaped like its parameter (momentum, Adam moments), not a scalar like `step`."""
    return torch.is_tensor(value) and value.dim() > 0


def _peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory: the accelerator's allocator peak, or resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    return max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sys.platform)
