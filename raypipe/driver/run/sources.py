"""Where the fit loop's steps come from. Either the driver cuts each step's batch from the feed
and sends it (`DriverSteps`), keeping the next one queued while the current one runs, or the
actors drive a run of steps reading their batches themselves (`ActorRunSteps`, `actor_runs`).
Both fill the same queue of `Submitted` steps, which the loop books in order with `step.book`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raypipe.core.errors import RaypipeError
from raypipe.driver.actor_group import ActorGroup, Submitted
from raypipe.driver.run import actor_runs
from raypipe.driver.run.interrupts import held_interrupts
from raypipe.driver.run_state import RunState

if TYPE_CHECKING:
    from raypipe.driver.feeds import Feed


class DriverSteps:
    """The driver sends each step. With `overlap` the next step is queued at the actors while the
    current one runs, except before a due checkpoint and while an elastic run is shrunk (it may
    grow back at any step boundary). An interrupt waits until a step's calls are out and queued
    (`held_interrupts`), so the loop's `settle` books what they do."""

    def __init__(self, group: ActorGroup, run: RunState, feed: Feed, steps: int, overlap: bool) -> None:
        self.group, self.run, self.feed, self.steps, self.overlap = group, run, feed, steps, overlap

    def fill(self, queue: list[Submitted]) -> None:
        if not queue:
            self.send(queue, self.run.step_count)
        ahead, every = self.run.step_count + len(queue), self.group.config.checkpoint_every
        if self.overlap and ahead < self.steps and not (every and ahead % every == 0) and self.group.shrunk is None:
            self.send(queue, ahead)

    def send(self, queue: list[Submitted], index: int) -> None:
        batch = self.feed.get(index)
        with held_interrupts():
            queue.append(self.group.submit(batch, index, after=queue[-1].call_id if queue else None))

    def halted(self, queue: list[Submitted]) -> None:
        """A step came back halted although the step before it succeeded."""
        raise RaypipeError(
            f"step {self.run.step_count + 1} was halted by the actors, but the step "
            f"before it succeeded: please report this as a raypipe bug"
        )


class ActorRunSteps:
    """The actors drive runs of up to `length` steps (`TrainConfig.actor_steps`); while an elastic
    run is shrunk the driver sends each step instead (it may grow back at any step)."""

    def __init__(self, group: ActorGroup, run: RunState, feed: Any, steps: int, length: int) -> None:
        self.group, self.run, self.feed, self.steps, self.length = group, run, feed, steps, length
        self.one_by_one = DriverSteps(group, run, feed, steps, overlap=False)

    def fill(self, queue: list[Submitted]) -> None:
        if queue:
            return
        if self.group.shrunk is not None:
            self.one_by_one.fill(queue)
            return
        reader = self.feed.reader_for_actors()
        count = min(self.length, self.steps - self.run.step_count)
        with held_interrupts():
            queue.extend(actor_runs.start(self.group, self.run, reader, count))

    def halted(self, queue: list[Submitted]) -> None:
        """The actors ended their run early (a failed step, a stop): its later steps never ran."""
        actor_runs.finish(self.group)
        queue.clear()


def source_for(
    group: ActorGroup, run: RunState, feed: Feed, steps: int, overlap: bool, log: Callable[[str], None]
) -> DriverSteps | ActorRunSteps:
    """The steps of a `fit` to `steps`: actor-driven where `TrainConfig.actor_steps` (or "auto")
    hands them to the actors (`actor_runs.length`), else sent by the driver."""
    length = actor_runs.length(group, feed, steps - run.step_count, overlap, log)
    if length:
        return ActorRunSteps(group, run, feed, steps, length)
    return DriverSteps(group, run, feed, steps, overlap)
