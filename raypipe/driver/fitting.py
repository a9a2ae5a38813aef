"""Steps on the driver: submitting one to the engine, booking its result (step count,
metrics, logs, a due checkpoint), and the loop behind `Trainer.fit` - the next step kept
queued at the actors while the driver waits for the current one, recovery after an actor
death, and booking of what is left when the loop stops early."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raypipe.actors.settings import stops_on_nonfinite
from raypipe.checkpoint import layout as ckpt
from raypipe.checkpoint.layout import CheckpointError
from raypipe.data.batches import Prepared, prepare
from raypipe.driver.engines import StepInput, StepTarget, Wait
from raypipe.driver.interrupts import Terminated, sigterm_as_interrupt
from raypipe.driver.recovery import recover
from raypipe.errors import ActorDiedError, NonFiniteError, RaypipeError, StepTimeoutError
from raypipe.loggers import scalars
from raypipe.metrics import RayMetrics, step_metrics
from raypipe.progress import Progress


@dataclass
class Submitted:
    """A step sent to the actors and not yet booked by `complete`."""

    call_id: int
    samples: int
    tokens: int | None  # token ids in the batch; None for float inputs
    wait: Wait  # wait(since) -> the step's result
    weights: list[float] | None = None  # the parts' loss weights, replica by replica (`loss_weights`)
    done: bool = False


def submit(trainer: Any, x: torch.Tensor, y: Any, index: int, after: int | None = None) -> Submitted:
    """Sends `trainer`'s step of 0-based index `index` on `(x, y)` (p2p engine) and returns while
    the actors run it; the other engines run it when it is waited for. `after`: the
    call id of the step queued before it."""
    batch = prepare(x, y, trainer.config.dp, trainer.config.microbatches, trainer._loss_fn, trainer.model.vocab_size)
    return send(trainer, batch, index, after)


def send(trainer: Any, batch: Prepared, index: int, after: int | None = None) -> Submitted:
    """`submit` of a batch already cut for the actors (by the driver, or by a dataset reader)."""
    if not trainer._actors:
        raise RaypipeError(f"{trainer!r} has no actors; build a new Trainer or call load() after a failure.")
    trainer._calls += 1
    grid = trainer.topology.grid
    target = StepTarget(
        grid(trainer._actors), grid(trainer.names), grid(range(len(trainer._actors))), trainer._schedule, trainer._order
    )
    data = StepInput(
        batch.inputs,
        batch.targets,
        trainer._calls,
        index,
        trainer.config.step_timeout,
        batch.weights,
        batch.varying,
        batch.packed,
    )
    weights = batch.weights
    return Submitted(
        trainer._calls,
        batch.samples,
        batch.tokens,
        trainer._engine.submit(target, data, after),
        [w for replica in weights for w in replica] if weights is not None else None,
    )


def step(trainer: Any, x: Any, y: Any) -> dict[str, Any] | None:
    """`Trainer.step`: one step submitted and booked. An interrupt while it runs lets the actors
    finish it and books it before re-raising, so `step_count` always matches the weights."""
    submitted = submit(trainer, x, y, trainer.step_count)
    try:
        return complete(trainer, submitted)
    except KeyboardInterrupt:
        settle(trainer, [submitted])
        raise


def complete(trainer: Any, submitted: Submitted) -> dict[str, Any] | None:
    """Waits for a submitted step and books it on `trainer`: the step count, metrics, logs and a
    checkpoint when one is due. None when the actors halted it (a step queued behind
    one that failed)."""
    try:
        result = submitted.wait(trainer._last_result_at)
    except Exception as error:  # an interrupt leaves the step pending: `settle` waits for it
        submitted.done = True
        if isinstance(error, StepTimeoutError):
            trainer.shutdown()  # a stuck actor must not linger; the error names what it waited on
        raise
    submitted.done = True
    trainer._last_result_at = time.perf_counter()
    report = result.stage_reports[0]
    if report.halted:
        return None
    if report.skipped and stops_on_nonfinite(trainer.config):
        raise NonFiniteError(
            f"step {trainer.step_count + 1}: non-finite loss or gradients (microbatch losses "
            f"{[round(v, 4) for v in result.losses]}); the update was not applied, weights are those "
            f"after step {trainer.step_count}. Set TrainConfig.nonfinite='skip' to skip such steps."
        )
    trainer.step_count += 1
    leads = [result.stage_reports[r] for r in trainer.topology.lead_ranks()]
    losses = result.losses if submitted.weights is None else [v * w for v, w in zip(result.losses, submitted.weights)]
    metrics = step_metrics(
        trainer.step_count,
        losses,
        result.seconds,
        submitted.samples,
        submitted.tokens,
        report,
        leads,
        trainer.config.precision == "fp16",
    )
    trainer._last_events = [r.events for r in leads]
    if trainer._ray_metrics is None:
        trainer._ray_metrics = RayMetrics(trainer.run_name)
    trainer._ray_metrics.log(metrics, trainer.topology.lead_ranks())
    every = trainer.config.checkpoint_every
    if every and trainer.step_count % every == 0:  # before the loggers: a logger never costs a checkpoint
        metrics["checkpoint"] = save_due(trainer, metrics)
    trainer.loggers.log(trainer.step_count, scalars(metrics))
    return metrics


def save_due(trainer: Any, metrics: dict[str, Any]) -> str:
    """Writes the checkpoint due after the step of `metrics`; returns where.

    Raises:
        SaveFailed: the save failed (disk full, a bucket error); the step itself stands.
        ActorDiedError: an actor died while saving (a recovery's matter).
    """
    try:
        return str(trainer.save())
    except (ActorDiedError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001
        raise SaveFailed(
            f"step {trainer.step_count}'s checkpoint could not be written: {type(error).__name__}: {error}", metrics
        ) from error


class SaveFailed(CheckpointError):
    """A due checkpoint could not be written; the step it follows ran and counts (`metrics`)."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics


def retry_save(trainer: Any, failure: SaveFailed, log: Callable[[str], None]) -> str:
    """Writes the checkpoint a failed save left due, spending `max_restarts` as a step failure does.

    Raises:
        SaveFailed: the restarts are used up.
    """
    while trainer.restarts < trainer.config.max_restarts:
        trainer.restarts += 1
        log(f"raypipe: {failure}; retrying the save (restart {trainer.restarts} of {trainer.config.max_restarts})")
        try:
            return save_due(trainer, failure.metrics)
        except SaveFailed as again:
            failure = again
    raise SaveFailed(
        f"{failure} -- after {trainer.restarts} restarts (TrainConfig.max_restarts="
        f"{trainer.config.max_restarts}); the weights of step {trainer.step_count} are intact in "
        f"the actors: free the space and call Trainer.save()",
        failure.metrics,
    ) from None


def fit(
    trainer: Any,
    feed: Any,
    steps: int,
    on_step: Callable[[dict[str, Any]], None] | None,
    log: Callable[[str], None],
    bar: Progress,
    overlap: bool,
) -> list[dict[str, Any]]:
    """Steps `trainer` until its step count is `steps` (see `Trainer.fit`), each step's batch from
    `feed` (`raypipe.driver.feeds`); returns every step's metrics, replayed steps again after a
    recovery."""
    history = []
    queue: list[Submitted] = []  # submitted, not yet booked; the first is the oldest
    restored = trainer.step_count  # the oldest step a recovery may replay from (the last checkpoint)
    stopped_by: BaseException | None = None
    try:
        with sigterm_as_interrupt():
            while trainer.step_count < steps:
                if not queue:
                    queue.append(send(trainer, feed.get(trainer.step_count), trainer.step_count))
                ahead, every = trainer.step_count + len(queue), trainer.config.checkpoint_every
                if overlap and ahead < steps and not (every and ahead % every == 0):
                    queue.append(send(trainer, feed.get(ahead), ahead, after=queue[-1].call_id))
                try:
                    metrics = complete(trainer, queue[0])
                    queue.pop(0)
                except ActorDiedError as error:
                    queue.clear()  # their calls end with the actors being replaced
                    recover(trainer, error, log)
                    bar.moved_to(trainer.step_count)
                    continue
                except SaveFailed as failure:
                    queue.pop(0)
                    metrics = failure.metrics
                    metrics["checkpoint"] = retry_save(trainer, failure, log)
                    trainer.loggers.log(trainer.step_count, scalars(metrics))
                if metrics is None:
                    raise RaypipeError(
                        f"step {trainer.step_count + 1} was halted by the actors, but the step "
                        f"before it succeeded: please report this as a raypipe bug"
                    )
                if "checkpoint" in metrics:
                    restored = metrics["step"]
                feed.kept_from(restored if trainer.config.max_restarts else trainer.step_count)
                history.append(metrics)
                bar.update(metrics)
                if on_step is not None:
                    on_step(metrics)
    except BaseException as error:
        stopped_by = error
        raise
    finally:
        settle(trainer, queue)
        trainer.loggers.ended(stopped_by)
        if isinstance(stopped_by, KeyboardInterrupt):
            interrupted(trainer, stopped_by, log)
    return history


def interrupted(trainer: Any, error: KeyboardInterrupt, log: Callable[[str], None]) -> None:
    """After Ctrl-C or SIGTERM stopped `fit` (its queued steps booked): a checkpoint of the last
    completed step where checkpoint_dir is set; on SIGTERM the trainer shuts down (its loggers
    closed as KILLED, its placement group released) since the process is being stopped. A Ctrl-C
    keeps the actors: a notebook goes on from here."""
    cause = "SIGTERM" if isinstance(error, Terminated) else "an interrupt"
    root = trainer.config.checkpoint_dir
    done = ckpt.location(root) / ckpt.checkpoint_name(trainer.step_count) if root is not None else None
    if done is not None and ckpt.manifest_of(done) is not None and ckpt.run_of(done) == trainer.run_id:
        log(f"raypipe: stopped by {cause} after step {trainer.step_count}, whose checkpoint {done} is complete")
    elif root is not None and trainer._actors and trainer.step_count > 0:
        try:
            log(f"raypipe: stopped by {cause} after step {trainer.step_count}; saved {trainer.save()}")
        except BaseException as failure:  # noqa: BLE001 - the interrupt is what fit re-raises
            log(
                f"raypipe: stopped by {cause} after step {trainer.step_count}; its checkpoint could not be "
                f"written: {type(failure).__name__}: {failure}"
            )
    if isinstance(error, Terminated):
        trainer.shutdown()


def settle(trainer: Any, queue: list[Submitted]) -> None:
    """Books the steps still queued when `fit` stops early (an error, an interrupt): those
    behind a failed step were halted by the actors; the others ran and count, so
    `step_count` always matches the weights."""
    for submitted in queue:
        if not submitted.done and trainer._actors:
            try:
                complete(trainer, submitted)
            except Exception:  # noqa: BLE001 - the error that stopped fit is the one to raise
                pass
