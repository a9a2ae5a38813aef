"""Steps on the driver: one submitted to the actors and booked when its result comes back (step
count, metrics, logs, a due checkpoint), and the loop behind `Trainer.fit` - the next step kept
queued at the actors while the driver waits for the current one, recovery after an actor death,
and booking of what is left when the loop stops early.

Everything here works on the run's actors (`ActorGroup`) and its state (`RunState`), never on
the `Trainer` that holds them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raypipe.actors.settings import stops_on_nonfinite
from raypipe.checkpoint import layout as ckpt
from raypipe.checkpoint.layout import CheckpointError
from raypipe.data.batches import prepare
from raypipe.driver import actor_runs, elastic
from raypipe.driver.group import ActorGroup, Submitted
from raypipe.driver.interrupts import Terminated, held_interrupts, sigterm_as_interrupt
from raypipe.driver.recovery import recover
from raypipe.driver.run_state import RunState
from raypipe.errors import ActorDiedError, NonFiniteError, RaypipeError, StepTimeoutError
from raypipe.observe.loggers import scalars
from raypipe.observe.metrics import step_metrics
from raypipe.observe.progress import Progress


def submit(group: ActorGroup, x: Any, y: Any, index: int, after: int | None = None) -> Submitted:
    """Cuts `(x, y)` into the actors' microbatches and sends it as the step of 0-based index
    `index` (`ActorGroup.submit`); `after`: the call id of the step queued before it."""
    c = group.config
    return group.submit(prepare(x, y, c.dp, c.microbatches, group.loss_fn, group.model.vocab_size), index, after)


def step(group: ActorGroup, run: RunState, x: Any, y: Any) -> dict[str, Any] | None:
    """`Trainer.step`: one step submitted and booked. An interrupt while it runs lets the actors
    finish it and books it before re-raising, so `step_count` always matches the weights; one
    while its calls go out waits until all are out (`held_interrupts`)."""
    sent: list[Submitted] = []
    try:
        with held_interrupts():
            sent.append(submit(group, x, y, run.step_count))
        return complete(group, run, sent[0])
    except KeyboardInterrupt:
        settle(group, run, sent)
        raise


def complete(group: ActorGroup, run: RunState, submitted: Submitted) -> dict[str, Any] | None:
    """Waits for a submitted step and books it: the step count, metrics, logs and a checkpoint
    when one is due. None when the actors halted it (a step queued behind one that failed)."""
    try:
        result = submitted.wait(run.last_result_at)
    except Exception as error:  # an interrupt leaves the step pending: `settle` waits for it
        submitted.done = True
        if isinstance(error, StepTimeoutError):
            stop(group, run)  # a stuck actor must not linger; the error names what it waited on
        raise
    submitted.done = True
    run.last_result_at = time.perf_counter()
    report = result.stage_reports[0]
    if report.halted:
        return None
    config = group.config
    if report.skipped and stops_on_nonfinite(config):
        raise NonFiniteError(
            f"step {run.step_count + 1}: non-finite loss or gradients (microbatch losses "
            f"{[round(v, 4) for v in result.losses]}); the update was not applied, weights are those "
            f"after step {run.step_count}. Set TrainConfig.nonfinite='skip' to skip such steps."
        )
    run.step_count += 1
    lead_ranks = group.topology.lead_ranks()
    leads = [result.stage_reports[r] for r in lead_ranks]
    losses = result.losses if submitted.weights is None else [v * w for v, w in zip(result.losses, submitted.weights)]
    samples, tokens = result.batch or (submitted.samples, submitted.tokens)  # an actor-driven run's, else the driver's
    metrics = step_metrics(
        run.step_count,
        losses,
        result.seconds,
        samples,
        tokens,
        report,
        leads,
        config.precision == "fp16",
    )
    metrics["pp"], metrics["dp"] = config.pp, config.dp  # an elastic run's topology changes
    run.last_events, run.last_step_seconds = [r.events for r in leads], result.seconds
    run.record_on_dashboard(metrics, lead_ranks)
    every = config.checkpoint_every
    if every and run.step_count % every == 0:  # before the loggers: a logger never costs a checkpoint
        try:
            metrics["checkpoint"] = save_due(group, run, metrics, result.saved)
        except ActorDiedError as error:
            error.booked = metrics  # the step ran and counts; a recovery from memory does not replay it
            raise
    run.loggers.log(run.step_count, scalars(metrics))
    return metrics


def save_due(group: ActorGroup, run: RunState, metrics: dict[str, Any], written: Any = None) -> str:
    """Writes the checkpoint due after the step of `metrics` (or commits the one an actor-driven
    run `written`: its directory, each actor's part); returns where.

    Raises:
        SaveFailed: the save failed (disk full, a bucket error); the step itself stands.
        ActorDiedError: an actor died while saving (a recovery's matter).
    """
    try:
        return str(group.save(group.config.checkpoint_dir, run, written))
    except (ActorDiedError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001
        raise SaveFailed(
            f"step {run.step_count}'s checkpoint could not be written: {type(error).__name__}: {error}", metrics
        ) from error


class SaveFailed(CheckpointError):
    """A due checkpoint could not be written; the step it follows ran and counts (`metrics`)."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics


def retry_save(group: ActorGroup, run: RunState, failure: SaveFailed, log: Callable[[str], None]) -> str:
    """Writes the checkpoint a failed save left due, spending `max_restarts` as a step failure does.

    Raises:
        SaveFailed: the restarts are used up.
    """
    limit = group.config.max_restarts
    while run.restarts < limit:
        run.restarts += 1
        log(f"raypipe: {failure}; retrying the save (restart {run.restarts} of {limit})")
        try:
            return save_due(group, run, failure.metrics)
        except SaveFailed as again:
            failure = again
    raise SaveFailed(
        f"{failure} -- after {run.restarts} restarts (TrainConfig.max_restarts={limit}); the weights of step "
        f"{run.step_count} are intact in the actors: free the space and call Trainer.save()",
        failure.metrics,
    ) from None


def fit_with(
    group: ActorGroup,
    run: RunState,
    feed: Any,
    steps: int,
    on_step: Callable[[dict[str, Any]], None] | None,
    log: Callable[[str], None],
    progress: bool | Progress,
    overlap: bool | None,
) -> list[dict[str, Any]]:
    """`Trainer.fit`: `fit` with its progress bar (`progress`: shown or not, or the caller's own)
    and its overlap decided (None: overlap when no `on_step` sees each step), the feed closed after."""
    if steps <= run.step_count:  # `steps` is the count to reach: a notebook's re-run cell would train nothing
        log(
            f"raypipe: fit(..., {steps}) runs no step: the trainer is at step {run.step_count} already (steps is "
            f"the step count to reach; fit(batches, {run.step_count + steps}) runs {steps} more)"
        )
    overlap = (on_step is None if overlap is None else overlap) and group.config.engine == "p2p"
    bar = progress if isinstance(progress, Progress) else Progress(steps, run.step_count, bool(progress))
    try:
        return fit(group, run, feed, steps, on_step, bar.writer(log), bar, overlap)
    finally:
        feed.close()
        if bar is not progress:
            bar.close()


def fit(
    group: ActorGroup,
    run: RunState,
    feed: Any,
    steps: int,
    on_step: Callable[[dict[str, Any]], None] | None,
    log: Callable[[str], None],
    bar: Progress,
    overlap: bool,
) -> list[dict[str, Any]]:
    """Steps the run until its step count is `steps` (see `Trainer.fit`), each step's batch from
    `feed` (`raypipe.driver.feeds`); returns every step's metrics, replayed steps again after a
    recovery."""
    history = []
    queue: list[Submitted] = []  # submitted, not yet booked; the first is the oldest
    restored = run.step_count  # the oldest step a recovery may replay from (the last checkpoint)
    stopped_by: BaseException | None = None
    run_steps = actor_runs.length(group, feed, steps - run.step_count, overlap, log)
    try:
        with sigterm_as_interrupt():
            while run.step_count < steps:
                every = group.config.checkpoint_every
                if not queue:
                    queue_next(group, run, feed, steps, run_steps, queue)
                ahead = run.step_count + len(queue)
                # a shrunk run queues none: it may grow back at any step boundary; an actor-driven run
                # has its steps queued already
                if (
                    overlap
                    and not run_steps
                    and ahead < steps
                    and not (every and ahead % every == 0)
                    and group.shrunk is None
                ):
                    batch = feed.get(ahead)
                    with held_interrupts():  # queued before an interrupt raises: `settle` books it
                        queue.append(group.submit(batch, ahead, after=queue[-1].call_id))
                try:
                    metrics = complete(group, run, queue[0])
                    queue.pop(0)
                except ActorDiedError as error:
                    queue.clear()  # their calls end with the actors being replaced
                    recover(group, run, error, log)
                    bar.moved_to(run.step_count)
                    metrics = error.booked
                    if metrics is None or run.step_count < metrics["step"]:  # replayed from a checkpoint
                        continue
                    metrics["checkpoint"] = save_due(group, run, metrics)  # restored from memory: the step stands
                    run.loggers.log(run.step_count, scalars(metrics))
                except SaveFailed as failure:
                    queue.pop(0)
                    actor_runs.finish(group)  # an actor-driven run ends after a failed save: retried after it
                    metrics = failure.metrics
                    metrics["checkpoint"] = retry_save(group, run, failure, log)
                    run.loggers.log(run.step_count, scalars(metrics))
                if metrics is None and run_steps:  # the actors ended their run early
                    actor_runs.finish(group)
                    queue.clear()
                    continue
                if metrics is None:
                    raise RaypipeError(
                        f"step {run.step_count + 1} was halted by the actors, but the step "
                        f"before it succeeded: please report this as a raypipe bug"
                    )
                if "checkpoint" in metrics:
                    restored = metrics["step"]
                if group.shrunk is not None and not queue:  # an elastic run grows back here
                    elastic.grow_back(group, run, metrics.get("checkpoint"), log)
                feed.kept_from(restored if group.config.max_restarts else run.step_count)
                history.append(metrics)
                bar.update(metrics)
                if on_step is not None:
                    on_step(metrics)
    except BaseException as error:
        stopped_by = error
        raise
    finally:
        settle(group, run, queue)
        run.loggers.ended(stopped_by)
        if isinstance(stopped_by, KeyboardInterrupt):
            interrupted(group, run, stopped_by, log)
    return history


def queue_next(group: ActorGroup, run: RunState, feed: Any, steps: int, run_steps: int, queue: list) -> None:
    """Queues the next step submitted, or a run of up to `run_steps` handed to the actors
    (`actor_runs`; not while an elastic run is shrunk: it may grow back at any step). An interrupt
    waits until the calls are out and queued (`held_interrupts`), so `settle` books what they do."""
    count = min(run_steps, steps - run.step_count)
    if count and group.shrunk is None:
        reader = feed.reader_for_actors()
        with held_interrupts():
            queue.extend(actor_runs.start(group, run, reader, count))
        return
    batch = feed.get(run.step_count)
    with held_interrupts():
        queue.append(group.submit(batch, run.step_count))


def interrupted(group: ActorGroup, run: RunState, error: KeyboardInterrupt, log: Callable[[str], None]) -> None:
    """After Ctrl-C or SIGTERM stopped `fit` (its queued steps booked): a checkpoint of the last
    completed step where checkpoint_dir is set; on SIGTERM the actors stop (the loggers closed as
    KILLED, the placement group released) since the process is being stopped. A Ctrl-C keeps the
    actors: a notebook goes on from here."""
    cause = "SIGTERM" if isinstance(error, Terminated) else "an interrupt"
    root = group.config.checkpoint_dir
    done = saved_already(group, run)
    error.reported = True  # the job's entry point adds no line of its own (`raypipe.job.stop_code`)
    if done is not None:
        log(f"raypipe: stopped by {cause} after step {run.step_count}, whose checkpoint {done} is complete")
    elif root is not None and group.running and run.step_count > 0:
        try:
            log(f"raypipe: stopped by {cause} after step {run.step_count}; saved {group.save(root, run)}")
        except BaseException as failure:  # noqa: BLE001 - the interrupt is what fit re-raises
            log(
                f"raypipe: stopped by {cause} after step {run.step_count}; its checkpoint could not be "
                f"written: {type(failure).__name__}: {failure}"
            )
    if root is None:
        log(f"raypipe: stopped by {cause} after step {run.step_count} (no checkpoint_dir: nothing saved)")
    if isinstance(error, Terminated):
        stop(group, run)


def saved_already(group: ActorGroup, run: RunState) -> Any:
    """The run's complete checkpoint of its current step in its checkpoint_dir, or None."""
    root = group.config.checkpoint_dir
    done = ckpt.location(root) / ckpt.checkpoint_name(run.step_count) if root is not None else None
    if done is not None and ckpt.manifest_of(done) is not None and ckpt.run_of(done) == run.run_id:
        return done
    return None


def save_last(group: ActorGroup, run: RunState) -> Any:
    """At a run's normal end: its last step's checkpoint, written unless it is there already (a
    run of 60 steps saving every 50 ends with step 60 saved too); None without a checkpoint_dir."""
    if group.config.checkpoint_dir is None or run.step_count == 0:
        return None
    return saved_already(group, run) or group.save(group.config.checkpoint_dir, run)


def settle(group: ActorGroup, run: RunState, queue: list[Submitted]) -> None:
    """Books the steps still queued when `fit` stops early (an error, an interrupt): those
    behind a failed step were halted by the actors; the others ran and count, so
    `step_count` always matches the weights."""
    actor_runs.stop(group)  # an actor-driven run ends after its step under way
    for submitted in queue:
        if not submitted.done and group.running:
            try:
                complete(group, run, submitted)
            except Exception:  # noqa: BLE001 - the error that stopped fit is the one to raise
                pass


def stop(group: ActorGroup, run: RunState) -> None:
    """Ends the run's actors and closes its loggers (a stuck step, a SIGTERM)."""
    group.shutdown()
    run.loggers.close()
