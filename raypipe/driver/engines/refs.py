"""The "refs" engine: one Ray call per forward and backward, boundaries as object references.

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

import time

import ray

from raypipe.core import env
from raypipe.driver.engines.step_io import StepInput, StepResult, StepTarget
from raypipe.driver.results import gather, wait_for_progress
from raypipe.driver.trace import write_trace
from raypipe.schedules import BACKWARD, FORWARD, Action, Schedule, simulate
from raypipe.transport.wire import pack


def submission_order(schedule: Schedule) -> list[Action]:
    """Actions in the order of the schedule's simulated run (tick by tick, stage by stage)."""
    return [a for row in simulate(schedule, len(schedule)) for a in row if a is not None]


def run_step(target: StepTarget, data: StepInput) -> StepResult:
    """Submits one step of `target.schedule` on every data-parallel replica and waits for it.

    Every forward and backward of `target.order` (the schedule's simulated run) is one
    call; `data.call_id` is new to every call, so actors drop leftovers of a failed call
    and zero gradients when it changes.

    Raises:
        StageError: an action failed on an actor (ActorDiedError: the actor died).
        StepTimeoutError: nothing finished for `data.timeout` seconds.
    """
    started = time.perf_counter()
    replicas, names, schedule, order = target.replicas, target.names, target.schedule, target.order
    call_id, step, timeout = data.call_id, data.step, data.timeout
    last = len(schedule) - 1
    pending: dict[ray.ObjectRef, tuple[str, str]] = {}  # (actor, action) of every issued call
    trace = env.trace_path()
    issued: list[tuple[float, str, str]] = []  # (time, actor, action), only when tracing

    def issue(ref: ray.ObjectRef, name: str, label: str) -> ray.ObjectRef:
        pending[ref] = (name, label)
        if trace:
            issued.append((time.time(), name, label))
        return ref

    losses, finished = [], []
    inputs, targets = pack(data.inputs), pack(data.targets)
    for d, stages in enumerate(replicas):
        outputs: dict[Action, ray.ObjectRef] = {}  # tp rank 0's result of each action
        for action in order:
            s, m = action.stage, action.microbatch
            if action.kind == FORWARD:
                x = inputs[d][m] if s == 0 else outputs[Action(s - 1, FORWARD, m)]
                weight = data.weights[d][m] if data.weights is not None else 1.0
                args = (call_id, m, x, targets[d][m], weight) if s == last else (call_id, m, x)
                refs: list[ray.ObjectRef] = [actor.forward.remote(*args) for actor in stages[s]]
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
    wait_for_progress(pending, timeout, what)
    actors = [a for a, _ in flat]
    values = gather(losses + reports, what, actors, [n for _, n in flat])
    return StepResult(values[: len(losses)], values[len(losses) :], time.perf_counter() - started)
