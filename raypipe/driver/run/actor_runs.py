"""Actor-driven runs on the driver (`TrainConfig.actor_steps`): `fit` hands the actors a run of
steps with one call each, and then only reads the board actor once per step (or once for
several), so what the driver spends per step does not grow with the number of actors.

The actors take their batches from the reader actor (`raypipe.actors.io.reader`), run each step as
the p2p engine would, write due checkpoints themselves (the driver prepares their directories
before the run and commits each when it books its step) and report to the board
(`raypipe.actors.step.step_board`). A run ends early only where every actor agrees it does: a failed
step, a non-finite step that stops the run, a checkpoint an actor could not write, or a stop the
driver asks for (`request_stop`). Each step comes back to the fit loop as a `Submitted` whose
wait gives the same `StepResult` a p2p step gives, so booking, checkpoints, recovery and
interrupts are the loop's, unchanged (`sources.ActorRunSteps`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from raypipe.config.engines import engine_kind
from raypipe.core.errors import ActorDiedError, BatchError, ConfigError, StepTimeoutError
from raypipe.core.protocol import RunCall, RunStep, StepReport
from raypipe.driver import checkpoints
from raypipe.driver.actor_group import ActorGroup, Submitted
from raypipe.driver.cluster.placement import CONTROL
from raypipe.driver.engines.p2p import action_lists
from raypipe.driver.engines.step_io import StepResult
from raypipe.driver.results import gather, root_failure
from raypipe.driver.run_state import RunState
from raypipe.driver.trace import trace_lists

if TYPE_CHECKING:
    from pathlib import Path

    from ray.actor import ActorHandle

    from raypipe.checkpoint.storage import StoragePath
    from raypipe.driver.feeds import Feed

HALTED = StepReport(halted=True)
# actor_steps="auto": a fit hands its steps to the actors from this many steps x actors on. Driven
# from the driver, a step costs ~1 ms of driver CPU per actor (benchmarks/driver_scaling.py: 0.9-1.1);
# a trainer's first actor-driven run starts its board and reader, ~3 s on 2 cores. 3000 repays that.
AUTO_ACTOR_STEPS = 3000
AUTO_RUN_STEPS = 256  # actor_steps="auto": the steps of one run (its due checkpoints are prepared at its start)


def length(group: ActorGroup, feed: Feed, steps_left: int, overlap: bool, log: Callable[[str], None]) -> int:
    """The steps of each actor-driven run of a `fit` with `steps_left` steps to go (0: the driver
    submits each step). An int `TrainConfig.actor_steps` is taken as given; "auto" hands the
    actors the steps where nothing tells the runs apart: the p2p engine, a fit that lets the next
    step run before `on_step` sees this one (`overlap`), a feed the actors can read (a function Ray
    can pickle, a Dataset) and enough steps x actors (AUTO_ACTOR_STEPS) to repay the seconds a
    trainer's first run spends starting its board and reader."""
    wanted = group.config.actor_steps
    if group.config.objective is not None:  # each step's pairs go through the reference pass first
        return 0
    if wanted != "auto":
        return wanted
    few = steps_left * len(group.actors) < AUTO_ACTOR_STEPS
    if not overlap or not engine_kind(group.config.engine).actor_steps or few:
        return 0
    try:
        feed.reader_for_actors()
    except ConfigError as error:
        log(f"raypipe: the driver submits each step: {error}")
        return 0
    return AUTO_RUN_STEPS


def start(group: ActorGroup, run: RunState, reader: ActorHandle, count: int) -> list[Submitted]:
    """Starts a run of `count` steps from the run's step on `group`'s actors, batches from
    `reader`; returns its steps, to be waited for in order."""
    config, first = group.config, run.step_count
    every, root = config.checkpoint_every, config.checkpoint_dir
    due = [k for k in range(first, first + count) if every and root is not None and (k + 1) % every == 0]
    partials = checkpoints.begin_saves(root, run.run_id, [k + 1 for k in due]) if due else {}
    saves = {k: checkpoints.address(partials[k + 1]) for k in due}
    board = group.step_board()
    call_id = group.calls + 1
    group.calls += count
    topology = group.topology
    grid = topology.grid
    lists = action_lists(grid(group.actors), grid(group.names), grid(range(len(group.actors))), group.schedule)
    leads = set(topology.lead_ranks())
    reporters = [r for r, lst in enumerate(lists) if r in leads or (lst.holds_last and topology.place(r)[2] == 0)]
    for k in range(first, first + count):
        trace_lists(k, group.schedule, grid(group.names))
    cut = (config.dp, config.microbatches)
    calls = [
        (
            lst.actor,
            RunCall(
                call_id,
                first,
                count,
                lst.actions,
                lst.peers,
                reader,
                board,
                lst.replica,
                rank,
                cut,
                rank in reporters,
                saves,
                config.step_timeout,
            ),
        )
        for rank, lst in enumerate(lists)
    ]
    # the board's first call waits for its process to start: an actor start's time, not a step's
    waited = config.actor_start_timeout + config.step_timeout
    ray.get(board.begin.remote(call_id, reporters, due, calls), timeout=waited)
    handle = ActorRun(group, board, call_id, first, first + count - 1, partials)
    group.actor_run = handle
    return [Submitted(call_id + i, 0, None, handle.waiter(first + i)) for i in range(count)]


class ActorRun:
    """One run as the driver sees it: the steps its board has given so far, and how it ended."""

    def __init__(
        self,
        group: ActorGroup,
        board: ActorHandle,
        call_id: int,
        first: int,
        last: int,
        partials: dict[int, Path | StoragePath],
    ) -> None:
        self.group, self.board, self.call_id, self.last, self.partials = group, board, call_id, last, partials
        self.timeout = group.config.step_timeout
        self.steps: dict[int, RunStep] = {}
        self.next = first  # the first step not yet taken from the board
        self.failure: BaseException | None = None
        self.ended = False  # every call of the run has ended
        self.stop_asked = False

    def waiter(self, step: int) -> Callable[[float], StepResult]:
        return lambda since: self.wait(step)

    def wait(self, step: int) -> StepResult:
        """Step `step`'s result once the board has it; a halted one when the run ended before it.

        Raises:
            StageError, ActorDiedError, BatchError: the run failed at this step (the root cause).
            StepTimeoutError: nothing came for `TrainConfig.step_timeout` s.
        """
        quiet_since = time.monotonic()
        while step not in self.steps:
            if self.failure is not None:
                self.release()
                raise self.failure
            if self.ended:
                self.release()
                return StepResult([], {0: HALTED}, 0.0)
            if self._poll(step):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.timeout:
                self._stuck(step)
        done = self.steps.pop(step)
        partial = self.partials.pop(step + 1, None)
        if step == self.last:  # its actors are done: the driver may call them again
            self.release()
        saved = (partial, [done.saves[r] for r in sorted(done.saves)]) if partial is not None else None
        return StepResult(done.losses, done.reports, done.seconds, (done.samples, done.tokens), saved)

    def _poll(self, step: int) -> bool:
        """One question to the board: the steps done from `step` on, and the calls that failed or
        ended. Returns whether anything changed."""
        steps, failed, self.ended = self._ask(self.timeout)
        if failed:
            self._failed(step, failed)
        return bool(steps or failed or self.ended)

    def _ask(self, timeout: float) -> tuple[list[RunStep], list[tuple[int, ray.ObjectRef]], bool]:
        try:
            steps, failed, ended = ray.get(
                self.board.wait.remote(self.call_id, self.next, timeout), timeout=timeout + 30.0
            )
        except ray.exceptions.RayActorError:
            raise StepTimeoutError(f"step {self.next + 1}: the run's board actor died") from None
        for done in steps:
            self.steps[done.step] = done
            self.next = done.step + 1
        return steps, failed, ended

    def _failed(self, step: int, failed: list[tuple[int, ray.ObjectRef]]) -> None:
        """Some calls failed: an actor's death is raised at once (its neighbours would wait for it
        until the collective timeout); otherwise every actor ends at the step's agreement, and the
        root cause is raised once they have (as the p2p engine does)."""
        errors = [self._outcome(rank, ref, step) for rank, ref in failed]
        deadline = time.monotonic() + self.timeout
        while not self.ended and not any(isinstance(e, ActorDiedError) for e in errors):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)  # the board answers at once while a failure is known
            _, failed, self.ended = self._ask(max(1.0, deadline - time.monotonic()))
            errors = [self._outcome(rank, ref, step) for rank, ref in failed]
        died = [e for e in errors if isinstance(e, ActorDiedError)]
        self.failure = died[0] if died else root_failure(errors)

    def _outcome(self, rank: int, ref: ray.ObjectRef, step: int) -> BaseException:
        try:
            gather([ref], f"step {step + 1}", [self.group.actors[rank]], [self.group.names[rank]], timeout=10.0)
        except Exception as error:  # noqa: BLE001 - the run's failure, raised by `wait`
            return _plain_cause(ref) or error
        return StepTimeoutError(f"{self.group.names[rank]}'s run reported a failure it did not raise")

    def _stuck(self, step: int) -> None:
        missing = ray.get(self.board.missing.remote(self.call_id, step), timeout=10.0)
        names = [self.group.names[r] for r in missing]
        raise StepTimeoutError(
            f"step {step + 1} of an actor-driven run made no progress for {self.timeout:.0f} s "
            f"(TrainConfig.step_timeout): no report yet from {', '.join(names[:8]) or 'the board'}"
            f"{' ...' if len(names) > 8 else ''}"
        )

    def request_stop(self) -> None:
        """Asks the actors to end the run after the step under way (one actor is told; the step's
        agreement tells the others)."""
        if not self.ended and not self.stop_asked and self.failure is None:
            self.stop_asked = True
            self.group.actors[0].request_stop.options(concurrency_group=CONTROL).remote(self.call_id)

    def release(self) -> None:
        """Deletes the directories of checkpoints the run did not reach."""
        from raypipe.checkpoint import layout as ckpt

        for partial in self.partials.values():
            ckpt.abort(partial)
        self.partials = {}
        if self.group.actor_run is self:
            self.group.actor_run = None

    def finish(self) -> None:
        """Waits until every call of the run has ended (a run its actors ended early)."""
        deadline = time.monotonic() + self.timeout
        while not self.ended and self.failure is None and time.monotonic() < deadline:
            _, _, self.ended = self._ask(1.0)
        self.release()


def _plain_cause(ref: ray.ObjectRef) -> BaseException | None:
    """A reader's error the user should see as it is (a dataset too small, a bad batch)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, (BatchError, ConfigError)):
            return error.cause
    except Exception:  # noqa: BLE001
        pass
    return None


def finish(group: ActorGroup) -> None:
    """Waits for the end of the group's run, if any, which its actors ended early."""
    if group.actor_run is not None:
        group.actor_run.finish()


def stop(group: ActorGroup) -> None:
    """Asks the group's run under way, if any, to end after its current step (`fit` stopping early)."""
    if group.actor_run is not None:
        group.actor_run.request_stop()
