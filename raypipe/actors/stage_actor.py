"""The StageActor: one pipeline stage in its own Ray actor process, a thin Ray-facing shell.

What a stage holds and does lives in plain parts, each usable without Ray: the `Stage`
(`stage.py`: model, executor, optimizer state; `Stage.step(call) -> StepReport`), and the calls
on it grouped by what they serve: `StateCalls` (weights, checkpoints, hand-overs), `RefsCalls`
(the refs engine's one call per action), `InferenceCalls` (predict, generate) and `ActorRuns`
(runs of steps the actors drive). Each of the actor's methods is one of theirs (`_call`); what
is the actor's own is what needs Ray or the process: its info (the node it runs on), its threads,
the world's rendezvous, a step's batch resolved from Ray's references, the compiled graph's node.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from raypipe.actors.inference_passes import InferenceCalls
from raypipe.actors.stage import Stage
from raypipe.actors.state_calls import StateCalls
from raypipe.actors.step.refs_calls import RefsCalls
from raypipe.actors.step.run_loop import ActorRuns
from raypipe.core.errors import StageError
from raypipe.core.protocol import ActorInfo, ActorSpec, CompiledCall, StepCall, StepReport
from raypipe.transport.probe import probe_link

__all__ = ["StageActor"]


def _call(part: str, method: Callable) -> Callable:
    """The actor method that is `method` of its part `part` (docstring and signature kept)."""

    @functools.wraps(method)
    def call(self: StageActor, *args: object, **kwargs: object) -> object:
        return method(getattr(self, part), *args, **kwargs)

    return call


class StageActor:
    """Holds layers of the model (`spec`: which, where, with what) and runs their forward and backward."""

    def __init__(self, spec: ActorSpec) -> None:
        self.stage = Stage(spec)
        self.state = StateCalls(self.stage)
        self.refs = RefsCalls(self.stage)
        self.inference = InferenceCalls(self.stage)
        self.runs = ActorRuns(self.stage, self.run_actions, self.state.save_checkpoint)

    def __repr__(self) -> str:  # Ray's dashboard and logs show this as the actor's repr
        if not hasattr(self, "stage"):
            return "StageActor(starting)"
        ranges = " + ".join(f"[{a}, {b})" for a, b in self.stage.model.ranges())
        return f"StageActor({self.stage.name}, layers {ranges})"

    # ----- set-up: the actor's own ----------------------------------------------------

    def info(self) -> ActorInfo:
        """Where this actor runs and what it holds (also proves the actor started)."""
        import ray

        return self.stage.info(ray.get_runtime_context().get_node_id())

    def set_threads(self, threads: int) -> int:
        """Computes with `threads` torch intra-op threads from now on; returns how many it has."""
        torch.set_num_threads(threads)
        return torch.get_num_threads()

    def probe_link(self, peer: int, first: bool) -> dict[str, object]:
        """Measures the link to world rank `peer` together with it (`transport.probe`)."""
        return probe_link(peer, first)

    join = _call("stage", Stage.join)
    configure = _call("stage", Stage.configure)

    # ----- one step: the p2p and compiled engines' call --------------------------------

    def run_actions(self, call: StepCall) -> StepReport:
        """`Stage.step` on `call` with its batch's references resolved (stored once for several tp
        ranks, the batch reaches the actor as references inside the call: Ray resolves only
        top-level ones)."""
        import ray

        inputs, targets = (ray.get(v) if isinstance(v, ray.ObjectRef) else v for v in (call.inputs, call.targets))
        return self.stage.step(dataclasses.replace(call, inputs=inputs, targets=targets))

    def run_compiled(self, call: CompiledCall) -> StepReport | StageError:
        """`run_actions` as a node of the trainer's compiled graph ("compiled" engine):
        the call holds every actor's list and every replica's batch; this actor runs its own.

        Returns `run_actions`' result, or the exception it raised: a compiled graph reports
        one node's exception as every node's, and the driver needs each actor's own to
        name the stage that failed first."""
        stage = self.stage
        try:
            return self.run_actions(call.for_actor(stage.name, stage.optim.dp_rank, stage.holds_first, stage.is_last))
        except Exception as error:  # noqa: BLE001 - handed to the driver, which raises it
            return (
                error if isinstance(error, StageError) else StageError(f"{stage.name}: {type(error).__name__}: {error}")
            )

    run_steps = _call("runs", ActorRuns.run_steps)
    request_stop = _call("runs", ActorRuns.request_stop)

    # ----- the refs engine: one call per action ----------------------------------------

    forward = _call("refs", RefsCalls.forward)
    backward = _call("refs", RefsCalls.backward)
    reduce_gradients = _call("refs", RefsCalls.reduce_gradients)
    grad_stats = _call("refs", RefsCalls.grad_stats)
    optimizer_step = _call("refs", RefsCalls.optimizer_step)

    # ----- inference ---------------------------------------------------------------------

    forward_only = _call("inference", InferenceCalls.forward_only)
    decode = _call("inference", InferenceCalls.decode)
    end_generation = _call("inference", InferenceCalls.end_generation)
    capture_reference = _call("inference", InferenceCalls.capture_reference)

    # ----- state: weights, checkpoints, hand-overs -----------------------------------------

    save_tensors = _call("state", StateCalls.save_tensors)
    adapters = _call("state", StateCalls.adapters)
    peft_adapters = _call("state", StateCalls.peft_adapters)
    load_peft_adapters = _call("state", StateCalls.load_peft_adapters)
    load_adapters = _call("state", StateCalls.load_adapters)
    hold_weights = _call("state", StateCalls.hold_weights)
    state_dict = _call("state", StateCalls.state_dict)
    tensor_shards = _call("state", StateCalls.tensor_shards)
    load_state_dict = _call("state", StateCalls.load_state_dict)
    gradients = _call("state", StateCalls.gradients)
    hand_over = _call("state", StateCalls.hand_over)
    take_over = _call("state", StateCalls.take_over)
    save_checkpoint = _call("state", StateCalls.save_checkpoint)
    read_text = _call("state", StateCalls.read_text)
    check_checkpoint = _call("state", StateCalls.check_checkpoint)
    verify_checkpoint = _call("state", StateCalls.verify_checkpoint)
    check_state_dict = _call("state", StateCalls.check_state_dict)
    load_checkpoint = _call("state", StateCalls.load_checkpoint)
    restore_reference = _call("state", StateCalls.restore_reference)
