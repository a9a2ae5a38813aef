"""The "p2p" engine on the driver: one call per actor per step carrying its whole action list;
boundary tensors then go actor to actor (`raypipe.transport`), never through the driver.
`compiled` issues the same calls through a Ray Compiled Graph."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from raypipe.core.errors import ActorDiedError, StageError
from raypipe.core.protocol import StepCall, StepReport
from raypipe.driver.engines.step_io import StepInput, StepResult, StepTarget
from raypipe.driver.results import gather, raise_if_died, root_failure, wait_for_progress
from raypipe.driver.trace import trace_lists
from raypipe.schedules import Schedule, owners

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def submit_step_p2p(
    target: StepTarget, data: StepInput, after: int | None = None, compiled: Any = None
) -> SubmittedStep:
    """Sends one step of `target.schedule` with one call per actor ("p2p" engine) and returns
    without waiting for it; `result()` waits.

    Each actor gets its stage's whole action list (`StageActor.run_actions`) and
    exchanges activations and gradients directly with its neighbours (`raypipe.transport`),
    so no boundary tensor and no per-action call goes through the driver. tp rank t
    of a stage talks to tp rank t of the next (their activations are identical).
    The gradient reduction and the optimizer step end the same call: the actors agree
    on the global norm, non-finite values and failures with one all-reduce, so a step
    costs one round of Ray calls.

    `after`: the call id of a step still running on the same actors, which this one
    queues behind. The actors run this step only if that one was applied: a step that
    failed, or (with `StageSettings.stop_on_nonfinite`) skipped a non-finite update,
    makes every actor answer the steps queued behind it with `StepReport(halted=True)`
    instead, so a failure leaves the weights of the last good step.

    `compiled`: a `raypipe.driver.engines.compiled.CompiledStep` over the same actors, to issue the
    calls through it ("compiled" engine); that step is run in full before this returns.
    """
    started = time.perf_counter()
    replicas, names, schedule = target.replicas, target.names, target.schedule
    call_id, step, timeout = data.call_id, data.step, data.timeout
    lists = action_lists(replicas, names, target.ranks, schedule)
    trace_lists(step, schedule, names)
    what = f"step {step + 1}"
    if compiled is not None:
        values = compiled.run(lists, data, what)
        return SubmittedStep([], what, timeout, started, values)
    batches = []
    for (batch, labels), stages in zip(data.packed_batches(), replicas):
        # by value (Ray inlines small arguments), or stored once when several tp ranks read it
        if len(stages[0]) > 1 and not isinstance(batch, ray.ObjectRef):
            batch, labels = ray.put(batch), ray.put(labels)
        batches.append((batch, labels))
    runs = []
    for lst in lists:
        ref = lst.actor.run_actions.remote(
            StepCall.for_stage(
                call_id=call_id,
                step=step,
                actions=lst.actions,
                peers=lst.peers,
                batch=batches[lst.replica],
                weights=data.weights[lst.replica] if data.weights is not None else None,
                varying=data.varying,
                holds_first=lst.holds_first,
                holds_last=lst.holds_last,
                after=after,
            )
        )
        runs.append((ref, lst))
    return SubmittedStep(runs, what, timeout, started)


class SubmittedStep:
    """A p2p step whose calls are out; `result()` waits for them. `values`: the actors'
    results, when the step already ended (a compiled graph's)."""

    def __init__(
        self,
        runs: list[tuple[ray.ObjectRef, ActionList]],
        what: str,
        timeout: float,
        started: float,
        values: list[Any] | None = None,
    ) -> None:
        self.runs, self.what, self.timeout, self.started, self.values = runs, what, timeout, started, values

    def result(self, since: float = 0.0) -> StepResult:
        """Waits for every actor's call and returns the step's result; `seconds` counts
        from the later of the submission and `since` (when the step queued behind another,
        the moment that one's result came back).

        Raises:
            StageError: a stage failed (the root cause, not the neighbours it stopped).
            ActorDiedError: an actor died, raised as soon as its call ends.
            StepTimeoutError: no call finished for `timeout` s.
        """
        if self.values is not None:
            return _step_result(self.values, time.perf_counter() - max(self.started, since))
        pending = {ref: (lst.name, lst.label) for ref, lst in self.runs}
        deaths = {ref: (lst.actor, lst.name) for ref, lst in self.runs}
        wait_for_progress(
            pending, self.timeout, self.what, on_ready=lambda ready: raise_if_died(ready, deaths, self.what)
        )
        values, errors = [], []
        for ref, lst in self.runs:  # every result once; a failure is kept until all are read
            try:
                values.extend(gather([ref], self.what, [lst.actor], [lst.name]))
            except (StageError, ActorDiedError) as error:
                errors.append(error)
        if errors:
            raise root_failure(errors)
        return _step_result(values, time.perf_counter() - max(self.started, since))


def _step_result(reports: Sequence[StepReport], seconds: float) -> StepResult:
    # reports are in world-rank order (replica, stage, tp rank); the last stage's tp rank 0 has the losses
    step_losses = [loss for report in reports if report.losses is not None for loss in report.losses]
    return StepResult(step_losses, list(reports), seconds)


@dataclass
class ActionList:
    """One actor's share of a step: its actions as (kind, microbatch, virtual stage), and the world
    rank holding each virtual stage for its replica and tp rank."""

    replica: int
    stage: int
    actor: ActorHandle
    name: str
    actions: list[tuple[str, int, int]]
    peers: list[int]
    label: str
    holds_first: bool
    holds_last: bool


def action_lists(
    replicas: Sequence[Sequence[Sequence[Any]]],
    names: Sequence[Sequence[Sequence[str]]],
    ranks: Sequence[Sequence[Sequence[int]]],
    schedule: Schedule,
) -> list[ActionList]:
    """Every actor's action list, in world-rank order (replica, stage, tp rank). tp rank t of
    a stage exchanges tensors with tp rank t of its neighbours (their activations are identical)."""
    owner = owners(schedule)
    last = len(owner) - 1
    lists = []
    for d, stages in enumerate(replicas):
        for s, actors in enumerate(stages):
            actions = [(a.kind, a.microbatch, a.stage) for a in schedule[s]]
            label = ", ".join(str(a) for a in schedule[s])
            for t, actor in enumerate(actors):
                peers = [ranks[d][owner[v]][t] for v in range(last + 1)]
                lists.append(
                    ActionList(d, s, actor, names[d][s][t], actions, peers, label, owner[0] == s, owner[last] == s)
                )
    return lists
