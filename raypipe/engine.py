"""Runs one training step of a pipeline schedule on the stage actors.

The whole step is submitted at once: every forward and backward in the schedule,
each stage's gradient statistics and its optimizer step. Activations and gradients
travel between actors as Ray object references, never through the driver. Ray runs
one actor's calls in the order this driver submits them, so submitting in the order
of the schedule's simulated run makes each actor execute exactly its own action list,
and every reference an action needs already exists when it is submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from raypipe.errors import ActorDiedError, StageError, StepTimeoutError
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
    actors: Sequence[Any],
    names: Sequence[str],
    schedule: Schedule,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[Any],
    call_id: int,
    step: int,
    timeout: float,
    order: Sequence[Action] | None = None,
) -> StepResult:
    """Submits one step of `schedule` and waits for it.

    Args:
        actors: one StageActor handle per stage; names: their names for messages.
        inputs, targets: one entry per microbatch.
        call_id: a number new to every call; actors drop leftovers of a failed call
            and zero gradients when it changes.
        step: the optimizer step number (drives the learning-rate schedule).
        timeout: seconds without any action finishing before the step is abandoned.
        order: `submission_order(schedule)`, when the caller has it cached.

    Raises:
        StageError: an action failed on an actor (or the actor died).
        StepTimeoutError: nothing finished for `timeout` seconds.
    """
    started = time.perf_counter()
    last = len(actors) - 1
    outputs: dict[Action, ray.ObjectRef] = {}
    for action in order or submission_order(schedule):
        s, m = action.stage, action.microbatch
        actor = actors[s]
        if action.kind == FORWARD:
            x = inputs[m] if s == 0 else outputs[Action(s - 1, FORWARD, m)]
            if s == last:
                outputs[action] = actor.forward.remote(call_id, m, x, targets[m])
            else:
                outputs[action] = actor.forward.remote(call_id, m, x)
        else:
            grad = None if s == last else outputs[Action(s + 1, BACKWARD, m)]
            outputs[action] = actor.backward.remote(call_id, m, grad)
    finished = [outputs[Action(0, BACKWARD, m)] for m in range(len(inputs))]
    stats = [actor.grad_stats.remote(*finished) for actor in actors]
    reports = [actor.optimizer_step.remote(step, *stats) for actor in actors]
    losses = [outputs[Action(last, FORWARD, m)] for m in range(len(inputs))]

    pending_actions = {ref: action for action, ref in outputs.items()}
    for s, ref in enumerate(stats):
        pending_actions[ref] = f"{s}:grad_stats"
    for s, ref in enumerate(reports):
        pending_actions[ref] = f"{s}:optimizer_step"
    _wait_for_progress(pending_actions, names, timeout, step)
    values = gather(losses + reports, f"step {step}", actors, names)
    return StepResult(values[: len(losses)], values[len(losses) :], time.perf_counter() - started)


def run_forward(
    actors: Sequence[Any],
    names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[Any] | None,
    timeout: float,
) -> list[Any]:
    """Forward-only pass of every microbatch through all stages (evaluation, inference).

    Returns:
        Per microbatch: the last stage's loss (when targets are given) or its output.
    """
    results, pending = [], {}
    for m, x in enumerate(inputs):
        ref = x
        for s, actor in enumerate(actors):
            target = targets[m] if targets is not None and s == len(actors) - 1 else None
            ref = actor.forward_only.remote(ref, target)
            pending[ref] = Action(s, FORWARD, m)
        results.append(ref)
    _wait_for_progress(pending, names, timeout, step=-1)
    return gather(results, "inference", actors, names)


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


def _wait_for_progress(
    pending: dict[ray.ObjectRef, Any], names: Sequence[str], timeout: float, step: int
) -> None:
    """Waits until every reference is ready, failing if none finishes for `timeout` s."""
    refs = list(pending)
    while refs:
        ready, refs = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        if not ready and refs:
            stuck = [pending[r] for r in refs]
            by_stage: dict[int, list[str]] = {}
            for item in stuck:
                stage = item.stage if isinstance(item, Action) else int(str(item).split(":")[0])
                by_stage.setdefault(stage, []).append(str(item))
            detail = "; ".join(
                f"{names[s]}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
                for s, items in sorted(by_stage.items())
            )
            for ref in refs:
                ray.cancel(ref, force=False)
            raise StepTimeoutError(
                f"{'inference' if step < 0 else f'step {step}'} made no progress for {timeout:.0f} s (TrainConfig.step_timeout); "
                f"{len(stuck)} actions pending: {detail}"
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
