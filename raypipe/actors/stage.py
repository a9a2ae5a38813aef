"""A pipeline stage as a plain object: what one stage actor holds and does in a training step.

`Stage.step(call) -> StepReport` runs the stage's action list (`step_list`, through the
`Executor`), then the step's closing agreement with every actor of the world (`transport.agree`:
the gradient norm, non-finite values, failures, the call every actor ran) and the optimizer's
step (`OptimizerState`), or its skip, alike everywhere. It holds:
- `StageModel` (`stage_model.py`): the layers, built and sharded, weights under global keys;
- `Executor` (`executor.py`): where an action runs, forward and backward against a stash;
- `OptimizerState` (`optimizer.py`): the optimizer, ZeRO shares, fp16 loss scaling, gradient
  statistics;
- what the step's bookkeeping needs: the last applied call and completed steps (`hand_over` reads
  them under `applying`), the last unapplied call (steps queued behind it halt), an actor-driven
  run's stop request.
No Ray here: `StageActor` (`stage_actor.py`) is the Ray shell around it and its other parts
(`StateCalls`, `RefsCalls`, `InferenceCalls`, `ActorRuns`).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import torch

from raypipe.actors.io.replica_io import rewind_running_stats
from raypipe.actors.optim.optimizer import OptimizerState
from raypipe.actors.stage_model import StageModel, gpu_identity, resolve_device
from raypipe.actors.step import step_list
from raypipe.actors.step.compiling import compile_layers, compile_report
from raypipe.actors.step.executor import Executor
from raypipe.actors.step.memory import max_rss_bytes, memory_split
from raypipe.core.devices import SERVING_ENV, usable_cores
from raypipe.core.errors import StageError
from raypipe.core.protocol import (
    ActorInfo,
    ActorSpec,
    PeerStopped,
    StageSettings,
    StepCall,
    StepReport,
    StepTimings,
    WorldSpec,
)
from raypipe.nn import TensorParallelGroup
from raypipe.nn.moe import ExpertParallelGroup, take_step_report
from raypipe.transport import PeerFailed, agree
from raypipe.transport.wire import unpack

__all__ = ["Stage"]


class Stage:
    """Holds layers of the model (`spec`: which, where, with what) and trains them, one step per call."""

    def __init__(self, spec: ActorSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.index, self.num_stages, self.name, self.device_kind = (
            spec.stage,
            spec.num_stages,
            spec.name,
            spec.device_kind,
        )
        # model chunks: (virtual stage, start, end) per range of layers held; one without chunks
        self.chunks = list(spec.chunks) or [(spec.stage, spec.start, spec.start + len(spec.specs))]
        self.num_virtual = spec.num_virtual or spec.num_stages
        held = {v for v, _, _ in self.chunks}
        self.holds_first, self.is_last = 0 in held, self.num_virtual - 1 in held
        os.environ[SERVING_ENV] = spec.device_kind
        self.tp = TensorParallelGroup(spec.tp_rank, spec.tp_size)
        self.tp_ranks, self.ep_ranks = [0], []  # world ranks of its tp and ep groups (`join`)
        self.links: dict[int, str] = {}  # each pipeline neighbour's world rank -> "shm", "gloo" or "nccl" (`join`)
        self.listening: list[str] = []  # "host:port" its world's connections listen on (`join`)
        self.streams: dict[tuple[int, str], object] = {}  # device link streams: (v, "F"/"G") -> (group, device)
        self.agrees_through_pipes = False  # the step's closing all-reduce: pipes on one node, else gloo (`join`)
        device, self.fallback = resolve_device(spec.name, spec.device_kind, spec.allow_cpu_fallback)
        indices = [i for _, a, b in self.chunks for i in range(a, b)]
        self.ep = ExpertParallelGroup(spec.dp_rank % spec.ep_size, spec.ep_size)
        self.model = StageModel(
            spec.specs, indices, spec.seed, device, self.tp, spec.tied, spec.lora, spec.quantize, self.ep
        )
        torch.manual_seed(spec.seed * 7919 + spec.stage)  # dropout and other in-forward randomness
        self.optim = OptimizerState(self.model, spec.dp_rank, spec.dp_size, spec.ep_size)
        local, positions = 0, {}
        for v, a, b in self.chunks:
            positions[v] = (local, local + b - a)
            local += b - a
        self.executor = Executor(
            self.model,
            spec.stage,
            self.is_last,
            spec.loss_fn,
            lambda: self.optim.loss_scale,
            spec.name,
            positions if spec.chunks else None,
            self.num_virtual,
        )
        self.unapplied_call: int | None = None  # the last p2p step whose update was not applied
        self.applied_call = -1  # the call id of the last step whose update it applied (or skipped)
        self.completed = 0  # optimizer steps its weights include: the last applied step's index + 1
        self.applying = threading.Lock()  # an update is atomic to `hand_over`, which another thread runs
        self.last_memory: dict[str, int] = {}  # its last step's peak memory split
        self.current_run: int | None = None  # the first call id of the actor-driven run under way
        self.stop_run: int | None = None  # the run the driver asked to end after its step under way
        self.stop_voted = False  # the last step's agreement: some actor was asked to stop
        self.reference: Any = None  # a preference run's reference policy (`objectives.reference`), once captured

    # ----- set-up -------------------------------------------------------------

    def info(self, node_id: str) -> ActorInfo:
        """Where this stage runs (on Ray's node `node_id`) and what it holds."""
        model = self.model
        return ActorInfo(
            name=self.name,
            stage=self.index,
            dp_rank=self.optim.dp_rank,
            tp_rank=self.tp.rank,
            layers=ranges[0] if len(ranges := model.ranges()) == 1 else ranges,
            virtual_stages=[v for v, _, _ in self.chunks],
            parameters=model.parameter_count(),
            node_id=node_id,
            pid=os.getpid(),
            device=str(model.device),
            gpu=gpu_identity(model.device),
            device_kind=self.device_kind,
            cpu_fallback=self.fallback,
            threads=torch.get_num_threads(),
            cores=usable_cores(),
            dtype=str(model.params[0].dtype).removeprefix("torch.") if model.params else "float32",
            weights_read={k: v for layer in model.module for k, v in getattr(layer, "read_keys", {}).items()},
            shm_peers=[n for n, how in self.links.items() if how == "shm"],
            listening=list(self.listening),
            links=dict(self.links),
            agrees_through_pipes=self.agrees_through_pipes,
            parameter_bytes=model.parameter_bytes(),
            experts={key: moe.held_experts() for key, moe in model.moes.items()},
            trainable_parameters=sum(p.numel() for p in model.trainable()),
            gradient_bytes=model.gradient_bytes(),
            optimizer_state_bytes=self.optim.state_bytes(),
            memory=self.last_memory or memory_split(_peak_memory_bytes(model.device), model, self.optim, 0),
        )

    def join(self, w: WorldSpec) -> list[str]:
        """Joins the trainer's torch.distributed world (`w`), keeps its dp, tp and ep groups and its
        tied weights' groups (the copies start from the first holder's values), and links to its
        pipeline neighbours: on the device where `w.streams` say so, through shared memory on this
        node (`raypipe.transport.shm`) unless `w.same_node_transport` is "gloo", else gloo. With
        "shm" and the whole world on this node, the step's closing agreement goes through pipes
        (`transport.agree`).

        Returns:
            The TCP addresses ("host:port") this actor began listening on as it joined: gloo's
            (and NCCL's) own, for the start log; the rendezvous itself opens none.
        """
        from raypipe.actors import world
        from raypipe.transport.collective import join_world, listening_ports

        before = listening_ports()
        joined = join_world(w.keeper, w.world_size, w.rank, w.groups, w.timeout, w.backends)
        mine = world.by_members(w.groups, joined)
        self.optim.dp_group, self.optim.dp_ranks = mine.get(tuple(sorted(w.dp_group))), list(w.dp_group)
        self.tp.group, self.tp_ranks = mine.get(tuple(sorted(w.tp_group))), list(w.tp_group)
        self.ep.group, self.ep_ranks = mine.get(tuple(sorted(w.ep_group))), list(w.ep_group)
        self.optim.expert_group, self.optim.expert_ranks = mine.get(tuple(sorted(w.expert_group))), list(w.expert_group)
        world.join_tied(self.model, self.optim, w.rank, w.tied_groups, mine)
        linked = world.connect(
            w.rank,
            w.neighbours,
            w.streams,
            joined,
            w.backends or [],
            self.model.device,
            w.same_node_transport,
            w.timeout,
        )
        self.links, self.streams, self.agrees_through_pipes = linked.links, linked.streams, linked.agrees_through_pipes
        self.listening = [f"{host}:{port}" for host, port in sorted(listening_ports() - before)]
        return self.listening

    def configure(self, settings: StageSettings, reset_optimizer: bool = False) -> None:
        """Applies new settings; keeps optimizer state unless the optimizer kind changes."""
        self.optim.configure(settings, reset_optimizer)
        self.executor.configure(settings, self.optim.sharded)
        compile_layers(self.model.module, settings.compile)  # TrainConfig.compile: per layer, in place

    # ----- one step -----------------------------------------------------------------

    def step(self, call: StepCall) -> StepReport:
        """Runs this stage's whole step (the "p2p" engine's call): its action list `call.actions` in
        order, then the gradient reduction and the optimizer step, agreed on with every
        actor of the world.

        Activations come from the actor holding the previous virtual stage (`call.peers`) and
        go to the next one's, gradients the other way, through shared memory on one node and
        gloo between nodes (`raypipe.transport`); the actor holding the first virtual
        stage takes `call.inputs[m]`, the one holding the last `call.targets[m]`. After a failure the actor still
        makes every send and receive of its list (sending poison), so no neighbour
        hangs; then every actor learns through one all-reduce that the step failed, none
        steps its optimizer, and each raises (the failed stage its own error).

        `call.after`: the call id of the step the driver queued this one behind. When that
        step's update was not applied (it failed, or was non-finite and
        `settings.stop_on_nonfinite`), this one does not run either: every actor knows
        it from the same agreement, so all of them answer `StepReport(halted=True)`
        without touching their neighbours.

        Returns:
            The step's report, with the microbatch losses on the last stage's tp rank 0.

        Raises:
            PeerStopped: another actor failed in this step (this one did nothing wrong).
        """
        if call.after is not None and call.after == self.unapplied_call:
            self.unapplied_call = call.call_id  # and so on down the queue
            return StepReport(halted=True)
        self.executor.begin(call.call_id)
        inputs, targets = unpack(call.inputs), unpack(call.targets)
        links = step_list.links_for(
            self.executor, call.actions, call.peers, call.varying, self.num_virtual, self.streams
        )
        losses, failure = step_list.run_list(self.executor, call.actions, inputs, targets, links, weights=call.weights)
        return self.finish_step(call.step, failure, losses if self.is_last and self.tp.rank == 0 else None)

    def finish_step(self, step: int, failure: Exception | None, losses: list[float] | None) -> StepReport:
        """Reduces gradients over dp, then agrees with every actor through one all-reduce on
        the global gradient norm, non-finite values and failures (`transport.agree`: pipes when
        the world shares a node, else gloo), and steps (or raises) alike."""
        import torch.distributed as dist

        optim = self.optim
        if optim.sharded is not None:  # ZeRO-3: the step's last gather (or its failure's) is met
            optim.sharded.end_step(failure is not None)
        optim.reduce_tied()  # collectives: every holder and replica gets here, failed or not
        for p in self.model.tp_summed:  # replicated weights whose input this tp rank holds a share of
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.tp.group)
        if optim.dp_size > 1:
            optim.reduce_gradients()
        sq, finite = optim.grad_stats(self.executor.losses_finite) if failure is None else (0.0, True)
        # each actor's share counts every gradient once (`OptimizerState.norm_share`)
        stop = float(self.current_run is not None and self.stop_run == self.current_run)  # an actor-driven run ends
        call = float(self.executor.current_call)  # every actor must have run the same call: sum and squares tell
        votes = torch.tensor(
            [sq, float(not finite), float(failure is not None), stop, call, call * call], dtype=torch.float64
        )
        if dist.is_initialized():  # a lone actor (pp = dp = tp = 1) has no world to agree with
            votes = agree.all_sum(votes)
        self.stop_voted = bool(votes[3] > 0)
        size = dist.get_world_size() if dist.is_initialized() else 1
        mixed = float(votes[4]) ** 2 != size * float(votes[5])  # equal only when every call id is the same
        if votes[2] > 0 or mixed:
            self.unapplied_call = self.executor.current_call
            self.executor.clear_stash()
            rewind_running_stats(self.executor.running_stats, self.executor.began_from)
            if mixed:
                raise StageError(mixed_calls_message(self.name, self.executor.current_call, float(votes[4]) / size))
            if failure is None or isinstance(failure, PeerFailed):
                raise PeerStopped(
                    f"{self.name} stopped: world ranks failed earlier in this step (see that stage's error)"
                )
            raise failure
        finite = votes[1] == 0
        if not finite and optim.settings.stop_on_nonfinite:
            self.unapplied_call = self.executor.current_call
        return self.apply_step(step, math.sqrt(float(votes[0])) if finite else math.nan, bool(finite), losses)

    def apply_step(self, step: int, total_norm: float, finite: bool, losses: list[float] | None) -> StepReport:
        """The optimizer's step (or skip), and this step's report: timings, events, peak memory."""
        with self.applying:
            report = self.optim.apply_step(step, total_norm, finite)
            if report["skipped"]:  # nothing of the step stays: its forward's buffer updates go too
                rewind_running_stats(self.executor.running_stats, self.executor.began_from)
            self.applied_call, self.completed = self.executor.current_call, step + 1
        executor = self.executor
        peak = _peak_memory_bytes(self.model.device)
        self.last_memory = memory_split(peak, self.model, self.optim, int(executor.timing["peak_activation_bytes"]))
        executor.clear_stash()
        routed = take_step_report(self.model.moes)  # MoE layers' routing, all-to-all
        return StepReport(
            losses=losses,
            objective=list(executor.objective) or None,  # the last stage's (the refs engine's too)
            halted=False,
            lr=report["lr"],
            grad_norm=report["grad_norm"],
            skipped=report["skipped"],
            loss_scale=report["loss_scale"],
            timing=StepTimings(
                **executor.timing,
                **routed,
                compiled=compile_report() if executor.settings.compile else None,
            ),
            events=list(executor.events),
            peak_memory_bytes=peak,
            memory=self.last_memory,
        )


def mixed_calls_message(name: str, call: int, mean: float) -> str:
    """Why a step was refused when the actors' closing agreement joined different calls."""
    return (
        f"{name}: the actors ran different step calls together (this one call {call}, the world's mean "
        f"{mean:.1f}): their messages were mixed, so no actor applied the step and the weights are those "
        f"before it. Steps reached the actors in different orders; a Trainer takes one call at a time, so "
        f"this means calls bypassed it (several drivers on one trainer's actors?)"
    )


def _peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory: the accelerator's allocator peak, or resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    return max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sys.platform)
