"""Runs one training step of a pipeline schedule on the stage actors.

The whole step is submitted at once: every forward and backward in the schedule,
each stage's gradient statistics and its optimizer step. Activations and gradients
travel between actors as Ray object references, never through the driver. Ray runs
one actor's calls in the order this driver submits them, so submitting in the order
of the schedule's simulated run makes each actor execute exactly its own action list,
and every reference an action needs already exists when it is submitted.

Under tensor parallelism every action goes to all tp ranks of its stage with the
same inputs; the ranks finish with the same activation, so only rank 0's output
(and input gradient) travels on: the next stage receives one copy, not tp copies.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from raypipe.errors import ActorDiedError, StageError, StepTimeoutError
from raypipe.wire import StepCall, pack, pack_microbatches, unpack

PEER_STOPPED = "stopped: world rank"  # how run_actions words a failure caused by a neighbour's
from raypipe.schedules import BACKWARD, FORWARD, Action, Schedule, simulate


@dataclass
class StepResult:
    """What one step produced: per-microbatch losses and each stage's optimizer report."""

    losses: list[float]
    stage_reports: list[dict[str, Any]]
    seconds: float


def submission_order(schedule: Schedule) -> list[Action]:
    """Actions in the order of the schedule's simulated run (tick by tick, stage by stage)."""
    return [a for row in simulate(schedule, len(schedule)) for a in row if a is not None]


def run_step(
    replicas: Sequence[Sequence[Sequence[Any]]],
    names: Sequence[Sequence[Sequence[str]]],
    schedule: Schedule,
    inputs: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[Sequence[Any]],
    call_id: int,
    step: int,
    timeout: float,
    order: Sequence[Action] | None = None,
) -> StepResult:
    """Submits one step of `schedule` on every data-parallel replica and waits for it.

    Args:
        replicas: per replica, per stage, the StageActor of each tp rank; names: their names.
        inputs, targets: per replica, one entry per microbatch.
        call_id: a number new to every call; actors drop leftovers of a failed call
            and zero gradients when it changes.
        step: the optimizer step number (drives the learning-rate schedule).
        timeout: seconds without any action finishing before the step is abandoned.
        order: `submission_order(schedule)`, when the caller has it cached.

    Raises:
        StageError: an action failed on an actor (ActorDiedError: the actor died).
        StepTimeoutError: nothing finished for `timeout` seconds.
    """
    started = time.perf_counter()
    order = order or submission_order(schedule)
    last = len(schedule) - 1
    pending: dict[ray.ObjectRef, tuple[str, str]] = {}  # (actor, action) of every issued call
    trace = os.environ.get("RAYPIPE_TRACE")
    issued: list[tuple[float, str, str]] = []  # (time, actor, action), only when tracing

    def issue(ref: ray.ObjectRef, name: str, label: str) -> ray.ObjectRef:
        pending[ref] = (name, label)
        if trace:
            issued.append((time.time(), name, label))
        return ref

    losses, finished = [], []
    inputs, targets = pack(inputs), pack(targets)
    for d, stages in enumerate(replicas):
        outputs: dict[Action, ray.ObjectRef] = {}  # tp rank 0's result of each action
        for action in order:
            s, m = action.stage, action.microbatch
            if action.kind == FORWARD:
                x = inputs[d][m] if s == 0 else outputs[Action(s - 1, FORWARD, m)]
                args = (call_id, m, x, targets[d][m]) if s == last else (call_id, m, x)
                refs = [actor.forward.remote(*args) for actor in stages[s]]
            else:
                grad = None if s == last else outputs[Action(s + 1, BACKWARD, m)]
                refs = [actor.backward.remote(call_id, m, grad) for actor in stages[s]]
                if s == 0:
                    finished += refs
            outputs[action] = refs[0]
            for t, ref in enumerate(refs):
                issue(ref, names[d][s][t], str(action))
        losses += [outputs[Action(last, FORWARD, m)] for m in range(len(inputs[d]))]
    flat = [
        (actor, names[d][s][t])
        for d, stages in enumerate(replicas)
        for s, ranks in enumerate(stages)
        for t, actor in enumerate(ranks)
    ]
    if len(replicas) > 1:  # queued right behind each stage's own last backward
        for actor, name in flat:
            issue(actor.reduce_gradients.remote(), name, "reduce_gradients")
    stats = [issue(actor.grad_stats.remote(*finished), name, "grad_stats") for actor, name in flat]
    reports = [issue(actor.optimizer_step.remote(step, *stats), name, "optimizer_step") for actor, name in flat]
    what = f"step {step + 1}"  # 1-based, as the step's metrics report it
    if trace:
        write_trace(trace, step + 1, issued)
    _wait_for_progress(pending, timeout, what)
    actors = [a for a, _ in flat]
    values = gather(losses + reports, what, actors, [n for _, n in flat])
    return StepResult(values[: len(losses)], values[len(losses) :], time.perf_counter() - started)


def submit_step_p2p(
    replicas: Sequence[Sequence[Sequence[Any]]],
    names: Sequence[Sequence[Sequence[str]]],
    ranks: Sequence[Sequence[Sequence[int]]],
    schedule: Schedule,
    inputs: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[Sequence[Any]],
    call_id: int,
    step: int,
    timeout: float,
    after: int | None = None,
    compiled: Any = None,
) -> "SubmittedStep":
    """Sends one step of `schedule` with one call per actor ("p2p" engine) and returns
    without waiting for it; `result()` waits.

    Each actor gets its stage's whole action list (`StageActor.run_actions`) and
    exchanges activations and gradients directly with its neighbours (`raypipe.p2p`),
    so no boundary tensor and no per-action call goes through the driver. tp rank t
    of a stage talks to tp rank t of the next (their activations are identical).
    The gradient reduction and the optimizer step end the same call: the actors agree
    on the global norm, non-finite values and failures with one all-reduce, so a step
    costs one round of Ray calls. Arguments as `run_step`, plus `ranks`: the world rank
    of every actor, same shape as `replicas`.

    `after`: the call id of a step still running on the same actors, which this one
    queues behind. The actors run this step only if that one was applied: a step that
    failed, or (with `StageSettings.stop_on_nonfinite`) skipped a non-finite update,
    makes every actor answer the steps queued behind it with `{"halted": True}`
    instead, so a failure leaves the weights of the last good step.

    `compiled`: a `raypipe.compiled.CompiledStep` over the same actors, to issue the
    calls through it ("compiled" engine); that step is run in full before this returns.
    """
    started = time.perf_counter()
    lists = action_lists(replicas, names, ranks, schedule)
    trace_lists(step, schedule, names)
    what = f"step {step + 1}"
    if compiled is not None:
        values = compiled.run(lists, inputs, targets, call_id, step, timeout, what)
        return SubmittedStep([], what, timeout, started, values)
    last = max(lst.stage for lst in lists)
    batches = []
    for d, stages in enumerate(replicas):
        # by value (Ray inlines small arguments), or stored once when several tp ranks read it
        batch, labels = pack_microbatches(list(inputs[d])), pack_microbatches(list(targets[d]))
        if len(stages[0]) > 1:
            batch, labels = ray.put(batch), ray.put(labels)
        batches.append((batch, labels))
    runs = []
    for lst in lists:
        batch, labels = batches[lst.replica]
        ref = lst.actor.run_actions.remote(StepCall(
            call_id, step, lst.actions, batch if lst.stage == 0 else None, labels if lst.stage == last else None,
            lst.prev_rank, lst.next_rank, after))
        runs.append((ref, lst))
    return SubmittedStep(runs, what, timeout, started)


class SubmittedStep:
    """A p2p step whose calls are out; `result()` waits for them. `values`: the actors'
    results, when the step already ended (a compiled graph's)."""

    def __init__(self, runs: list[tuple[ray.ObjectRef, "ActionList"]], what: str, timeout: float,
                 started: float, values: list[Any] | None = None) -> None:
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
        _wait_for_progress(pending, self.timeout, self.what,
                           on_ready=lambda ready: _raise_if_died(ready, deaths, self.what))
        values, errors = [], []
        for ref, lst in self.runs:  # every result once; a failure is kept until all are read
            try:
                values.extend(gather([ref], self.what, [lst.actor], [lst.name]))
            except (StageError, ActorDiedError) as error:
                errors.append(error)
        if errors:
            raise root_failure(errors)
        return _step_result(values, time.perf_counter() - max(self.started, since))


def _step_result(values: Sequence[Any], seconds: float) -> StepResult:
    # values are in world-rank order (replica, stage, tp rank); the last stage's tp rank 0 has the losses
    step_losses = [loss for replica_losses, _ in values if replica_losses is not None for loss in replica_losses]
    return StepResult(step_losses, [report for _, report in values], seconds)


@dataclass
class ActionList:
    """One actor's share of a step: its stage's actions and its neighbours' world ranks."""

    replica: int
    stage: int
    actor: Any
    name: str
    actions: list[tuple[str, int]]
    prev_rank: int | None
    next_rank: int | None
    label: str


def action_lists(replicas: Sequence[Sequence[Sequence[Any]]], names: Sequence[Sequence[Sequence[str]]],
                 ranks: Sequence[Sequence[Sequence[int]]], schedule: Schedule) -> list[ActionList]:
    """Every actor's action list, in world-rank order (replica, stage, tp rank). tp rank t of
    a stage exchanges tensors with tp rank t of its neighbours (their activations are identical)."""
    last = len(schedule) - 1
    lists = []
    for d, stages in enumerate(replicas):
        for s, actors in enumerate(stages):
            actions = [(a.kind, a.microbatch) for a in schedule[s]]
            label = ", ".join(str(a) for a in schedule[s])
            for t, actor in enumerate(actors):
                prev = ranks[d][s - 1][t] if s > 0 else None
                nxt = ranks[d][s + 1][t] if s < last else None
                lists.append(ActionList(d, s, actor, names[d][s][t], actions, prev, nxt, label))
    return lists


def trace_lists(step: int, schedule: Schedule, names: Sequence[Sequence[Sequence[str]]]) -> None:
    """With RAYPIPE_TRACE set: each actor's actions as issued (all at once), then its optimizer step."""
    trace = os.environ.get("RAYPIPE_TRACE")
    if not trace:
        return
    now = time.time()
    issued: list[tuple[float, str, str]] = []
    for stages in names:
        for s, tp_names in enumerate(stages):
            for name in tp_names:
                issued += [(now, name, str(a)) for a in schedule[s]]
                issued.append((now, name, "optimizer_step"))
    write_trace(trace, step + 1, issued)


def root_failure(errors: Sequence[Exception]) -> Exception:
    """Of the errors the actors of one step raised, the stage that failed first, not the
    neighbours it stopped."""
    return next((e for e in errors if PEER_STOPPED not in str(e)), errors[0])


def write_trace(path: str, step: int, issued: Sequence[tuple[float, str, str]]) -> None:
    """Appends one JSON line per issued call: {"ts", "step", "actor", "action"}, in issue order."""
    with open(path, "a") as f:
        for ts, actor, action in issued:
            f.write(json.dumps({"ts": ts, "step": step, "actor": actor, "action": action}) + "\n")


def run_forward(
    stages: Sequence[Sequence[Any]],
    names: Sequence[Sequence[str]],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[Any] | None,
    timeout: float,
) -> list[Any]:
    """Forward-only pass of every microbatch through all stages (evaluation, inference).

    `stages` holds each stage's tp ranks; every rank runs, rank 0's output goes on.

    Returns:
        Per microbatch: the last stage's loss (when targets are given) or its output.
    """
    results, pending = [], {}
    inputs, targets = pack(inputs), pack(targets)
    for m, x in enumerate(inputs):
        ref = x
        for s, ranks in enumerate(stages):
            target = targets[m] if targets is not None and s == len(stages) - 1 else None
            refs = [actor.forward_only.remote(ref, target) for actor in ranks]
            for t, r in enumerate(refs):
                pending[r] = (names[s][t], str(Action(s, FORWARD, m)))
            ref = refs[0]
        results.append(ref)
    _wait_for_progress(pending, timeout, "inference")
    flat = [a for ranks in stages for a in ranks]
    return unpack(gather(results, "inference", flat, [n for ranks in names for n in ranks]))


def gather(
    refs: Sequence[ray.ObjectRef], what: str, actors: Sequence[Any] = (), names: Sequence[str] = ()
) -> list[Any]:
    """ray.get that turns actor-side failures into a StageError carrying the stage's own message.

    A dead actor becomes an ActorDiedError naming it (from `actors` and `names`) and
    Ray's account of why it died.
    """
    try:
        return ray.get(list(refs))
    except StageError as error:  # raised by an actor; Ray re-raises it as this type
        raise StageError(_cause_message(error)) from None
    except ray.exceptions.RayActorError as error:
        by_id = {a._actor_id.hex(): n for a, n in zip(actors, names)}
        name = by_id.get(getattr(error, "actor_id", None) or "", "a stage actor")
        lines = [line.strip() for line in str(error).splitlines()]
        cause = " ".join(line for line in lines[1:] if line and ":" not in line[:12]) or lines[0]
        raise ActorDiedError(f"{name} died during {what}: {cause}", actor=name, cause=cause) from None
    except ray.exceptions.RayTaskError as error:
        raise StageError(f"{what} failed: {_cause_message(error)}") from None


def _raise_if_died(ready: Sequence[ray.ObjectRef], actors: dict[ray.ObjectRef, tuple[Any, str]], what: str) -> None:
    """Raises ActorDiedError at once when one of `actors`' calls ended with its actor's death:
    its neighbours would otherwise wait for it until the collective timeout."""
    for ref in ready:
        if ref in actors:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                actor, name = actors[ref]
                gather([ref], what, [actor], [name])
            except Exception:  # noqa: BLE001 - other failures are reported once all lists are done
                pass


def _wait_for_progress(pending: dict[ray.ObjectRef, tuple[str, str]], timeout: float, what: str,
                       on_ready: Any = None) -> None:
    """Waits until every reference is ready, failing if none finishes for `timeout` s.

    `pending` maps each reference to (actor name, action label) for the error message;
    `on_ready(refs)`, when given, sees every reference as soon as it is ready.
    """
    refs = list(pending)
    while refs:
        ready, refs = ray.wait(refs, num_returns=1 if on_ready else len(refs), timeout=timeout, fetch_local=False)
        if on_ready is not None:
            on_ready(ready)
        if not ready and refs:
            by_actor: dict[str, list[str]] = {}
            for ref in refs:
                name, label = pending[ref]
                by_actor.setdefault(name, []).append(label)
            detail = "; ".join(
                f"{name}: {', '.join(labels[:8])}{' ...' if len(labels) > 8 else ''}"
                for name, labels in by_actor.items()
            )
            for ref in refs:
                ray.cancel(ref, force=False)
            raise StepTimeoutError(
                f"{what} made no progress for {timeout:.0f} s (TrainConfig.step_timeout); "
                f"{len(refs)} actions pending: {detail}"
            )


def _cause_message(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return str(cause) if isinstance(cause, StageError) else f"{type(cause).__name__}: {cause}"
    return last_line(error)


def last_line(error: BaseException) -> str:
    """The last line of an error's text: Ray puts the remote traceback first, the cause last."""
    text = str(error).strip()
    line = text.splitlines()[-1] if text else type(error).__name__
    return line.removeprefix("raypipe.errors.StageError: ")
