"""`Trainer.fit`: the loop that steps a run until its step count reaches the target, as a small
state machine. Each turn the step source fills the queue (`sources`), the oldest queued step is
booked (`step.book`) and its `Outcome` handled: a booked step recorded; an actor's death a
restart as the `RecoveryPolicy` decides (`recovery`); a failed save written again; a halted
step the end of an actor-driven run. States: "running"; "recovering" (new actors starting);
"shrunk" (an elastic run on fewer actors, which grows back at a step boundary); "stopping" (an
error or interrupt: queued steps are booked, an interrupt's checkpoint written)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raypipe.config.engines import engine_kind
from raypipe.core.errors import ActorDiedError, StepTimeoutError
from raypipe.driver.actor_group import ActorGroup, Submitted
from raypipe.driver.run import actor_runs, elastic
from raypipe.driver.run.ending import interrupted
from raypipe.driver.run.interrupts import sigterm_as_interrupt
from raypipe.driver.run.policy import RecoveryPolicy
from raypipe.driver.run.recovery import recover
from raypipe.driver.run.sources import source_for
from raypipe.driver.run.step import Outcome, SaveFailed, book, save_due, settle, stop
from raypipe.driver.run_state import RunState
from raypipe.objectives import objective_for
from raypipe.observe.loggers import scalars
from raypipe.observe.progress import Progress

if TYPE_CHECKING:
    from raypipe.driver.feeds import Feed


def fit_with(
    group: ActorGroup,
    run: RunState,
    feed: Feed,
    steps: int,
    on_step: Callable[[dict[str, Any]], None] | None,
    log: Callable[[str], None],
    progress: bool | Progress,
    overlap: bool | None,
) -> list[dict[str, object]]:
    """`Trainer.fit`: the loop with its progress bar (`progress`: shown or not, or the caller's
    own) and its overlap decided (None: overlap when no `on_step` sees each step), the feed
    closed after."""
    if steps <= run.step_count:  # `steps` is the count to reach: a notebook's re-run cell would train nothing
        log(
            f"raypipe: fit(..., {steps}) runs no step: the trainer is at step {run.step_count} already (steps is "
            f"the step count to reach; fit(batches, {run.step_count + steps}) runs {steps} more)"
        )
    generates = group.config.objective is not None and objective_for(group.config.objective).generates
    queues = engine_kind(group.config.engine).queues_steps and not generates
    overlap = (on_step is None if overlap is None else overlap) and queues
    bar = progress if isinstance(progress, Progress) else Progress(steps, run.step_count, bool(progress))
    try:
        return FitLoop(group, run, feed, steps, on_step, bar.writer(log), bar, overlap).run_to_end()
    finally:
        feed.close()
        if bar is not progress:
            bar.close()


class FitLoop:
    """One `fit` call: steps the run until its step count is `steps`, each step's batch from
    `feed` (`raypipe.driver.feeds`); `run_to_end` returns every step's metrics, replayed steps
    again after a recovery."""

    def __init__(
        self,
        group: ActorGroup,
        run: RunState,
        feed: Feed,
        steps: int,
        on_step: Callable[[dict[str, Any]], None] | None,
        log: Callable[[str], None],
        bar: Progress,
        overlap: bool,
    ) -> None:
        self.group, self.run, self.feed, self.steps = group, run, feed, steps
        self.on_step, self.log, self.bar = on_step, log, bar
        self.policy = RecoveryPolicy(group.config)
        self.source = source_for(group, run, feed, steps, overlap, log)
        self.queue: list[Submitted] = []  # submitted, not yet booked; the first is the oldest
        self.restored = run.step_count  # the oldest step a recovery may replay from (the last checkpoint)
        self.history: list[dict[str, object]] = []
        self.phase: str | None = None  # "recovering" or "stopping" while it lasts

    @property
    def state(self) -> str:
        """ "running", "recovering", "shrunk" (an elastic run on fewer actors) or "stopping"."""
        return self.phase or ("shrunk" if self.group.shrunk is not None else "running")

    def run_to_end(self) -> list[dict[str, object]]:
        stopped_by: BaseException | None = None
        try:
            with sigterm_as_interrupt():
                while self.run.step_count < self.steps:
                    died = self.fill()
                    metrics = self.handle(died or book(self.group, self.run, self.queue[0]))
                    if metrics is not None:
                        self.booked(metrics)
        except BaseException as error:
            stopped_by, self.phase = error, "stopping"
            raise
        finally:
            settle(self.group, self.run, self.queue)
            self.run.loggers.ended(stopped_by)
            if isinstance(stopped_by, KeyboardInterrupt):
                interrupted(self.group, self.run, stopped_by, self.log)
        return self.history

    def fill(self) -> Outcome | None:
        """Queues the next steps. Their batches may need passes through the actors first (an
        objective's reference log-probs, generation): a death in one is the step's own, recovered
        from as `book` recovers (None: none died). A pass that timed out stops the actors, as a
        stuck step does, then raises.

        Raises:
            StepTimeoutError: a pass made no progress within `step_timeout`.
        """
        try:
            self.source.fill(self.queue)
        except ActorDiedError as died:
            for submitted in self.queue:  # queued behind the dead actor: recovered, then replayed
                submitted.done = True
            return Outcome(kind="died", error=died)
        except StepTimeoutError:
            stop(self.group, self.run)
            raise
        return None

    def handle(self, outcome: Outcome) -> dict[str, object] | None:
        """The metrics of the step `outcome` booked, once what it calls for is done; None when no
        step is booked this turn (steps replayed from a checkpoint, an actor-driven run's end)."""
        group, run = self.group, self.run
        if outcome.kind == "booked":
            self.queue.pop(0)
            return outcome.metrics
        if outcome.kind == "halted":
            self.source.halted(self.queue)
            return None
        metrics = outcome.metrics
        if outcome.kind == "save_failed":
            self.queue.pop(0)
            actor_runs.finish(group)  # an actor-driven run ends after a failed save: retried after it
            metrics["checkpoint"] = self.retry_save(outcome.error)
        else:  # "died": its calls end with the actors being replaced
            self.queue.clear()
            self.phase = "recovering"
            recover(group, run, outcome.error, self.log, self.policy)
            self.phase = None
            self.bar.moved_to(run.step_count)
            if metrics is None or run.step_count < metrics["step"]:  # replayed from a checkpoint
                return None
            metrics["checkpoint"] = save_due(group, run, metrics)  # restored from memory: the step stands
        run.loggers.log(run.step_count, scalars(metrics))
        return metrics

    def booked(self, metrics: dict[str, Any]) -> None:
        """A step counts: an elastic run grows back here, the feed lets go of what no recovery
        replays, and the step is shown and handed to `on_step`."""
        if "checkpoint" in metrics:
            self.restored = metrics["step"]
        if self.group.shrunk is not None and not self.queue:
            elastic.grow_back(self.group, self.run, metrics.get("checkpoint"), self.log)
        self.feed.kept_from(self.restored if self.group.config.max_restarts else self.run.step_count)
        self.history.append(metrics)
        self.bar.update(metrics)
        if self.on_step is not None:
            self.on_step(metrics)

    def retry_save(self, failure: SaveFailed) -> str:
        """Writes the checkpoint a failed save left due, while the policy allows (a retry spends a
        restart, as a step failure does).

        Raises:
            SaveFailed: the restarts are used up.
        """
        while (decision := self.policy.after_save_failure(self.run)).action == "retry_save":
            self.run.restarts += 1
            self.log(f"raypipe: {failure}; retrying the save (restart {self.run.restarts} of {self.policy.limit})")
            try:
                return save_due(self.group, self.run, failure.metrics)
            except SaveFailed as again:
                failure = again
        cause = failure.__cause__
        full = (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "No space left" in str(failure)
        fix = "free the space" if full else "mend what the error above names"
        raise SaveFailed(
            f"{failure} -- {decision.reason}; the weights of step {self.run.step_count} are intact in the "
            f"actors: {fix}, then call Trainer.save() (a job: run it again with --resume, from its last checkpoint)",
            failure.metrics,
        ) from cause
