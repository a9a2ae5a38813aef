"""Runs of steps the actors drive themselves (`TrainConfig.actor_steps`): one call per actor for
many steps instead of one per step, so the driver's cost per step does not grow with the actors.

Each step is the p2p engine's step (`Stage.step`, through `StageActor.run_actions`) with its batch taken from the
reader actor (the next one asked for while this one runs) and its outcome told to the board
actor (`StepBoard`) by the actors the driver books it from. Every actor ends the run at the same
step, as every end is decided by the step's closing agreement: a failure (every actor raises, as
in a p2p step), a non-finite step that stops the run, a stop the driver asked of one actor, a
checkpoint some actor could not write (one more agreement, on saving steps only)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import BatchError, ConfigError, StageError
from raypipe.core.protocol import RunCall, StepCall, StepReport

if TYPE_CHECKING:
    from types import ModuleType

    from ray import ObjectRef

    from raypipe.actors.stage import Stage
    from raypipe.data.batches import Prepared

REPORT_WAIT_S = 30.0  # how long a run's end waits for its last reports to reach the board
REPORT_EVERY_S = 0.2  # reports wait at most this long to go with the next steps' (and at most CHUNK)
CHUNK = 4  # steps whose batches an actor asks the reader for at once (the next ones while these run)


class ActorRuns:
    """A stage's actor-driven runs: a part of `StageActor`. Its `Stage` holds the run's flags
    (`current_run`, `stop_run`, `stop_voted`), which the step's closing agreement reads and sets.

    Args:
        run_step: one step with its batch's references resolved (`StageActor.run_actions`).
        save: writes the stage's part of a checkpoint (`StateCalls.save_checkpoint`).
    """

    def __init__(
        self, stage: Stage, run_step: Callable[[StepCall], StepReport], save: Callable[[str], dict[str, Any]]
    ) -> None:
        self.stage, self.run_step, self.save = stage, run_step, save

    def request_stop(self, run: int) -> None:
        """Ends run `run` after the step under way, on every actor (its closing agreement carries the
        request). The driver calls it in the "control" concurrency group, so it lands mid-run."""
        self.stage.stop_run = run

    def run_steps(self, call: RunCall) -> None:
        """Runs up to `call.steps` steps from `call.step` on its own (`RunCall`). Raises as
        `run_actions` does when a step fails (after the steps before it were reported)."""
        import ray

        sent: list[object] = []
        told: list[tuple] = []  # reports not yet sent to the board, the first made at `told_since`
        told_since = ended = time.perf_counter()  # `ended`: when its step before ended (or the run began)
        end = call.step + call.steps
        fetch = lambda first: call.reader.batches.remote(first, min(CHUNK, end - first), call.cut)  # noqa: E731
        self.stage.current_run, self.stage.stop_voted = call.call_id, False
        try:
            ahead: object = fetch(call.step)
            chunk: list[object] = []
            for i in range(call.steps):
                step = call.step + i
                if i % CHUNK == 0:
                    chunk = _batches(ray, ahead, step, call.timeout)
                    ahead = fetch(step + CHUNK) if step + CHUNK < end else None
                batch = chunk[i % CHUNK]  # a list the reader's error ended is never read past it
                if isinstance(batch, Exception):  # the reader's error at this step: every actor raises it
                    raise (
                        batch
                        if isinstance(batch, (BatchError, ConfigError))
                        else BatchError(
                            f"the batch of step {step + 1} could not be made: {type(batch).__name__}: {batch}"
                        )
                    )
                weights = batch.weights[call.replica] if batch.weights is not None else None
                report = self.run_step(
                    StepCall.for_stage(
                        call_id=call.call_id + i,
                        step=step,
                        actions=call.actions,
                        peers=call.peers,
                        batch=batch.packed[call.replica],
                        weights=weights,
                        varying=batch.varying,
                        holds_first=self.stage.holds_first,
                        holds_last=self.stage.is_last,
                    )
                )
                last = i + 1 == call.steps or self.stage.stop_voted
                last = last or (report.skipped and self.stage.optim.settings.stop_on_nonfinite)
                saved = None
                if step in call.saves:
                    saved = self._save_in_run(call.saves[step])
                    last = last or self.stage.stop_voted
                now = time.perf_counter()
                if call.reports or saved is not None:
                    told_since = told_since if told else now
                    # the step's time, from the end of the one before, on this actor
                    told.append(
                        (
                            step,
                            call.rank,
                            *_told(report, saved, batch, weights if self.stage.is_last else None, last),
                            now - ended,
                        )
                    )
                ended = now
                # fast steps' reports go a few in one call; a slow step's at once (the driver's timeout)
                if told and (len(told) == CHUNK or last or now - told_since > REPORT_EVERY_S):
                    sent.append(call.board.report.remote(call.call_id, told))
                    told = []
                if last:
                    break
        finally:
            self.stage.current_run = None
            if told:
                sent.append(call.board.report.remote(call.call_id, told))
            if sent:  # reported before the call ends, so the driver books them before any failure
                ray.wait(sent, num_returns=len(sent), timeout=REPORT_WAIT_S)

    def _save_in_run(self, directory: str) -> dict:
        """Writes its part of the step's checkpoint; every actor then agrees whether all parts were
        written (a run whose checkpoint failed ends, and the driver retries the save)."""
        import torch.distributed as dist

        from raypipe.transport import agree

        try:
            saved, failed = self.save(directory), 0.0
        except Exception as error:  # noqa: BLE001 - the driver raises it, as for its own saves
            saved, failed = {"error": f"{self.stage.name}: {type(error).__name__}: {error}"}, 1.0
        votes = torch.zeros(agree.VALUES, dtype=torch.float64)
        votes[0] = failed
        if dist.is_initialized():
            votes = agree.all_sum(votes)
        self.stage.stop_voted = bool(votes[0] > 0)
        return saved


def _batches(ray: ModuleType, ahead: ObjectRef, step: int, timeout: float) -> list[Prepared | Exception]:
    """The batches from step `step` on, from the reader (each a `Prepared`, its parts as
    references, or the error that ended the list): every actor asks for them, so every actor fails
    alike when the reader cannot give them."""
    try:
        return ray.get(ahead, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise BatchError(
            f"the reader gave no batch for step {step + 1} within {timeout:.0f} s (TrainConfig.step_timeout)"
        ) from None
    except ray.exceptions.RayActorError as error:  # not this actor's death: the reader's
        raise BatchError(f"the reader of the batches died before step {step + 1}: {error}") from None
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, (BatchError, ConfigError, StageError)):
            raise error.cause from None
        raise


def _told(report: StepReport, saved: dict | None, batch: Prepared, weights: list[float] | None, last: bool) -> tuple:
    """What it tells the board of a step: its report (its per-action events only on the run's
    last step, for `Trainer.timeline`), its checkpoint part, and where it holds the losses
    (samples, tokens, each microbatch's loss times its weight)."""
    if not last:
        report = dataclasses.replace(report, events=[])
    if report.losses is None:
        return report, saved, None
    losses = report.losses if weights is None else [v * w for v, w in zip(report.losses, weights)]
    return report, saved, (batch.samples, batch.tokens, losses)
